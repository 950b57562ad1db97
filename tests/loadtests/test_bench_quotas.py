"""`nmtserve bench quotas` end to end on the tiny bundle: one server with API keys, each flood in a process of its
own, probes of another key, every probe succeeding; the quota holds the limited floods to their characters (figures
of latency are not judged here)."""

import json

from tests.helpers import ROOT, run_cli, system_tool


def test_quotas_bench_floods_with_one_key_and_probes_with_another(tiny_bundle, tmp_path):
    out = tmp_path / "quotas.json"
    result = run_cli("bench", "quotas", str(tiny_bundle), "--chars-per-minute", "600", "--flood-clients", "4",
                     "--probes", "5", "--seconds", "2", "--runs", "1", "--report", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    results = {key: cell["median"] for key, cell in report["results"].items()}
    assert all(results[f"probe_{cell}_p50_ms"] > 0 for cell in ("alone", "polite", "hostile", "open"))
    # 600 characters a minute: at most the full bucket and ~10 characters a second, a few sentences in all
    assert results["flood_hostile_sentences_per_s"] < 50 < results["flood_open_sentences_per_s"]
    assert results["flood_hostile_refused_calls_per_s"] > results["flood_polite_refused_calls_per_s"]
    assert results["flood_open_refused_calls_per_s"] == 0
    assert results["flood_hostile_refused_in_front_per_s"] == 0 and report["limiter"] is None  # no limiter: none
    assert set(report["ratios"]) == {f"probe p50 under the {flood} flood/alone" for flood in ("polite", "hostile", "open")}
    assert report["machine"]["cpu"] in result.stdout


def test_through_the_limiter_a_flood_that_never_waits_is_refused_in_front(tiny_bundle, tmp_path):
    """--limiter: every call through the deployment's HAProxy configuration. The hostile flood (8 clients that
    re-send each refusal at once) goes over the ceiling, and HAProxy refuses it; the probes of another key, one
    call at a time, stay under it and all succeed (the bench fails otherwise)."""
    system_tool("haproxy")
    out = tmp_path / "quotas.json"
    config = ROOT / "deploy" / "kubernetes" / "overlays" / "limiter" / "haproxy.cfg"
    result = run_cli("bench", "quotas", str(tiny_bundle), "--flood-clients", "8", "--probes", "5", "--seconds", "2",
                     "--runs", "1", "--limiter", str(config), "--limiter-calls-per-second", "400", "--flood-nice", "1",
                     "--report", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    results = {key: cell["median"] for key, cell in report["results"].items()}
    assert report["limiter"] == {"config": str(config), "calls_per_second": 400} and report["flood_nice"] == 1
    # most of its refusals are HAProxy's (the two counts are read a few milliseconds apart)
    assert results["flood_hostile_refused_in_front_per_s"] > 0.5 * results["flood_hostile_refused_calls_per_s"] > 0
    assert results["flood_polite_refused_in_front_per_s"] == 0  # it waits: under the ceiling
    assert "every call through HAProxy" in result.stdout
