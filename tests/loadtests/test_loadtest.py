"""`nmtserve loadtest` headless against a real server with the tiny bundle, and the SLO checker."""

import json
import re

import pytest

from nmtserve.loadtests.run import bottleneck
from nmtserve.loadtests.slo import read_stats
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def steady_run(tiny_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("loadtest")
    result = run_cli("loadtest", str(tiny_bundle), "--scenario", "steady", "--seconds", "12",
                     "--peak-users", "4", "--out", str(out), timeout=240)
    return result, out


def test_short_steady_run_has_no_failure_and_writes_every_result(steady_run):
    result, out = steady_run
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for name in ("stats_stats.csv", "stats_stats_history.csv", "report.html", "chart.png", "server.log"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stats = read_stats(out / "stats_stats.csv")
    assert stats["Translate"]["Request Count"] > 10 and stats["TranslateStream"]["Request Count"] > 0
    assert stats["TranslateStream TTFT"]["Request Count"] > 0 and "TranslateStream inter-token" in stats
    assert stats["TranslateText"]["Request Count"] > 0  # documents, split and rejoined by the server
    assert sum(row["Failure Count"] for row in stats.values()) == 0
    # where a call's time went, from the started server's metrics (scraped before and after) and locust's calls
    line = next(line for line in result.stdout.splitlines() if line.startswith("where the time went"))
    call, queue, decoding, outside = map(float, re.findall(r"([\d.]+) ms", line))
    assert call > 0 and decoding > 0 and queue >= 0 and outside >= 0 and "the largest share: " in line, line


def test_the_http_front_under_load_with_an_api_key_has_the_same_entries_and_meets_the_slo(tiny_bundle, tmp_path):
    """--protocol http: the same users through the HTTP/JSON front (streams as server-sent events), each call with
    the client's key (a server with --api-keys), checked against an SLO file as a gRPC run is."""
    from nmtserve.server.auth import client_entry

    keys, slo = tmp_path / "keys.toml", tmp_path / "slo.toml"
    keys.write_text(client_entry("locust", "key-of-the-load-test"))
    slo.write_text("p95_latency_ms = 60000\np95_time_to_first_token_ms = 60000\nmax_error_rate = 0.0\n"
                   "min_throughput_rps = 0.5\n")
    out = tmp_path / "run"
    result = run_cli("loadtest", str(tiny_bundle), "--protocol", "http", "--scenario", "steady", "--seconds", "10",
                     "--peak-users", "4", "--out", str(out), f"--server-flag=--api-keys={keys}", "--slo", str(slo),
                     timeout=240, env={"NMTSERVE_API_KEY": "key-of-the-load-test"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "(http)" in result.stdout and "measured: p95_latency_ms" in result.stdout
    assert "SLO violated" not in result.stdout
    stats = read_stats(out / "stats_stats.csv")
    for name in ("Translate", "TranslateStream", "TranslateStream TTFT", "TranslateText"):
        assert stats[name]["Request Count"] > 0, name
    assert sum(row["Failure Count"] for row in stats.values()) == 0
    calls = [record for record in map(json.loads, (out / "server.log").read_text().splitlines())
             if record["logger"] == "nmtserve.access" and record["rpc"].startswith("Translate")]
    assert calls and all(c["client"] == "locust" and c["code"] == "OK" for c in calls)


def test_workers_run_the_users_of_a_distributed_run_with_the_same_results(tiny_bundle, tmp_path):
    """--workers 2: locust's master runs the scenario's shape and writes the statistics, two worker processes run
    the users (the master runs none: every call counted came from a worker); the same entries and SLO check."""
    out = tmp_path / "run"
    result = run_cli("loadtest", str(tiny_bundle), "--workers", "2", "--scenario", "steady", "--seconds", "8",
                     "--peak-users", "4", "--out", str(out), timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 locust workers" in result.stdout and "measured: p95_latency_ms" in result.stdout
    stats = read_stats(out / "stats_stats.csv")
    for name in ("Translate", "TranslateStream", "TranslateText"):
        assert stats[name]["Request Count"] > 0, name
    assert sum(row["Failure Count"] for row in stats.values()) == 0


def test_without_the_key_every_http_call_fails_as_unauthenticated(tiny_bundle, tmp_path):
    from nmtserve.server.auth import client_entry

    keys = tmp_path / "keys.toml"
    keys.write_text(client_entry("locust", "key-of-the-load-test"))
    result = run_cli("loadtest", str(tiny_bundle), "--protocol", "http", "--scenario", "steady", "--seconds", "4",
                     "--peak-users", "2", "--out", str(tmp_path / "run"), f"--server-flag=--api-keys={keys}",
                     timeout=240, env={"NMTSERVE_API_KEY": ""})
    assert result.returncode == 1
    failures = (tmp_path / "run" / "stats_failures.csv").read_text()
    assert "UNAUTHENTICATED" in failures


def test_the_bottleneck_named_is_the_largest_share_of_a_calls_time():
    """From the server's series before and after a run and locust's mean call: 10 sentences that waited 40 ms each
    and took 50 ms in all, in calls of 80 ms on average, spent 40 ms queued, 10 decoding and 30 outside the server."""
    before = {"queue_s": 1.0, "queued": 5, "total_s": 2.0, "sentences": 5}
    after = {"queue_s": 1.4, "queued": 15, "total_s": 2.5, "sentences": 15}
    stats = {"Translate": {"Request Count": 10, "Average Response Time": 80.0}}
    line = bottleneck(before, after, stats, met=False)
    assert "queue 40.0 ms, decoding 10.0 ms, outside the server 30.0 ms" in line
    assert line.endswith("the SLO failed; the bottleneck: waiting for room in the running batch (more replicas or "
                         "--max-running-rows)")
    stats["Translate"]["Average Response Time"] = 200.0
    assert bottleneck(before, after, stats, met=True).endswith("the largest share: outside the server: the load "
                                                               "generator or the network (more locust workers)")


def test_two_models_each_get_their_own_text_and_their_own_rows(tiny_bundle, fr_en_bundle, tmp_path):
    """One server of two models (en→fr trained here, a Marian fr→en): every user call goes to a model
    picked from ListModels with that model's sentences, and the report has each model's rows."""
    from nmtserve.loadtests.marian_model import FRENCH, sentences

    (tmp_path / "fr.txt").write_text("\n".join(sentences(FRENCH, 100, 5)) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    result = run_cli("loadtest", f"{tiny_bundle},{fr_en_bundle}", "--sentences-file", f"fr-en={tmp_path / 'fr.txt'}",
                     "--scenario", "steady", "--seconds", "10", "--peak-users", "6", "--out", str(out), timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    stats = read_stats(out / "stats_stats.csv")
    for model in ("en-fr", "fr-en"):
        for kind in ("Translate", "TranslateStream", "TranslateText"):
            assert stats[f"{kind} [{model}]"]["Request Count"] > 0, (kind, model)
        assert f"[{model}] p95_latency_ms" in result.stdout
    assert not {name for name in stats if "[" not in name}, "a call that named no model"
    assert sum(row["Failure Count"] for row in stats.values()) == 0


def test_overload_answers_resource_exhausted_counted_apart_from_failures(tiny_bundle, tmp_path):
    result = run_cli("loadtest", str(tiny_bundle), "--scenario", "overload", "--seconds", "8",
                     "--peak-users", "8", "--out", str(tmp_path), "--server-flag=--max-running-rows=2",
                     "--server-flag=--max-waiting=2", timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    stats = read_stats(tmp_path / "stats_stats.csv")
    assert stats["Translate RESOURCE_EXHAUSTED"]["Request Count"] > 0
    assert sum(row["Failure Count"] for row in stats.values()) == 0


def test_slo_checker_passes_good_results_and_names_each_violation(steady_run, tmp_path):
    _, out = steady_run
    good = tmp_path / "good.toml"
    good.write_text("p95_latency_ms = 60000\np95_time_to_first_token_ms = 60000\nmax_error_rate = 0.0\n"
                    "min_throughput_rps = 0.5\n")
    result = run_cli("check-slo", str(out), "--slo", str(good))
    assert result.returncode == 0 and "all 4 objectives met" in result.stdout, result.stdout + result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("p95_latency_ms = 0.001\nmin_throughput_rps = 1e9\nmax_error_rate = 0.5\n")
    result = run_cli("check-slo", str(out / "stats_stats.csv"), "--slo", str(bad))
    assert result.returncode == 1
    violated = [line for line in result.stdout.splitlines() if line.startswith("SLO violated")]
    assert len(violated) == 2
    assert any("p95_latency_ms: measured" in v and "above the limit 0.001" in v for v in violated)
    assert any("min_throughput_rps: measured" in v and "below the minimum 1e+09" in v for v in violated)


def test_bad_slo_files_and_results_are_one_line_errors(steady_run, tmp_path):
    _, out = steady_run
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("p99_latency_ms = 5\n")
    result = run_cli("check-slo", str(out), "--slo", str(unknown))
    assert result.returncode == 2 and "unknown objective 'p99_latency_ms'" in result.stderr
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('max_error_rate = "low"\n')
    result = run_cli("check-slo", str(out), "--slo", str(wrong))
    assert result.returncode == 2 and "max_error_rate = 'low'" in result.stderr
    result = run_cli("check-slo", str(tmp_path), "--slo", str(wrong))
    assert result.returncode == 2 and "Traceback" not in result.stderr


@pytest.mark.parametrize("marian_dir", ["swish"], indirect=True)
def test_steady_run_with_mixed_decoding_against_an_imported_marian_bundle(marian_bundle, tmp_path):
    """--decoding mixed: greedy, beam 4 and sampled calls in one run, each mode's entries apart."""
    from nmtserve.loadtests.marian_model import ENGLISH, sentences

    (tmp_path / "en.txt").write_text("\n".join(sentences(ENGLISH, 100, 5)) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    result = run_cli("loadtest", str(marian_bundle), "--sentences-file", str(tmp_path / "en.txt"),
                     "--scenario", "steady", "--seconds", "8", "--peak-users", "4", "--decoding", "mixed",
                     "--out", str(out), timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    stats = read_stats(out / "stats_stats.csv")
    for mode in ("greedy", "beam", "sampling"):
        assert stats[f"Translate [{mode}]"]["Request Count"] > 0, mode
        assert f"[{mode}] p95_latency_ms" in result.stdout
    assert sum(row["Failure Count"] for row in stats.values()) == 0
