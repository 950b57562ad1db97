"""`nmtserve bench offline` end to end on the tiny bundle: every engine measured in processes of its
own, at every thread count, the best of each reported with its spread, and the report records the
machine (figures are not judged here)."""

import json

from tests.helpers import run_cli


def test_offline_bench_measures_each_engine_alone_and_reports_its_best(tiny_bundle, tmp_path):
    out = tmp_path / "bench" / "offline.json"
    result = run_cli("bench", "offline", str(tiny_bundle), "--sentences", "12", "--runs", "2", "--batch-sizes", "1,4",
                     "--threads", "1,2", "--json", str(out), timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    engines = {"pytorch", "ort_fp32", "ort_int8", "ct2_fp32", "ct2_int8"}
    assert set(report["results"]) == set(report["best"]) == engines
    # each measuring process had its own engine's library loaded and no other
    own = {"pytorch": ["torch"], "ort_fp32": ["onnxruntime"], "ort_int8": ["onnxruntime"],
           "ct2_fp32": ["ctranslate2"], "ct2_int8": ["ctranslate2"]}
    assert report["worker_modules_loaded"] == own
    for engine, by_threads in report["results"].items():
        assert set(by_threads) == {"1", "2"}
        for batch in ("1", "4"):
            cells = [by_threads[t][batch] for t in ("1", "2")]
            assert all(len(c["runs"]) == 2 and c["min"] <= c["median"] <= c["max"] for c in cells)
            best = report["best"][engine][batch]
            chosen = by_threads[str(best["threads"])][batch]
            assert best["median"] == max(c["median"] for c in cells)
            assert (best["median"], best["min"], best["max"]) == (chosen["median"], chosen["min"], chosen["max"])
    assert set(report["ratios"]["ort_fp32/ct2_fp32"]) == {"1", "4"}
    assert report["token_agreement"]["ort_fp32_vs_pytorch_identical"] == 1.0
    assert report["same_output_at_every_batch_size"]["ort_fp32"] is True
    machine = report["machine"]
    assert machine["cpu"] and machine["usable_cores"] >= 1 and {"onnxruntime", "ctranslate2", "torch", "numpy"} <= \
        set(machine["versions"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ort_fp32/ct2_fp32" in result.stdout and machine["cpu"] in result.stdout
