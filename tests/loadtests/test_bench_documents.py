"""`nmtserve bench documents` end to end on the tiny bundle: the three ways decode the same tokens
(figures are not judged here)."""

import json

from tests.helpers import run_cli


def test_documents_bench_sends_the_document_three_ways(tiny_bundle, tmp_path):
    out = tmp_path / "documents.json"
    result = run_cli("bench", "documents", str(tiny_bundle), "--sentences", "10", "--runs", "2", "--report", str(out),
                     timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["sentences"] >= 10 and len(report["results"]) == 3
    assert len({r["output_tokens"] for r in report["results"].values()}) == 1  # the same work each way
    for r in report["results"].values():
        assert 0 < r["latency_s"]["min"] <= r["latency_s"]["median"] <= r["latency_s"]["max"]
    assert "one TranslateText call" in result.stdout and report["machine"]["cpu"] in result.stdout
