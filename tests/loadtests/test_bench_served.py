"""`nmtserve bench served` end to end on the tiny bundle: two real servers, every request served,
a report with both modes (median and spread; greedy, beam and sampled requests mixed), the baseline, the ratios, the machine and a chart
(figures are not judged here)."""

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from nmtserve.loadtests import bench_served
from nmtserve.loadtests.bench_served import STAGES, Baseline, ServedBenchConfig, rpc_bound, steady_window, work
from nmtserve.loadtests.machine import THREAD_KINDS
from nmtserve.loadtests.profile import summarize
from nmtserve.loadtests.workload import DECODING_MIX, draw_decoding
from tests.helpers import run_cli


def test_the_decoding_mix_draws_each_mode_by_its_share():
    rng = random.Random(0)
    counts = Counter(draw_decoding(rng)[0] for _ in range(10_000))
    for mode, _, share in DECODING_MIX:
        assert abs(counts[mode] / 10_000 - share) < 0.02, counts


def test_the_steady_window_leaves_out_the_first_round_and_the_tail():
    # two clients: the window opens at the second completion (1.1 s) and closes at the last send (4.0 s)
    finished = [(1.0, 10), (1.1, 10), (2.0, 7), (3.0, 9), (4.0, 11), (4.5, 50), (4.6, 50)]
    assert steady_window(finished, 4.0, 2) == pytest.approx((7 + 9 + 11) / 2.9)
    assert steady_window(finished[:2], 1.05, 2) is None  # too few requests per client: no window


def test_the_rpc_floor_bounds_the_saturated_server_by_the_cores_it_takes(monkeypatch):
    """Offline, 2 engines x 1 thread make 10,000 tok/s of calls of 10 tokens: 2 ms of the cores a call. A server
    whose calls cost 0.25 ms of its own CPU and 0.25 of its client's beside that gets 2 / 2.5 of it on 2 cores;
    on 8 cores the RPC path has cores of its own and the engines bound it (1); offline on 1 x 1 (1 ms of one core a
    call) against a server that may use both cores: 2 / 1.5 of it, so the engines bound it too."""
    floor = {"server_cpu_ms": 0.25, "client_cpu_ms": 0.25}
    monkeypatch.setattr(bench_served, "usable_cores", lambda: 2)
    assert rpc_bound({"layout": "2x1", "tokens_per_s": 10_000}, floor, 10) == pytest.approx(0.8)
    assert rpc_bound({"layout": "1x1", "tokens_per_s": 10_000}, floor, 10) == 1.0
    monkeypatch.setattr(bench_served, "usable_cores", lambda: 8)
    assert rpc_bound({"layout": "2x1", "tokens_per_s": 10_000}, floor, 10) == 1.0


def test_greedy_calls_say_greedy_and_the_baseline_decodes_as_the_servers(marian_bundle):
    """An imported OPUS-MT model's bundle says beam 4 (its generation_config.json), which a server applies
    to a call that gives no beam_size: the greedy bench's calls give beam_size 1, and the baseline fills
    what a call leaves unset as the servers do (the bundle's defaults, serve's default output limit)."""
    cfg = ServedBenchConfig(bundle=str(marian_bundle))
    assert [options for _, options in work(cfg, ["a b", "c d e"], 4, seed=0)] == [{"beam_size": 1}] * 4
    defaults = Baseline(cfg, threads=1).defaults
    assert (defaults.beam_size, defaults.length_penalty, defaults.beam_stopping) == (4, 1.0, "transformers")
    bundle_limit = json.loads((marian_bundle / "manifest.json").read_text())["decoding_defaults"]["max_decoding_length"]
    assert defaults.max_decoding_length == min(256, bundle_limit) == 39  # the lower of serve's and the bundle's
    assert defaults.override(beam_size=1).greedy


def test_served_bench_reports_both_modes_against_the_baseline(tiny_bundle, tmp_path):
    """Two thread counts swept in three layouts (1 x 1, 1 x 2, 2 engines x 1): a server per mode and layout,
    each mode reported at its best layout per concurrency, every layout beside it."""
    out = tmp_path / "served.json"
    result = run_cli("bench", "served", str(tiny_bundle), "--concurrency", "1,2", "--requests", "6", "--runs", "1",
                     "--threads", "1,2", "--server-flag=--io-binding=on", "--decoding", "mixed", "--report", str(out),
                     timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["server_flags"] == ["--io-binding=on"] and report["decoding"] == "mixed"
    assert report["offline_best"] is None  # a mix of decodings has no one offline throughput
    # the servers' engines without gRPC, at each layout: the best of them, and the served saturation against it
    alone = report["engines_alone"]
    assert alone["layout"] in ("1x1", "1x2", "2x1") and alone["steady_tokens_per_s"] > 0
    low, high = alone["steady_tokens_per_s_min_max"]
    assert low <= alone["steady_tokens_per_s"] <= high
    saturation = max(cell["steady_tokens_per_s"] for cell in report["results"]["continuous"].values())
    assert report["ratios"]["continuous saturation / the engines alone"] == round(
        saturation / alone["steady_tokens_per_s"], 3)
    assert "the servers' engines alone" in result.stdout
    assert report["threads"] == [1, 2] and list(report["results_by_layout"]) == ["1x1", "1x2", "2x1"]
    for mode in ("continuous", "static"):
        assert set(report["results"][mode]) == {"1", "2"}
        for c, cell in report["results"][mode].items():
            swept = {name: at[mode][c] for name, at in report["results_by_layout"].items()}
            best = max(swept, key=lambda name: swept[name]["steady_tokens_per_s"])
            assert cell == {"layout": best, **swept[best]}
        for cell in report["results"][mode].values():
            assert cell["requests"] == cell["sentences"] == 6 and cell["tokens_per_s"] > 0 and cell["steady_tokens_per_s"] > 0
            low, high = cell["p50_ms_min_max"]
            assert low <= cell["p50_ms"] <= high
            # where the time goes: no stage is negative
            assert list(cell["stages_mean_ms"]) == list(STAGES) and min(cell["stages_mean_ms"].values()) >= 0
            # how fast the host ran as the cell started, one probe per run
            assert [set(p) for p in cell["host_probe_runs"]] == [{"exp_mps", "l3_gbps"}]
            assert all(v > 0 for v in cell["host_probe_runs"][0].values())
            # the cell's CPU a call, by the server's threads (Linux's scheduler statistics) and the client
            cpu = cell["cpu_ms_per_call"]
            assert set(cpu["run"]) == {*THREAD_KINDS, "client"} and set(cpu["waiting"]) == set(THREAD_KINDS)
            assert cpu["run"]["engines"] > 0 and cpu["run"]["event loop"] > 0 and cpu["run"]["client"] > 0
            assert min(cpu["waiting"].values()) >= 0
            # the cores that CPU kept busy, at the cell's calls a second: some, and no more than the host has
            assert 0 < cell["cores_busy"] <= 1.2 * report["machine"]["usable_cores"]
        # the servers' own count of encoder calls (nmtserve_admissions_total): one request at a time is one
        # sentence each; two clients, one or two
        assert report["results"][mode]["1"]["sentences_per_admission"] == 1.0
        assert 1.0 <= report["results"][mode]["2"]["sentences_per_admission"] <= 2.0
    assert "host probe as each cell started" in result.stdout and "sentences per admission" in result.stdout
    assert "CPU ms a call" in result.stdout
    assert set(report["ratios"]["continuous/static tokens_per_s"]) == {"1", "2"}
    assert set(report["ratios"]["continuous/static steady_tokens_per_s"]) == {"1", "2"}
    for name in ("1x1", "1x2", "2x1"):
        assert set(report["ratios"][f"continuous/static steady_tokens_per_s, both at {name}"]) == {"1", "2"}
        assert f"at {name}, steady tok/s" in result.stdout
    assert report["baseline_onnx_translator_batch1"]["p50_ms"] > 0
    # the RPC path's own cost (a bare grpc server's no-op call), once a run, against the baseline's p50
    floor = report["rpc_floor"]
    assert floor["clients"] == 64 and floor["calls_per_s"] > 0 and floor["server_cpu_ms"] > 0 and floor["client_cpu_ms"] > 0
    low, high = floor["p50_ms_min_max"]
    assert 0 < low <= floor["p50_ms"] <= high and "the RPC floor" in result.stdout
    assert report["ratios"]["RPC floor p50 / OnnxTranslator batch-1 p50"] == pytest.approx(
        floor["p50_ms"] / report["baseline_onnx_translator_batch1"]["p50_ms"], rel=0.01)
    assert report["baseline_onnx_translator_batch1"]["threads"] in (1, 2)
    # paced to the busiest continuous server's calls/s at the most clients, and the servicer against both floors
    paced = floor["at_rate"]
    busiest = max(by["continuous"]["2"]["requests_per_s"] for by in report["results_by_layout"].values())
    assert paced["calls_per_s"] == pytest.approx(busiest, rel=0.5) and paced["server_cpu_ms"] > 0
    assert paced["client_cpu_ms"] > 0
    cpu = report["results"]["continuous"]["2"]["cpu_ms_per_call"]["run"]
    servicer = cpu["event loop"] + cpu["other server threads"]
    assert report["ratios"]["continuous servicer CPU a call at 2 clients / the RPC floor's"] == pytest.approx(
        servicer / floor["server_cpu_ms"], abs=2e-3)
    assert report["ratios"]["continuous servicer CPU a call at 2 clients / the RPC floor's at its calls/s"] == \
        pytest.approx(servicer / paced["server_cpu_ms"], abs=2e-3)
    assert "paced to" in result.stdout
    # the decoder step's time at each batch size up to the servers' rows (64 by default)
    assert list(report["step_ms_by_rows"]) == ["1", "8", "16", "32", "48", "64"]
    assert all(ms > 0 for ms in report["step_ms_by_rows"].values()) and "decoder step, ms" in result.stdout
    assert "continuous" in result.stdout and "OnnxTranslator batch 1" in result.stdout and "per stage" in result.stdout
    assert report["machine"]["cpu"] in result.stdout and "onnxruntime" in report["machine"]["versions"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_served_bench_sends_several_sentences_a_call(tiny_bundle, tmp_path):
    """--sentences-per-call 3: each Translate call carries 3 sentences (the servers' limit raised if need be);
    no one-sentence baseline then. One thread count on two engines: one layout, 2 x 1."""
    out = tmp_path / "served.json"
    result = run_cli("bench", "served", str(tiny_bundle), "--concurrency", "2", "--requests", "4", "--runs", "1",
                     "--modes", "continuous", "--sentences-per-call", "3", "--threads", "1", "--inter-threads", "2",
                     "--profile", "--report", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    # --profile: one more cell, sampled by py-spy; its stacks beside the report, their summary in it
    [(name, profile)] = report["profile"].items()
    assert name == "continuous 2x1 2 clients" and f"profile, {name}" in result.stdout
    if "error" in profile:  # a host where no process may attach to another (ptrace): said, not a failed bench
        assert "ermission" in profile["error"] or "ptrace" in profile["error"], profile["error"]
    else:
        assert profile["samples"] > 0 and Path(profile["file"]) == tmp_path / "served-profile-continuous-2x1-2-clients.txt"
        assert sum(profile["threads"].values()) == pytest.approx(1, abs=1e-3) and profile["top_own"]
    cell = report["results"]["continuous"]["2"]
    assert report["sentences_per_call"] == 3 and cell["requests"] == 4 and cell["sentences"] == 12
    assert cell["steady_tokens_per_s"] > 0 and min(cell["stages_mean_ms"].values()) >= 0
    assert report["baseline_onnx_translator_batch1"] is None and "3 sentence(s) a call" in result.stdout
    assert report["step_ms_by_rows"] is None and report["engines_alone"] is None  # it takes one-sentence calls
    # greedy: OnnxTranslator's offline throughput at the servers' layout, half their rows and all of them
    offline = report["offline_best"]
    assert offline["layout"] == "2x1" and offline["batch_size"] in (32, 64) and offline["tokens_per_s"] > 0
    low, high = offline["tokens_per_s_min_max"]
    assert low <= offline["tokens_per_s"] <= high
    assert report["ratios"]["continuous saturation / OnnxTranslator offline best"] == pytest.approx(
        cell["steady_tokens_per_s"] / offline["tokens_per_s"], abs=1e-3)
    assert "OnnxTranslator offline, greedy" in result.stdout
    # the engines' CPU a call against the offline best's: two cores' time (2 x 1) a call of the cell's tokens
    offline_ms = 2e3 * cell["tokens_per_s"] / cell["requests_per_s"] / offline["tokens_per_s"]
    assert report["ratios"]["continuous engines' CPU a call at 2 clients / OnnxTranslator offline best's"] == \
        pytest.approx(cell["cpu_ms_per_call"]["run"]["engines"] / offline_ms, abs=1e-3)
    # greedy with an offline best: the most a server whose calls cost only the RPC floor could make of it
    tokens_per_call = cell["tokens_per_s"] / cell["requests_per_s"]
    bound = report["ratios"]["at most, over the RPC floor / OnnxTranslator offline best"]
    assert bound == pytest.approx(rpc_bound(offline, report["rpc_floor"], tokens_per_call), abs=1e-3)
    # the floor paced to that bound's calls/s (the run's own offline best; as many as the floor makes at most), and
    # the bound again with what the floor cost there
    at_bound = report["rpc_floor"]["at_bound"]
    assert at_bound["calls_per_s"] == pytest.approx(
        min(bound * offline["tokens_per_s"] / tokens_per_call, report["rpc_floor"]["calls_per_s"]), rel=0.5)
    paced = rpc_bound(offline, at_bound, tokens_per_call)
    assert report["ratios"]["at most, over the RPC floor paced to that bound / OnnxTranslator offline best"] == \
        pytest.approx(paced, abs=1e-3)
    assert report["ratios"]["continuous saturation / at most, over the RPC floor paced"] == pytest.approx(
        cell["steady_tokens_per_s"] / offline["tokens_per_s"] / paced, rel=1e-2)
    assert report["threads"] == [1] and report["results_by_layout"] is None and cell["layout"] == "2x1"
    bad = run_cli("bench", "served", str(tiny_bundle), "--sentences-per-call", "0", timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("--sentences-per-call 0: must be at least 1")
    bad = run_cli("bench", "served", str(tiny_bundle), "--threads", "1,2", "--inter-threads", "2", timeout=120)
    assert bad.returncode == 2 and "--inter-threads 2 with --threads 1,2: a sweep sets the engines itself" in bad.stderr
    bad = run_cli("bench", "served", str(tiny_bundle), "--server-flag=--inter-threads=2", timeout=120)
    assert bad.returncode == 2 and "--server-flag --inter-threads=2: use bench served's own --inter-threads" in bad.stderr
    # a server that refuses its flags: its own error reaches the bench's message (its log is gone with the bench)
    bad = run_cli("bench", "served", str(tiny_bundle), "--server-flag=--max-running-rows=0", "--concurrency", "1",
                  "--runs", "1", timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "exited with 2 before serving: nmtserve serve: error: --max-running-rows 0: must be at least 1" in bad.stderr


def test_a_profile_sums_the_samples_by_thread_and_by_the_function_on_top(tmp_path):
    """py-spy's folded stacks (--format raw --threads): each thread's share of the samples, and each function's
    share as the top frame, whatever its line; lines that are not stacks are skipped."""
    folded = tmp_path / "stacks.txt"
    folded.write_text("thread (1): nmtserve-engine;Engine._loop (export/runtime/engine.py:160);"
                      "run_bound (export/runtime/sessions.py:41) 6\n"
                      "thread (1): nmtserve-engine;Engine._loop (export/runtime/engine.py:160);"
                      "run_bound (export/runtime/sessions.py:43) 2\n"
                      "thread (2): MainThread;Handle._run (asyncio/events.py:84) 2\n"
                      "not a stack\n", encoding="utf-8")
    summary = summarize(folded)
    assert summary["samples"] == 10 and summary["threads"] == {"nmtserve-engine": 0.8, "MainThread": 0.2}
    assert summary["top_own"] == [["run_bound (export/runtime/sessions.py)", 0.8], ["Handle._run (asyncio/events.py)", 0.2]]
    folded.write_text("", encoding="utf-8")
    assert summarize(folded) == {"error": f"{folded}: no samples", "file": str(folded)}
