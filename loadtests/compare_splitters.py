"""Sentence splitters side by side on hand-made English, French and German texts with abbreviations,
numbers, ordinals and punctuation: what TranslateText's choice (sentencex, server/documents.py)
rests on. The other two are not dependencies: install them to compare.

    pip install pysbd sentence-splitter
    python -m nmtserve.loadtests.compare_splitters

Each case is the gold sentences of one text (joined by a space); a splitter gets a case right when
it returns exactly them. Speed is characters per second on the English cases repeated.
"""

from __future__ import annotations

import importlib.util
import time

CASES = {
    "en": [
        ("Dr. Smith arrived at 3 p.m. yesterday.", "He paid $3.50 for coffee!"),
        ("The U.S. economy grew 2.5% in Q3.", "Analysts expected more."),
        ("See Fig. 3 for details.", "It shows the trend."),
        ("Apples, oranges, etc. are fruits.", "I like them."),
        ("Version 1.2.3 was released on Jan. 5, 2024.", "Upgrade now."),
        ("What?", "No way!", "Really."),
        ("Mr. and Mrs. Jones live at No. 5 Main St. in Springfield.",),
        ("The price rose by 4.5 per cent.", "It was 10 a.m. when it closed."),
        ("He works for Acme Inc. and lives in Boston.", "He is 42."),
        ("Call me at 555-1234 ext. 5 tomorrow.", "Thanks."),
    ],
    "fr": [
        ("M. Dupont est arrivé à 15 h.", "Il a payé 3,50 €."),
        ("Le chat dort.", "Le chien mange !"),
        ("Voir p. 12 et chap. 3 pour les détails.", "C'est clair ?"),
        ("Il est né le 1er janv. 1990 à Paris.", "Il vit à Lyon."),
        ("Qu'est-ce que c'est ?", "Je ne sais pas."),
        ("Mme Martin et Dr. Leroy sont là.", "Ils attendent."),
        ("Le taux est de 2,5 %.", "C'est peu."),
        ("Etc. est une abréviation.", "Voilà."),
    ],
    "de": [
        ("Dr. Müller kam um 15 Uhr.", "Er zahlte 3,50 €."),
        ("Das ist z. B. ein Test.", "Noch ein Satz."),
        ("Am 3. Oktober ist Feiertag.", "Wir feiern."),
        ("Die Firma Müller GmbH & Co. KG wächst.", "Gut so."),
        ("Siehe S. 5 usw. für mehr.", "Danke."),
        ("Er wurde am 1. 1. 2000 geboren.", "Heute ist er 24."),
        ("Prof. Dr. Weber hält einen Vortrag.", "Er ist gut."),
        ("Das kostet ca. 5 Euro.", "Das ist billig."),
    ],
}


def _sentencex():
    import sentencex

    return lambda language, text: sentencex.segment(language, text)


def _pysbd():
    import pysbd

    segmenters = {}
    return lambda language, text: segmenters.setdefault(
        language, pysbd.Segmenter(language=language, clean=False)).segment(text)


def _sentence_splitter():
    from sentence_splitter import SentenceSplitter

    splitters = {}
    return lambda language, text: splitters.setdefault(language, SentenceSplitter(language=language)).split(text)


SPLITTERS = {"sentencex": ("sentencex", _sentencex), "pysbd": ("pysbd", _pysbd),
             "sentence-splitter": ("sentence_splitter", _sentence_splitter)}


def compare() -> list[str]:
    lines = []
    for name, (module, make) in SPLITTERS.items():
        if importlib.util.find_spec(module) is None:
            lines.append(f"{name:<18} not installed")
            continue
        split = make()
        cells = []
        for language, cases in CASES.items():
            right = sum([s.strip() for s in split(language, " ".join(gold)) if s.strip()] == list(gold) for gold in cases)
            cells.append(f"{language} {right}/{len(cases)}")
        text = " ".join(" ".join(gold) for gold in CASES["en"]) * 20
        t0 = time.perf_counter()
        for _ in range(10):
            split("en", text)
        speed = 10 * len(text) / (time.perf_counter() - t0)
        lines.append(f"{name:<18} {'  '.join(cells)}  {speed / 1e3:,.0f} k characters/s")
    return lines


if __name__ == "__main__":
    print("\n".join(compare()))
