"""BLEU and chrF of translations, with sacrebleu, and how their exact-match rate rises with their confidence."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu

from nmtserve.training.decode import translate


@dataclass
class Scores:
    bleu: float
    chrf: float
    sentences: int
    exact_match: float  # share of hypotheses identical to their reference

    def to_dict(self) -> dict:
        return {"bleu": round(self.bleu, 2), "chrf": round(self.chrf, 2), "sentences": self.sentences,
                "exact_match": round(self.exact_match, 4)}


def score(hypotheses: list[str], references: list[str]) -> Scores:
    bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
    chrf = sacrebleu.corpus_chrf(hypotheses, [references]).score
    exact = sum(h == r for h, r in zip(hypotheses, references)) / max(1, len(references))
    return Scores(bleu, chrf, len(references), exact)


def evaluate_pairs(model, tokenizer, pairs: list[tuple[str, str]], *, batch_size: int = 128,
                   device="cpu") -> tuple[Scores, list[str]]:
    """Translate the sources of pairs and score them against the targets."""
    hypotheses = translate(model, tokenizer, [s for s, _ in pairs], max_batch_size=batch_size, device=device)
    return score(hypotheses, [t for _, t in pairs]), hypotheses


def calibration(confidences: list[float], hypotheses: list[str], references: list[str], bins: int = 5) -> list[dict]:
    """The sentences sorted by confidence (search.Hypothesis.confidence) and cut into `bins` groups of about equal
    size, least confident first: each group's confidence range, size, exact-match share and chrF, which show whether
    a threshold on confidence separates the translations that are right from the rest."""
    order = sorted(range(len(confidences)), key=lambda i: confidences[i])
    groups = [order[len(order) * b // bins: len(order) * (b + 1) // bins] for b in range(bins)]
    return [{"confidence": [round(confidences[g[0]], 4), round(confidences[g[-1]], 4)],
             **score([hypotheses[i] for i in g], [references[i] for i in g]).to_dict()} for g in groups if g]
