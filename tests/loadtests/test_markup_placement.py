"""The tag-placement measure (loadtests/markup_placement.py) on the tiny model: it serves the bundle, sends its noun
sentences with the noun in <b>, and reports shares that its own output bears out."""

import json
import subprocess
import sys


def test_markup_placement_reports_what_its_translations_show(tiny_bundle, tiny_corpus, tmp_path):
    report_path = tmp_path / "markup.json"
    done = subprocess.run([sys.executable, "-m", "nmtserve.loadtests.markup_placement", str(tiny_bundle), "--data",
                           str(tiny_corpus), "--sentences", "12", "--report", str(report_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert report == json.loads(done.stdout)
    assert report["sentences"] == 12 and 0 <= report["with_the_nouns_french"] <= 12
    assert 0 <= report["exact"] <= report["touching"] <= 1
    assert all(len(v) == 3 and min(v) > 0 for v in report["seconds"].values())
    assert report["machine"]["python"]
