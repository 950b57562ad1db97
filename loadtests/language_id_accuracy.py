"""How often source_language "auto" finds the right language, on a test set of the project's (a .tsv of sentence
pairs, one language a column), for three sets of candidates: the pair's two languages (a server of an en→fr and an
fr→en model), NLLB's languages (a server of one NLLB model), and M2M100's.

    python -m nmtserve.loadtests.language_id_accuracy data/default/test.tsv en fr

Each sentence is detected alone (as a one-sentence call is), and the time a detection takes is reported too."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from nmtserve.language_codes import M2M100, NLLB
from nmtserve.server.language_id import detect, detector_label


def accuracy(texts: list[str], language: str, candidates: list[str]) -> float:
    """The share of texts detected as the candidate whose label is language's."""
    label = detector_label(language)
    return sum(detector_label(detect([t], candidates)[0]) == label for t in texts) / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m nmtserve.loadtests.language_id_accuracy")
    parser.add_argument("tsv")
    parser.add_argument("languages", nargs=2, help="the two columns' language codes, e.g. en fr")
    args = parser.parse_args()
    with open(args.tsv, encoding="utf-8") as f:
        columns = list(zip(*(line.rstrip("\n").split("\t")[:2] for line in f if "\t" in line)))
    report = {"file": args.tsv, "sentences": len(columns[0]), "accuracy": {}}
    for texts, language in zip(columns, args.languages):
        report["accuracy"][language] = {
            name: round(accuracy(list(texts), language, candidates), 4)
            for name, candidates in (("the pair", list(args.languages)), ("NLLB's languages", list(NLLB)),
                                     ("M2M100's languages", list(M2M100)))}
    timings = []
    for text in columns[0][:500]:
        t0 = time.perf_counter()
        detect([text], list(NLLB))
        timings.append(time.perf_counter() - t0)
    report["ms_per_detection_among_nllb"] = round(statistics.median(timings) * 1e3, 3)
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
