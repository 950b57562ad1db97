"""`nmtserve bench quotas` end to end on the tiny bundle: one server with API keys, each flood in a process of its
own, probes of another key, every probe succeeding; the quota holds the limited floods to their characters (figures
of latency are not judged here)."""

import json

from tests.helpers import run_cli


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
    assert set(report["ratios"]) == {f"probe p50 under the {flood} flood/alone" for flood in ("polite", "hostile", "open")}
    assert report["machine"]["cpu"] in result.stdout
