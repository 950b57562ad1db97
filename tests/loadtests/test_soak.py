"""`nmtserve soak` against a server it starts on loopback: a short run passes, and each failure it
must catch makes the verdict fail."""

import copy
import json

import pytest

from nmtserve.loadtests.soak import KINDS, judge, memory_verdict
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def soak_run(tiny_bundle, tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    # 15 s leave a warm-up of 5 s and windows of ~3 s (a scrape a second): too short for the 10% memory
    # bound of a real soak (README: 10 minutes), so the bound is loose here; the verdict's arithmetic is
    # tested below
    result = run_cli("soak", str(tiny_bundle), "--sentences-file", str(tiny_corpus / "test.tsv"),
                     "--seconds", "15", "--sample-seconds", "1", "--clients", "8", "--out", str(out),
                     "--max-memory-growth", "0.5", timeout=400)
    return result, out


def test_a_short_soak_sends_every_kind_and_passes(soak_run):
    result, out = soak_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert {kind.split(":")[0] for kind in report["calls"]} == set(KINDS)
    assert sum(n for codes in report["calls"].values() for n in codes.values()) >= 100
    assert report["calls"]["cancelled stream"].get("CANCELLED", 0) > 0
    assert report["calls"]["1 ms deadline"].get("DEADLINE_EXCEEDED", 0) > 0
    assert report["health"] == "SERVING" and report["fixed_sentence_same"]
    assert report["gauges_after"] == {"passed": True, "rss_bytes": report["gauges_after"]["rss_bytes"],
                                      "running": 0.0, "waiting": 0.0}
    assert report["memory"]["measured"] and len(report["samples"]) >= 10
    assert (out / "memory.png").stat().st_size > 10_000
    assert '"rpc": "Translate"' in (out / "server.log").read_text() and report["server_log_tracebacks"] == 0


def test_the_verdict_fails_on_each_thing_it_checks(soak_run):
    report = json.loads((soak_run[1] / "report.json").read_text())
    assert judge(report) == []

    def failures(change) -> list[str]:
        broken = copy.deepcopy(report)
        change(broken)
        return judge(broken)

    assert failures(lambda r: r["calls"]["unary"].update(INTERNAL=1)) == ["1 × INTERNAL in 'unary'"]
    assert failures(lambda r: r["calls"]["stream"].update(UNKNOWN=2)) == ["2 × UNKNOWN in 'stream'"]
    assert failures(lambda r: r["calls"]["slow stream"].update(UNAVAILABLE=1)) == ["1 × UNAVAILABLE in 'slow stream'"]
    assert failures(lambda r: r["calls"]["invalid: empty sentence"].update(OK=1)) == \
        ["1 × OK in 'invalid: empty sentence'"]
    assert failures(lambda r: r["calls"]["unary"].update(RESOURCE_EXHAUSTED=3)) == []  # a correct refusal
    assert failures(lambda r: r.update(server_log_tracebacks=2)) == ["the server's log holds 2 traceback(s)"]
    assert failures(lambda r: r.update(health="NOT_SERVING")) == ["health is NOT_SERVING after the run"]
    assert failures(lambda r: r.update(fixed_sentence_same=False)) == \
        ["the fixed sentence translates differently after the run"]
    assert failures(lambda r: r["gauges_after"].update(passed=False, running=1.0)) == \
        ["gauges not back at 0 after the run: running 1.0, waiting 0.0"]


def test_memory_growth_compares_the_median_level_after_the_warm_up():
    def samples(values):  # one sample every 2 s, MB
        return [(2.0 * i, {"rss_bytes": mb * 2**20}) for i, mb in enumerate(values)]

    noisy_flat = [100, 300] + [300, 480, 310] * 40 + [700]  # warm-up, then rising and falling with the batch
    verdict = memory_verdict(samples(noisy_flat), warmup=4, bound=0.10)
    assert verdict["passed"] and verdict["growth"] == 0.0 and verdict["max_mb"] == 700
    leaking = [100, 300] + [300 + i for i in range(120)]  # +1 MB every 2 s
    verdict = memory_verdict(samples(leaking), warmup=4, bound=0.10)
    assert not verdict["passed"] and verdict["growth"] == pytest.approx(399.5 / 319.5 - 1, abs=1e-3)
    assert not memory_verdict(samples([100, 200, 300, 300, 300]), warmup=4, bound=0.10)["measured"]
