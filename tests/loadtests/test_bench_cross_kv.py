"""`nmtserve bench cross-kv` on the tiny bundle: each layout's bytes and every timing reported
(figures are not judged here)."""

import json

from tests.helpers import run_cli


def test_cross_kv_bench_reports_both_layouts(tiny_bundle, tmp_path):
    out = tmp_path / "cross.json"
    result = run_cli("bench", "cross-kv", str(tiny_bundle), "--requests", "3", "--beam-size", "4", "--runs", "2",
                     "--report", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    sizes = report["cross_kv_bytes"]
    assert sizes["copied"] == 4 * sizes["shared"] > 0  # a copy per beam row, against one per request
    assert len(report["source_tokens"]) == 3 and report["padded_source_length"] == max(report["source_tokens"])
    for median, low, high in report["ms_median_min_max"].values():
        assert 0 < low <= median <= high
    assert "gather per step if shared" in result.stdout and report["machine"]["cpu"] in result.stdout
