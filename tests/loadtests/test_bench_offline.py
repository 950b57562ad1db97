"""`nmtserve bench offline` end to end on the tiny bundle: every engine measured in processes of its
own, at every thread layout, the best of each reported with its spread, and the report records the
machine (figures are not judged here)."""

import json
import re
from pathlib import Path

import pytest

from nmtserve.loadtests.bench_offline import mflop_per_token
from tests.helpers import run_cli


def test_offline_bench_measures_each_engine_alone_and_reports_its_best(tiny_bundle, tmp_path):
    out = tmp_path / "bench" / "offline.json"
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)[1].split()) if "flags" in cpuinfo else set()
    # CTranslate2 runs its AVX-512 code only when told to, on a CPU with these (its cpu_info.cc)
    avx512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"} <= flags
    # three of the five engines (the int8 ones are the same code on other files): 16 processes, 22 with AVX-512;
    # a CT2_FORCE_CPU_ISA of the caller's own does not reach the layouts that leave CTranslate2 its own choice
    result = run_cli("bench", "offline", str(tiny_bundle), "--sentences", "12", "--runs", "2", "--batch-sizes", "1,4",
                     "--threads", "1,2", "--repeats", "2", "--engines", "pytorch,ort_fp32,ct2_fp32", "--report", str(out),
                     env={"CT2_FORCE_CPU_ISA": "GENERIC"}, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    engines = {"pytorch", "ort_fp32", "ct2_fp32"}
    assert report["repeats"] == 2 and "each the median of 2 passes" in result.stdout
    assert set(report["results"]) == set(report["best"]) == engines
    # each measuring process had its own engine's library loaded and no other
    own = {"pytorch": ["torch"], "ort_fp32": ["onnxruntime"], "ct2_fp32": ["ctranslate2"]}
    assert report["worker_modules_loaded"] == own
    # 1 and 2 threads on one batch; ONNX Runtime and CTranslate2 also as 2 batches at once, one thread each
    layouts = {e: {"1x1", "1x2"} | ({"2x1"} if e != "pytorch" else set()) for e in engines}
    if avx512:  # and CTranslate2 at each of its code paths
        layouts["ct2_fp32"] |= {f"{name}+avx512" for name in layouts["ct2_fp32"]}
    assert {e: set(names) for e, names in report["layouts_swept"].items()} == layouts
    for engine, by_layout in report["results"].items():
        assert set(by_layout) == layouts[engine]
        for batch in ("1", "4"):
            cells = [by_layout[name][batch] for name in layouts[engine]]
            assert all(len(c["runs"]) == 2 and c["min"] <= c["median"] <= c["max"] for c in cells)
            best = report["best"][engine][batch]
            chosen = by_layout[best["layout"]][batch]
            assert best["layout"].split("+")[0] == f"{best['inter_threads']}x{best['threads']}"
            assert best.get("ct2_isa") == (None if engine != "ct2_fp32" else
                                           "AVX512" if best["layout"].endswith("+avx512") else "default")
            assert best["median"] == max(c["median"] for c in cells)
            assert (best["median"], best["min"], best["max"]) == (chosen["median"], chosen["min"], chosen["max"])
    assert set(report["ratios"]["ort_fp32/ct2_fp32"]) == {"1", "4"}
    for batch in ("1", "4"):  # the ratio within each run: run i of one engine against run i of the other
        ours, theirs = (report["results"][e][report["best"][e][batch]["layout"]][batch]["runs"]
                        for e in ("ort_fp32", "ct2_fp32"))
        within = sorted(round(o / t, 3) for o, t in zip(ours, theirs))
        paired = report["paired_ratios"]["ort_fp32/ct2_fp32"][batch]
        assert (paired["min"], paired["max"]) == (within[0], within[-1])
        # and with both engines at one batch on one thread, whatever their best layouts
        # (CTranslate2 at its faster code path there)
        ct2_single = max(report["results"]["ct2_fp32"][name][batch]["median"] for name in ("1x1", "1x1+avx512")
                         if name in layouts["ct2_fp32"])
        single = report["single_thread_ratios"]["ort_fp32/ct2_fp32"][batch]
        assert single == round(report["results"]["ort_fp32"]["1x1"][batch]["median"] / ct2_single, 3)
    assert "both at 1x1" in result.stdout
    assert report["token_agreement"]["ort_fp32_vs_pytorch_identical"] == 1.0
    # the code CTranslate2 said it chose, at each of its layouts: its own choice (AVX2 where the CPU has it,
    # not the caller's GENERIC), and AVX512 where forced
    logged = report["ct2_logged"]["ct2_fp32"]
    assert set(logged) == layouts["ct2_fp32"]
    for name, said in logged.items():
        isa = "AVX512" if name.endswith("+avx512") else "AVX2" if "avx2" in flags else said["Selected ISA"]
        assert said["Selected ISA"] == isa and said["SGEMM backend"], said
    assert "ct2_fp32, as CTranslate2 logged its code: its own choice: Selected ISA" in result.stdout
    # every engine decodes under CTranslate2's length rule: the same tokens, so tokens/s measure the same work
    assert report["length_rule"] == "ctranslate2" and len(set(report["mean_output_tokens"].values())) == 1
    assert "NOTE: the engines decoded different numbers" not in result.stdout
    assert set(report["at_max_decoding_length"]) == engines  # how many reached the 256-token limit, per engine
    assert report["same_output_at_every_batch_size"]["ort_fp32"] is True
    machine = report["machine"]
    assert machine["cpu"] and machine["usable_cores"] >= 1 and {"onnxruntime", "ctranslate2", "torch", "numpy"} <= \
        set(machine["versions"])
    # the host's speed before and after each measurement, per engine: which runs fell in a slow spell
    for engine in engines:
        probe = report["host_probe"][engine]
        assert set(probe) == {"exp_mps", "l3_gbps"}
        assert all(0 < p["min"] <= p["median"] <= p["max"] for p in probe.values()), probe
        assert {layout: len(runs) for layout, runs in report["host_probe_runs"][engine].items()} == \
            dict.fromkeys(layouts[engine], 2)  # each run's [before, after]
    assert "host probe (exp in L2" in result.stdout and "host probe (sum over 8 MB" in result.stdout
    # the host's limit: ONNX Runtime's MatMul rate on the most threads swept, what a token costs, each engine's share
    limit = report["limit"]
    assert limit["peak"]["threads"] == 2 and limit["peak"]["fp32_gflops"] > 0 and limit["peak"]["int8_gops"] > 0
    assert limit["ceiling_tokens_per_s"]["fp32"] == round(limit["peak"]["fp32_gflops"] * 1e3
                                                          / limit["mflop"]["per_target_token"])
    for engine in engines:
        assert limit["share_of_ceiling"][engine] == {
            b: round(report["best"][engine][b]["median"] / limit["ceiling_tokens_per_s"]["fp32"], 3) for b in ("1", "4")}
    assert "limit: a target token costs" in result.stdout and "GOP/s" in result.stdout
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ort_fp32/ct2_fp32" in result.stdout and "within each run" in result.stdout and machine["cpu"] in result.stdout
    # the family and model numbers, which tell apart CPUs that a hypervisor names alike ("AMD EPYC")
    family = re.search(r"^cpu family\s*:\s*(\d+)$.*?^model\s*:\s*(\d+)$", cpuinfo, re.S | re.M)
    assert machine["cpu_family"] == (f"family {family[1]}, model {family[2]}" if family else "")
    assert machine["cpu_family"] in result.stdout


@pytest.mark.parametrize("marian_dir", ["swish"], indirect=True)
def test_offline_bench_of_an_imported_marian_bundle_measures_transformers_and_ctranslate2s_conversion(
        marian_bundle, tmp_path):
    """Against the Marian directory the bundle came from: CTranslate2 converted by its own converter,
    transformers' generate; beam search; peak memory of each measuring process."""
    from nmtserve.loadtests.marian_model import ENGLISH, sentences

    (tmp_path / "en.txt").write_text("\n".join(sentences(ENGLISH, 6, 21)) + "\n", encoding="utf-8")
    out = tmp_path / "marian.json"
    result = run_cli("bench", "offline", str(marian_bundle), "--sentences-file", str(tmp_path / "en.txt"),
                     "--runs", "1", "--repeats", "1", "--threads", "1", "--batch-sizes", "1,3", "--beam-size", "2",
                     "--max-decoding-length", "12", "--engines", "transformers,ort_fp32,ct2_fp32", "--report", str(out),
                     timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["worker_modules_loaded"] == {"transformers": ["torch", "transformers"], "ort_fp32": ["onnxruntime"],
                                               "ct2_fp32": ["ctranslate2"]}
    assert report["unit"].endswith("beam 2") and set(report["ratios"]) == {"ort_fp32/ct2_fp32", "ort_fp32/transformers"}
    # the same model three ways: ours matches transformers' beam search, as export --verify checks
    assert report["token_agreement"]["ort_fp32_vs_transformers_identical"] == 1.0
    assert all(report["peak_rss_mb"][e] > 20 for e in ("transformers", "ort_fp32", "ct2_fp32"))


def test_the_report_counts_the_sentences_decoded_to_the_length_limit(tiny_bundle, tmp_path):
    """Each such sentence keeps its batch stepping to the limit (on a GPU, at the cost of a full step each):
    the report and the table say how many there were. With a limit of 3 tokens every test sentence reaches it."""
    out = tmp_path / "offline.json"
    result = run_cli("bench", "offline", str(tiny_bundle), "--sentences", "6", "--runs", "1", "--repeats", "1",
                     "--threads", "1", "--batch-sizes", "2", "--max-decoding-length", "3", "--engines", "ort_fp32,ct2_fp32",
                     "--report", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["mean_output_tokens"] == {"ort_fp32": 3.0, "ct2_fp32": 3.0}
    assert report["at_max_decoding_length"] == {"ort_fp32": 6, "ct2_fp32": 6}
    assert "sentences decoded to the length limit (3 tokens, no eos), of 6: ort_fp32 6, ct2_fp32 6" in result.stdout


def test_transformers_is_an_engine_of_imported_bundles_only(tiny_bundle):
    result = run_cli("bench", "offline", str(tiny_bundle), "--engines", "transformers,ort_fp32", timeout=120)
    assert result.returncode != 0
    assert f"--engines transformers: {tiny_bundle} was not imported from a Hugging Face folder" in result.stderr


def test_bench_counts_out_of_range_are_refused_naming_the_flag(tiny_bundle):
    for command, flag, value, low in (("offline", "--runs", "0", 1), ("offline", "--repeats", "0", 1),
                                      ("served", "--requests", "-1", 0)):
        result = run_cli("bench", command, str(tiny_bundle), flag, value, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().endswith(f"{flag} {value}: must be at least {low}")


def test_an_engine_of_the_other_device_is_refused_naming_it(tiny_bundle):
    """fp16 engines run on CUDA only, our fp32/int8 variants on the CPU only: refused before anything runs."""
    result = run_cli("bench", "offline", str(tiny_bundle), "--engines", "ort_fp32,ort_fp16", timeout=120)
    assert result.returncode != 0
    assert "--engines: ort_fp16 do not run on --device cpu" in result.stderr
    result = run_cli("bench", "offline", str(tiny_bundle), "--device", "cuda", "--engines", "ct2_int8", timeout=120)
    assert result.returncode != 0 and "--engines: ct2_int8 do not run on --device cuda" in result.stderr


def test_a_target_tokens_products_are_counted_from_the_models_shapes():
    """The default model (d_model 256, d_ff 1024, 3 + 3 layers, 3,153 tokens), by hand: a decoder step's row
    is 3 × (6 × 256² + 2 × 256 × 1024) + 256 × 3,153 = 3,559,680 multiply-adds, a source token 3 × (4 × 256² + 2 ×
    256 × 1024) + 3 × 2 × 256² = 2,752,512; two FLOP each."""
    model = {"d_model": 256, "d_ff": 1024, "n_encoder_layers": 3, "n_decoder_layers": 3, "vocab_size": 3153}
    greedy = mflop_per_token(model, 1, source_tokens=2077, target_tokens=2420)
    assert (greedy["decoder_step_row"], greedy["encoder_source_token"]) == (7.119, 5.505)
    assert greedy["per_target_token"] == round(7.11936 + 5.505024 * 2077 / 2420, 3)
    assert mflop_per_token(model, 4, 2077, 2178)["per_target_token"] == round(4 * 7.11936 + 5.505024 * 2077 / 2178, 3)
