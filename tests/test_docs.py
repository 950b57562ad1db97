"""The user guide against the code it describes: docs/operations.md's metrics table is server/metrics.py's
registry (every metric, its type and labels, its help text first), its alerts are the PrometheusRule's, and
every relative link in README.md and docs/*.md leads to a file."""

from __future__ import annotations

import re
import time

import yaml

from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.server.metrics import ServerMetrics
from tests.helpers import ROOT

OPERATIONS = ROOT / "docs" / "operations.md"


def _populated() -> ServerMetrics:
    """A registry with one series of every metric, so that each family's samples show its labels."""
    metrics = ServerMetrics()

    class Engine:  # what watch_engine reads at each scrape
        def stats(self) -> dict:
            return {"running": 0, "waiting": 0, "steps": 0, "admissions": 0}

    metrics.watch_engine("m", Engine())
    metrics.step("m", 1, 1, 0.01)
    now = time.monotonic()
    metrics.sentence("m", "Translate", Request([1, 2], finish=FinishReason.EOS, tokens=[3, 4], admitted=now,
                                               first_token=now, finished=now))
    metrics.sentence("m", "Translate", Request([1], finish=FinishReason.CANCELLED))
    metrics.rpc("m", "greedy", "Translate", "OK", "web", characters=7, rejected=True)
    metrics.over_quota("web", "characters")
    metrics.model.labels("m").info({"bundle": "b", "variant": "fp32", "device": "cpu"})
    return metrics


def _table(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table under `## heading`."""
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]  # the header row left out


def test_the_metrics_table_is_the_servers_registry():
    expected = {}
    for family in _populated().registry.collect():
        if not family.name.startswith("process_"):
            name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
            expected[name] = (family.type, sorted({k for s in family.samples for k in s.labels} - {"le"}),
                              family.documentation)
    documented = {}
    for name, kind, labels, meaning in _table(OPERATIONS.read_text(), "Metrics"):
        documented[name.strip("`")] = (kind, sorted(re.findall(r"`(\w+)`", labels)), meaning)
    assert sorted(documented) == sorted(expected), "docs/operations.md's metrics differ from server/metrics.py's"
    for name, (kind, labels, help_text) in expected.items():
        assert documented[name][:2] == (kind, labels), name
        assert documented[name][2].startswith(help_text), f"{name}: the meaning starts with its help text {help_text!r}"


def test_the_alerts_table_is_the_prometheus_rule():
    rule = yaml.safe_load((ROOT / "deploy/kubernetes/base/prometheusrule.yaml").read_text())
    alerts = {r["alert"]: r["labels"]["severity"] for group in rule["spec"]["groups"] for r in group["rules"]}
    documented = {name.strip("`"): severity for name, _, severity in _table(OPERATIONS.read_text(), "Alerts")}
    assert documented == alerts


def test_every_relative_link_of_the_guide_leads_to_a_file():
    pages = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
