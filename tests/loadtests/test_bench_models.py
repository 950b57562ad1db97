"""`nmtserve bench models` end to end on two tiny bundles: one server, a flood on one model, probes of
the other, every call succeeding (figures are not judged here)."""

import json

from nmtserve.loadtests.marian_model import FRENCH, sentences
from tests.helpers import run_cli


def test_models_bench_floods_one_model_and_probes_the_other(tiny_bundle, fr_en_bundle, tmp_path):
    (tmp_path / "fr.txt").write_text("\n".join(sentences(FRENCH, 20, 31)) + "\n", encoding="utf-8")
    out = tmp_path / "models.json"
    result = run_cli("bench", "models", str(tiny_bundle), str(fr_en_bundle), "--probed-sentences-file",
                     str(tmp_path / "fr.txt"), "--flood-clients", "4", "--probes", "5", "--seconds", "2", "--runs", "2",
                     "--report", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert (report["flooded"]["model"], report["probed"]["model"]) == ("en-fr", "fr-en")
    for cell in report["results"].values():
        assert 0 < cell["min"] <= cell["median"] <= cell["max"]
    assert set(report["ratios"]) == {"probe p50 flooded/alone", "flood sentences/s with probes/alone"}
    assert "probe p50 flooded/alone" in result.stdout and report["machine"]["cpu"] in result.stdout
