"""Source language identification (server/language_id.py): the models' codes mapped onto the detector's
labels, and a detection that only ever answers one of the candidates."""

from __future__ import annotations

import pytest

from nmtserve.language_codes import M2M100, NLLB
from nmtserve.server.convert import InvalidRequest
from nmtserve.server.language_id import _identifier, detect, detector_label


def test_every_mapped_code_is_a_label_of_the_detector():
    labels = set(_identifier().labels)
    mapped = {code: detector_label(code) for code in (*NLLB, *M2M100)}
    assert {label for label in mapped.values() if label} <= labels
    assert mapped["eng_Latn"] == mapped["en"] == "en" and mapped["zho_Hant"] == "zh" and mapped["ns"] == "nso"
    assert sum(1 for code in NLLB if mapped[code]) > 120 and mapped["bod_Tibt"] is None


def test_a_detection_answers_one_of_the_candidates_with_its_probability_among_them():
    assert detect(["Der Hund schläft heute im Garten."], ["deu_Latn", "fra_Latn", "eng_Latn"])[0] == "deu_Latn"
    code, confidence = detect(["Der Hund schläft heute im Garten."], ["fr", "en"])  # German is not a candidate
    assert code in ("fr", "en") and 0.5 <= confidence <= 1
    assert detect(["Le chien dort."], ["zho_Hant", "fra_Latn", "zho_Hans"])[0] == "fra_Latn"
    assert detect(["我的猫在睡觉"], ["zho_Hant", "fra_Latn", "zho_Hans"])[0] == "zho_Hans"  # the standard variety
    code, confidence = detect([""], ["de", "fr"])  # nothing to go on: a guess, never a failure
    assert code in ("de", "fr") and confidence == pytest.approx(0.5)


def test_candidates_the_detector_does_not_know_are_a_clear_error():
    with pytest.raises(InvalidRequest, match="source_language 'auto': the language identifier knows none .*bod_Tibt"):
        detect(["text"], ["bod_Tibt", "xx"])
