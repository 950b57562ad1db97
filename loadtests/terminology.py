"""How well glossaries hold on the built-in corpus: the test split's sentences that contain one of its nouns,
translated by beam search with and without a glossary of those nouns, for two glossaries: "reference", each
noun to the French the corpus uses (the model's own choice, mostly), and "company", each noun to another noun's
French of the same gender and kind (what a company's terminology overrides; the references are rewritten to
match). For each: the share of translations that contain every target term of their sentence, BLEU and chrF
against the references, and the time taken.

    python -m nmtserve.loadtests.terminology bundles/default --data data/default --sentences 400
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.glossary import Glossary
from nmtserve.loadtests.machine import machine_info
from nmtserve.training.data import read_tsv
from nmtserve.training.evaluate import score
from nmtserve.training.lexicon import NOUNS


def glossaries() -> dict[str, list[tuple[str, str]]]:
    """The two glossaries of the corpus's nouns (single-word ones: a plural is another word and does not match)."""
    nouns = [n for n in NOUNS if "_" not in n.en and "_" not in n.fr]
    company = []
    for kind in sorted({(n.gender, n.animate) for n in nouns}):
        group = [n for n in nouns if (n.gender, n.animate) == kind]
        company += [(n.en, group[(i + 1) % len(group)].fr) for i, n in enumerate(group)]
    return {"reference": [(n.en, n.fr) for n in nouns], "company": company}


def word_pattern(term: str) -> re.Pattern:
    """The term as a whole word, in any case."""
    return re.compile(r"(?<!\w)" + re.escape(term) + r"(?!\w)", re.IGNORECASE)


def measure(tr: OnnxTranslator, pairs: list[tuple[str, str]], entries: list[tuple[str, str]], reference: dict,
            beam_size: int) -> dict:
    """Each sentence translated without and with the glossary; references rewritten from the corpus's French to the
    glossary's where they differ."""
    glossary = Glossary(entries)
    sources = [s for s, _ in pairs]
    targets = [glossary.targets_for(s) for s in sources]
    references = []
    for (source, ref), wanted in zip(pairs, targets):
        for en, fr in entries:
            if fr in wanted and word_pattern(en).search(source):
                ref = word_pattern(reference[en]).sub(fr, ref)
        references.append(ref)
    report = {"sentences": len(pairs), "terms": sum(len(t) for t in targets)}
    for name, given in (("without", None), ("with", glossary)):
        started = time.perf_counter()
        out = [t.text for t in tr.translate_batch(sources, beam_size=beam_size, glossary=given, max_batch_size=32)]
        seconds = time.perf_counter() - started
        present = sum(all(word_pattern(term).search(text) for term in wanted) for text, wanted in zip(out, targets))
        report[name] = {"terms_present": round(present / len(out), 4), "seconds": round(seconds, 2),
                        **score(out, references).to_dict()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m nmtserve.loadtests.terminology")
    parser.add_argument("bundle")
    parser.add_argument("--data", default="data/default")
    parser.add_argument("--split", default="test")
    parser.add_argument("--sentences", type=int, default=400, help="the first N sentences with a glossary noun")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--report", help="also write the report here (JSON)")
    args = parser.parse_args()
    tr = OnnxTranslator(args.bundle)
    reference = dict(glossaries()["reference"])
    nouns = [word_pattern(en) for en in reference]
    pairs = [p for p in read_tsv(Path(args.data) / f"{args.split}.tsv").pairs
             if any(n.search(p[0]) for n in nouns)][: args.sentences]
    report = {"bundle": args.bundle, "split": args.split, "beam_size": args.beam_size, "machine": machine_info(),
              "glossaries": {name: measure(tr, pairs, entries, reference, args.beam_size)
                             for name, entries in glossaries().items()}}
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
