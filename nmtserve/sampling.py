"""Random sampling for one request (CTranslate2's RandomSampler): `Sampling` over its one row, and the draws it
makes from a row's candidates or its whole vocabulary. Numpy only."""

from __future__ import annotations

import os

import numpy as np

from nmtserve.decoding import DecodingOptions, Hypothesis, mean_log_prob
from nmtserve.logits import TokenMasks, best_candidates, log_softmax


class Sampling:
    """Random sampling in one row, as CTranslate2's RandomSampler: keep the sampling_topk best tokens
    (all if 0), divide their log-probs by the temperature, keep the smallest set of best tokens whose
    probability reaches sampling_topp (a token is kept while the probability of the better ones is
    below it), renormalise and draw one with the request's own generator. The token's score is its
    log-probability under the model (before temperature). A hypothesis finishes at eos or at its budget."""

    def __init__(self, options: DecodingOptions, budget: int, eos_id: int, masks: TokenMasks | None = None):
        self.options, self.budget, self.eos_id, self.masks = options, budget, eos_id, masks
        self.rows, self.candidates = 1, 0 if masks else options.sampling_topk
        seed = options.seed or int.from_bytes(os.urandom(8), "little")
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.tokens: list[int] = []
        self.score = 0.0
        self.finish = ""
        self.done = False

    def step(self, ids: np.ndarray | None, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids, scores (1, ≥ K): the row's best tokens and log-probs, best first (K = sampling_topk); or ids None
        and scores (1, V) the row's logits by token id, unranked (sampling_topk 0, or masks) -> parents (1,) and the
        next token (1,)."""
        options = self.options
        if ids is None:  # repeats penalised and tokens disabled, the log-softmax; sample_whole draws unranked
            scores = log_softmax(scores) if self.masks is None else \
                self.masks.apply(scores, [self.tokens], len(self.tokens))
            if options.sampling_topk:
                ids, scores = best_candidates(scores, options.sampling_topk)
        if ids is None:
            token = sample_whole(scores[0], options.sampling_temperature, options.sampling_topp, self.rng)
            score = scores[0, token]
        else:
            i = sample_index(scores[0, :self.candidates or None], options.sampling_temperature, options.sampling_topp,
                             self.rng)
            token, score = int(ids[0, i]), scores[0, i]
        self.score += float(score)
        if token == self.eos_id:
            self.finish = "eos"
        else:
            self.tokens.append(token)
            if len(self.tokens) >= self.budget:
                self.finish = "length"
        self.done = bool(self.finish)
        return np.zeros(1, np.int64), np.array([token], np.int64)

    def results(self) -> list[Hypothesis]:
        return [Hypothesis(self.tokens, self.score, self.finish,
                           mean_log_prob(self.score, len(self.tokens), self.finish == "eos"))]

    def settled(self) -> list[int]:
        return self.tokens


def sample_index(log_probs: np.ndarray, temperature: float, topp: float, rng: np.random.Generator) -> int:
    """Index of the drawn candidate among log_probs (K,), sorted best first (ties: as given). Top-p keeps a
    candidate while the probability of the better ones is below topp; the draw never lands past the last one
    kept (rounding can put it at the very end of the sum)."""
    z = log_probs.astype(np.float64) / temperature
    probs = np.exp(z - z.max())  # unnormalised
    kept = len(probs) if topp >= 1 else min(len(probs), _first_past(probs, topp * probs.sum(), "left") + 1)
    return min(_first_past(probs[:kept], rng.random() * probs[:kept].sum(), "right"), kept - 1)


_BLOCK = 1024  # candidates a block of the cumulative mass (_first_past)


def _first_past(probs: np.ndarray, limit: float, side: str) -> int:
    """The first index at which the cumulative mass of probs (K,) reaches limit (side "left": ≥) or passes it
    ("right": >), K if none does. The sums of blocks find the block, and one block's cumulative sum the index:
    numpy's cumulative sum is a serial loop, slow over a large vocabulary."""
    n = len(probs)
    if n <= _BLOCK:  # one block (a top-k sampler's candidates)
        return int(np.searchsorted(np.cumsum(probs), limit, side))
    blocks = np.zeros(-(-n // _BLOCK) * _BLOCK)
    blocks[:n] = probs
    blocks = blocks.reshape(-1, _BLOCK)
    ends = np.cumsum(blocks.sum(axis=1))  # the mass up to each block's end
    j = min(int(np.searchsorted(ends, limit, side)), len(ends) - 1)
    within = (ends[j - 1] if j else 0.0) + np.cumsum(blocks[j])
    return min(j * _BLOCK + int(np.searchsorted(within, limit, side)), n)


def sample_whole(log_probs: np.ndarray, temperature: float, topp: float, rng: np.random.Generator) -> int:
    """The token that sample_index draws from the whole vocabulary ranked best first, ties by lower id (as the
    decoder's TopK head ranks it), without ranking the tokens: sample_index on the log-probs' values sorted
    (the same numbers in the same order), then the token at the drawn place among the tokens of its value, by
    id. log_probs (V,) by token id. A sort of V values, not of V (value, id) keys."""
    ranked = -np.sort(-log_probs)  # best first
    i = sample_index(ranked, temperature, topp, rng)
    value = ranked[i]
    return int(np.flatnonzero(log_probs == value)[i - np.count_nonzero(log_probs > value)])
