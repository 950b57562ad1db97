"""The PrometheusRule's alerts: valid for promtool, built only on exported metrics, and unit-tested
with `promtool test rules`: each fires on synthetic series that break it, none on healthy ones."""

import subprocess

import pytest
import yaml

from tests.deploy.test_manifests import render
from tests.helpers import exported_series, metric_names, system_tool

ALERTS = {"NmtserveDown", "NmtserveInternalErrors", "NmtserveRejectingForCapacity", "NmtserveQueueBacklog",
          "NmtserveSlowRequests", "NmtserveSlowFirstToken", "NmtserveRestarting", "NmtserveMemoryNearLimit"}
POD = {"namespace": "ml", "pod": "nmtserve-a"}
MODEL = "en-fr"


def _series(name: str, values: str, **labels) -> dict:
    labels = {**POD, **labels}
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def _histogram(name: str, bounds_per_minute: dict[str, int]) -> list[dict]:
    """Cumulative buckets growing by the given count per minute (per bound), for 30 minutes."""
    return [_series(name + "_bucket", f"0+{per_minute}x30", model=MODEL, le=le)
            for le, per_minute in bounds_per_minute.items()]


def _traffic(ok_per_minute: int, internal: int, exhausted: int, waiting: int, slow: bool) -> list[dict]:
    """One pod's series for 30 minutes: calls by code, refusals, the queue, and latency histograms."""
    up = "1 1 0x28" if slow else "1x30"  # a broken pod also stops answering scrapes from minute 2
    latency = {"1.0": 0 if slow else 60, "2.5": 0 if slow else 60, "5.0": 60, "+Inf": 60}
    first_token = {"0.5": 0 if slow else 60, "1.0": 0 if slow else 60, "2.5": 60, "+Inf": 60}
    return [
        _series("up", up, job="nmtserve"),
        _series("nmtserve_requests_total", f"0+{ok_per_minute}x30", model=MODEL, rpc="Translate", code="OK"),
        _series("nmtserve_requests_total", f"0+{internal}x30", model=MODEL, rpc="Translate", code="INTERNAL"),
        _series("nmtserve_requests_total", f"0+{exhausted}x30", model=MODEL, rpc="Translate", code="RESOURCE_EXHAUSTED"),
        _series("nmtserve_rejected_requests_total", f"0+{exhausted}x30", model=MODEL, code="RESOURCE_EXHAUSTED"),
        _series("nmtserve_requests_waiting", f"{waiting}x30", model=MODEL),
        *_histogram("nmtserve_request_duration_seconds", latency),
        *_histogram("nmtserve_time_to_first_token_seconds", first_token),
        # a broken pod's process starts again every 5 minutes and holds 95% of its memory limit
        _series("process_start_time_seconds", "1000x4 1300x4 1600x4 1900x4 2200x4 2500x4 2800x4 3100x2" if slow
                else "1000x30", job="nmtserve"),
        _series("process_resident_memory_bytes", f"{3.8e9 if slow else 1.2e9:.0f}x30", job="nmtserve"),
        _series("nmtserve_memory_limit_bytes", f"{4e9:.0f}x30", job="nmtserve"),
    ]


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    """The rule groups as the operator hands them to Prometheus, and a copy without annotations
    (promtool's unit tests compare annotations verbatim; their templates are checked by `check rules`)."""
    promtool = system_tool("promtool")
    out = tmp_path_factory.mktemp("rules")
    spec = render("cpu")["PrometheusRule"]["spec"]
    (out / "nmtserve.rules.yml").write_text(yaml.safe_dump(spec))
    bare = {"groups": [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
                       for g in spec["groups"]]}
    (out / "bare.rules.yml").write_text(yaml.safe_dump(bare))
    return promtool, out, spec


def test_rules_pass_promtool_and_query_only_exported_metrics(rules):
    promtool, out, spec = rules
    check = subprocess.run([promtool, "check", "rules", str(out / "nmtserve.rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    alerts = {r["alert"]: r["expr"] for g in spec["groups"] for r in g["rules"]}
    assert set(alerts) == ALERTS
    used = set().union(*map(metric_names, alerts.values()))
    assert used <= exported_series(), f"not exported by server/metrics.py: {sorted(used - exported_series())}"


def test_each_alert_fires_on_a_broken_pod_and_none_on_a_healthy_one(rules):
    promtool, out, _ = rules
    scope = {"namespace": "ml", "model": MODEL}  # errors, refusals and latency alert per model
    broken = {"NmtserveDown": {**POD, "job": "nmtserve"}, "NmtserveInternalErrors": scope,
              "NmtserveRejectingForCapacity": scope, "NmtserveQueueBacklog": POD,
              "NmtserveSlowRequests": scope, "NmtserveSlowFirstToken": scope,
              "NmtserveRestarting": {**POD, "job": "nmtserve"}, "NmtserveMemoryNearLimit": POD}
    severity = {"NmtserveDown": "critical", "NmtserveInternalErrors": "critical"}
    tests = {
        "rule_files": ["bare.rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": _traffic(600, internal=60, exhausted=120, waiting=100, slow=True),
             "alert_rule_test": [{"eval_time": "15m", "alertname": name,
                                  "exp_alerts": [{"exp_labels": {**labels, "severity": severity.get(name, "warning")}}]}
                                 for name, labels in broken.items()]},
            {"interval": "1m", "input_series": _traffic(600, internal=0, exhausted=1, waiting=3, slow=False),
             "alert_rule_test": [{"eval_time": "15m", "alertname": name, "exp_alerts": []} for name in sorted(ALERTS)]},
        ],
    }
    (out / "tests.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", "tests.yml"], capture_output=True, text=True, cwd=out)
    assert result.returncode == 0, result.stdout + result.stderr
