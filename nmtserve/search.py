"""Beam search and sampling for one request, over the candidates of its rows. Numpy only, torch-free:
OnnxTranslator (export/runtime) and the server's engine both drive these, one object per request, so
a request's result depends on its own rows alone, never on what else shares the decoder batch.

A request decodes in `rows` rows of the decoder batch (beam_size for beam search, 1 when sampling).
After each decoder step its search gets, for each of its rows, the `candidates` best tokens and their
log-probabilities (the decoder graph's TopK head; 0 = the row's logits over the whole vocabulary, which the
search turns into log-probabilities itself: `TokenMasks`, `log_softmax`), and answers which row's
cache each row continues (`parents`, indices among the request's own rows) and which token it feeds
next. Greedy search is beam search with one beam, which OnnxTranslator and the engine run vectorised
(they need no object per request for it).

The rules follow CTranslate2's (src/decoding.cc, src/sampling.cc), so that the same weights give the
same output there and here; `BeamSearch` and `Sampling` say exactly when a hypothesis finishes and when
the search stops.

    search = make_search(DecodingOptions(beam_size=4, num_hypotheses=2), budget=30, eos_id=3)
    while not search.done:
        ids, scores = decoder_step(search.candidates)   # (rows, K) each: the rows' best, ties by lower id
        parents, tokens = search.step(ids, scores)
    search.results()   # [Hypothesis(tokens, score, finish, mean_log_prob), …], best first
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, replace

import numpy as np

from nmtserve.decoding import LENGTH_RULES
from nmtserve.errors import ConfigError

BEAM_STOPPING = ("ctranslate2", "transformers")


@dataclass(frozen=True)
class DecodingOptions:
    """How one request is decoded; CTranslate2's translate_batch names and defaults."""

    beam_size: int = 1
    num_hypotheses: int = 1  # the n-best list's length, at most beam_size
    length_penalty: float = 0.0  # a finished hypothesis scores (sum of log-probs) / length ** length_penalty
    patience: float = 1.0  # with a length penalty, stop after round(beam_size × patience) finished hypotheses
    sampling_topk: int = 1  # 1: no sampling; 0: sample from the whole vocabulary; k: from the k best tokens
    sampling_topp: float = 1.0  # then keep the smallest set of best tokens whose probability reaches topp
    sampling_temperature: float = 1.0  # log-probabilities are divided by it before sampling
    seed: int = 0  # of the request's own random generator; 0 draws one from the operating system
    max_decoding_length: int = 256
    beam_stopping: str = "ctranslate2"  # or "transformers": when beam search stops (BeamSearch says how)
    length_rule: str = "nmtserve"  # or "transformers": the output budget, and how it ends (decoding.output_budget)
    # CTranslate2's disabled tokens (TokenMasks): eos before this many tokens after a forced prefix (CTranslate2's
    # default is 1, nmtserve's 0: eos may come first, as in transformers), unk, repeated n-grams, token sequences
    min_decoding_length: int = 0
    disable_unk: bool = False
    no_repeat_ngram_size: int = 0
    suppress_sequences: tuple[tuple[int, ...], ...] = ()  # token ids; a single token is never generated
    # CTranslate2's: with a target prefix, the prefix is not forced but favoured (BeamSearch's `bias`)
    prefix_bias_beta: float = 0.0
    # CTranslate2's: the logit of each token already in the row's sequence divided by it (multiplied where
    # negative) before the log-softmax; above 1 discourages repeats (TokenMasks)
    repetition_penalty: float = 1.0
    # nmtserve's: token sequences every hypothesis must contain (a glossary's target terms: ConstrainedBeamSearch)
    constraints: tuple[tuple[int, ...], ...] = ()

    def override(self, **given) -> DecodingOptions:
        """These options (a model's defaults) with what a request gives; a sampled request decodes one
        row unless it gives beam_size."""
        if given.get("sampling_topk", 1) != 1:
            given.setdefault("beam_size", 1)
        return replace(self, **given)

    @property
    def sampling(self) -> bool:
        return self.sampling_topk != 1

    @property
    def masked(self) -> bool:
        """Whether tokens are disabled or repeats penalised (TokenMasks) or a prefix favoured: the rows then rank
        the whole vocabulary in their search."""
        return bool(self.min_decoding_length or self.disable_unk or self.no_repeat_ngram_size or self.suppress_sequences
                    or self.prefix_bias_beta or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        """Greedy search as the callers run it vectorised; with disabled tokens a beam of one does it instead."""
        return self.beam_size == 1 and not self.sampling and not self.masked and not self.constraints

    @property
    def mode(self) -> str:
        """"greedy", "beam" or "sampling": the decoding mode, as metrics label it."""
        return "sampling" if self.sampling else "greedy" if self.beam_size == 1 else "beam"

    def check(self, vocab_size: int, max_beam_size: int | None = None) -> None:
        """ConfigError naming the field, its value and the limit, for a value out of range."""
        k, n = self.beam_size, self.num_hypotheses
        rules = [  # in order: a rule may assume the ones before it hold
            ("beam_size", k, lambda: k >= 1, "at least 1"),
            ("beam_size", k, lambda: max_beam_size is None or k <= max_beam_size,
             f"at most {max_beam_size} (the server's --max-beam-size)"),
            ("beam_size", k, lambda: 2 * k <= vocab_size, f"at most {vocab_size // 2} (half the vocabulary)"),
            ("num_hypotheses", n, lambda: 1 <= n <= k, f"between 1 and beam_size ({k})"),
            ("length_penalty", self.length_penalty, lambda: np.isfinite(self.length_penalty), "a finite number"),
            ("patience", self.patience, lambda: 0 < self.patience < np.inf, "above 0"),
            ("patience", self.patience, lambda: round(k * self.patience) >= n,
             f"enough for num_hypotheses ({n}) finished hypotheses: beam_size × patience"),
            ("sampling_topk", self.sampling_topk, lambda: 0 <= self.sampling_topk <= vocab_size,
             f"between 0 (the whole vocabulary) and {vocab_size}"),
            ("sampling_topk", self.sampling_topk, lambda: not self.sampling or k == 1,
             "1 (no sampling) with beam_size above 1"),
            ("sampling_topp", self.sampling_topp, lambda: 0 < self.sampling_topp <= 1, "in (0, 1]"),
            ("sampling_temperature", self.sampling_temperature, lambda: 0 < self.sampling_temperature < np.inf,
             "above 0"),
            ("seed", self.seed, lambda: 0 <= self.seed < 2 ** 64, "between 0 and 2^64 - 1"),
            ("max_decoding_length", self.max_decoding_length, lambda: self.max_decoding_length >= 1, "at least 1"),
            ("beam_stopping", self.beam_stopping, lambda: self.beam_stopping in BEAM_STOPPING,
             " or ".join(BEAM_STOPPING)),
            ("length_rule", self.length_rule, lambda: self.length_rule in LENGTH_RULES, " or ".join(LENGTH_RULES)),
            ("min_decoding_length", self.min_decoding_length,
             lambda: 0 <= self.min_decoding_length <= self.max_decoding_length,
             f"between 0 and max_decoding_length ({self.max_decoding_length})"),
            ("no_repeat_ngram_size", self.no_repeat_ngram_size, lambda: self.no_repeat_ngram_size >= 0, "0 or more"),
            ("repetition_penalty", self.repetition_penalty, lambda: 0 < self.repetition_penalty < np.inf,
             "above 0 (1: none)"),
            ("prefix_bias_beta", self.prefix_bias_beta, lambda: 0 <= self.prefix_bias_beta < 1, "in [0, 1)"),
            ("prefix_bias_beta", self.prefix_bias_beta, lambda: not (self.prefix_bias_beta and self.sampling),
             "0 when sampling"),
            ("suppress_sequences", self.suppress_sequences,
             lambda: all(s and all(0 <= t < vocab_size for t in s) for s in self.suppress_sequences),
             f"sequences of at least one token id between 0 and {vocab_size - 1}"),
            ("constraints", self.constraints,
             lambda: all(c and all(0 <= t < vocab_size for t in c) for c in self.constraints),
             f"sequences of at least one token id between 0 and {vocab_size - 1}"),
            ("constraints", self.constraints, lambda: not (self.constraints and self.sampling), "none when sampling"),
            ("beam_size", k, lambda: k > sum(len(c) for c in self.constraints),
             f"above the constraints' {sum(len(c) for c in self.constraints)} tokens (a beam per bank)"),
        ]
        for name, value, ok, limit in rules:
            if not ok():
                raise ConfigError(f"{name} {value}: must be {limit}")


@dataclass
class Hypothesis:
    tokens: list[int]  # target ids, eos excluded
    score: float  # beam search: sum of log-probs (eos included) / length ** length_penalty; else the sum
    finish: str  # "eos" or "length"
    mean_log_prob: float = math.nan  # of the tokens decoded, eos included (`mean_log_prob`); nan when not scored

    @property
    def confidence(self) -> float:
        """exp(mean_log_prob): the geometric mean of its decoded tokens' probabilities, from 0 to 1 (nan when not
        scored). A translation scoring higher is more often right: `nmtserve evaluate --calibration` shows how."""
        return math.exp(self.mean_log_prob)


def mean_log_prob(total: float, tokens: int, eos: bool) -> float:
    """The mean log-prob of a hypothesis's decoded tokens: `total`, the sum of the log-probs of its `tokens` decoded
    tokens and of its eos (when `eos`: one decoded), over their count (forced tokens are neither summed nor counted)."""
    return total / max(1, tokens + eos)


class BeamSearch:
    """Beam search over `beam_size` rows, as CTranslate2's BeamSearch.

    Every step, each live hypothesis (a row) is extended by every token; of the beam_size × V
    extensions the 2 × beam_size best by cumulative log-probability are the candidates, sorted best
    first (ties: lower row, then lower token id). At the first step only row 0 counts (all rows hold
    the same start). Then, for i = 0 … beam_size - 1, candidate i finishes a hypothesis if its token is
    eos, or if this step is the last one of the budget (every candidate i then finishes); a finished
    candidate's place goes to the next candidate from i = beam_size on that is not eos. Eos candidates
    past beam_size are dropped, never finished. A finished hypothesis's length counts its eos. With
    length_rule "transformers" (a forced eos after the budget) the last step is an ordinary one, and then
    every live hypothesis finishes with that eos (log-prob 0, counted in its length, finish "length"),
    unless the search stopped at that step anyway.

    The search stops after the step where the budget is spent, or, with beam_stopping "ctranslate2"
    (CTranslate2's rule): without a length penalty, the best candidate (i = 0) has finished at some
    step and at least num_hypotheses hypotheses have; with a length penalty, round(beam_size ×
    patience) hypotheses have finished. With beam_stopping "transformers" (transformers' beam search
    with early_stopping=False, its default and OPUS-MT's): once beam_size hypotheses have finished and
    the best live hypothesis, scored at its current length (sum / steps ** length_penalty), does not
    beat the worst of the beam_size best finished ones. The result is the finished hypotheses, scored
    sum / length ** length_penalty, the num_hypotheses best, best first.
    """

    def __init__(self, options: DecodingOptions, budget: int, eos_id: int, prefix: int = 0,
                 masks: TokenMasks | None = None, favoured: list[int] = ()):
        self.k, self.options, self.budget, self.eos_id = options.beam_size, options, budget, eos_id
        self.prefix = prefix  # forced tokens before the search's first step (a target language): counted in lengths
        self.masks = masks  # disabled tokens: the step then gets each row's whole distribution (candidates 0)
        # prefix_bias_beta's target prefix: at step t a row that has not left it takes log((1 - β) p + β [prefix[t]]);
        # as CTranslate2's BiasedDecoder, whose flags follow the candidates' places, not their parents
        self.favoured, self.diverged = list(favoured), np.zeros(self.k, bool)
        self.rows, self.candidates = self.k, 0 if masks else 2 * self.k
        self.scores = np.full(self.k, -np.inf)
        self.scores[0] = 0.0
        self.live: list[list[int]] = [[] for _ in range(self.k)]
        self.finished: list[tuple[list[int], float, bool, str]] = []  # tokens, sum of log-probs, eos counted, finish
        self.forced_eos = options.length_rule == "transformers"
        self.top_finished = False
        self.steps = 0
        self.done = False

    def step(self, ids: np.ndarray | None, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids, scores (rows, ≥ 2k): each row's best tokens and their log-probs, best first; or, with masks, ids
        None and scores (rows, V) each row's logits by token id -> parents (rows,) and next tokens (rows,)."""
        k = self.k
        if ids is None:  # repeats penalised, tokens disabled, the log-softmax, a prefix favoured: each row's 2k best
            ids, scores = best_candidates(self._favour(self.masks.apply(scores, self.live, self.steps)), 2 * k)
        total = (self.scores[:, None] + scores[:, : 2 * k]).ravel()  # (k · 2k,), row by row
        # best first; a stable sort keeps equal totals in row order, and each row's candidates come
        # with ties by lower id: the order lexsort((id, row, -total)) would give, in fewer calls
        best = np.argsort(-total, kind="stable")[: 2 * k]
        return self.select(best // (2 * k), ids[:, : 2 * k].ravel()[best], total[best])

    def _favour(self, log_probs: np.ndarray) -> np.ndarray:
        """log_probs (k, V) with prefix_bias_beta's favoured token mixed in, on the rows still on the prefix."""
        if self.steps >= len(self.favoured):
            return log_probs
        beta, token = self.options.prefix_bias_beta, self.favoured[self.steps]
        on = np.flatnonzero(~self.diverged)
        mixed = (1 - beta) * np.exp(log_probs[on].astype(np.float64))
        mixed[:, token] += beta
        with np.errstate(divide="ignore"):
            log_probs[on] = np.log(mixed)
        return log_probs

    def select(self, cand_row: np.ndarray, cand_id: np.ndarray, cand_score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rest of a step, from its 2k best candidates, best first: each one's row, token and
        cumulative log-prob -> parents (rows,) and next tokens (rows,)."""
        k = self.k
        if self.favoured:  # CTranslate2's flags: by the place of the k best candidates, before any finishes
            self.diverged |= (self.steps >= len(self.favoured)) | \
                (cand_id[:k] != self.favoured[min(self.steps, len(self.favoured) - 1)])
        self.steps += 1
        last = self.steps >= self.budget
        chosen = slice(0, k)  # unless a candidate finishes (on most steps none does)
        if last and not self.forced_eos or (cand_id[:k] == self.eos_id).any():
            chosen, spare = [], k
            for i in range(k):
                c = i
                if cand_id[i] == self.eos_id or last and not self.forced_eos:
                    self.top_finished |= i == 0
                    eos = bool(cand_id[i] == self.eos_id)
                    self.finished.append((self.live[cand_row[i]] + ([] if eos else [int(cand_id[i])]),
                                          float(cand_score[i]), eos, "eos" if eos else "length"))
                    while spare < 2 * k and cand_id[spare] == self.eos_id:
                        spare += 1
                    if spare < 2 * k:  # at most one eos per row: a spare always exists while 2k ≤ V
                        c, spare = spare, spare + 1
                chosen.append(c)
            chosen = np.array(chosen)
        parents, tokens = cand_row[chosen], cand_id[chosen].astype(np.int64, copy=False)
        self.live = [self.live[p] + [t] for p, t in zip(parents.tolist(), tokens.tolist())]
        self.scores = cand_score[chosen]
        if self.options.beam_stopping == "transformers":
            stop = len(self.finished) >= k and \
                self.scores.max() / (self.prefix + self.steps) ** self.options.length_penalty \
                <= self.best_finished()[-1]
        else:
            need, best_first = self._ctranslate2_rule()
            stop = len(self.finished) >= need and (self.top_finished or not best_first)
        if last and self.forced_eos and not stop:
            self.finished += [(tokens, float(score), True, "length") for tokens, score in zip(self.live, self.scores)
                              if score > -np.inf]
        self.done = last or stop
        return parents, tokens

    def _ctranslate2_rule(self) -> tuple[int, bool]:
        """CTranslate2's stopping rule: the finished hypotheses that stop the search, and whether the best
        candidate must have finished too (without a length penalty: num_hypotheses and yes; with one:
        round(beam_size × patience) and no)."""
        if self.options.length_penalty == 0:
            return self.options.num_hypotheses, True
        return round(self.k * self.options.patience), False

    def ordinary_steps(self) -> int:
        """The steps this search may take before one that is never ordinary: the budget's last, or any once
        transformers' stopping rule has beam_size finished hypotheses to check."""
        if self.options.beam_stopping == "transformers" and len(self.finished) >= self.k:
            return 0
        return self.budget - self.steps - 1

    def best_finished(self) -> list[float]:
        """The k best scores of the finished hypotheses (as `results` scores them), best first, -inf for those not
        finished yet: what transformers' stopping rule compares the best live hypothesis with."""
        best = heapq.nlargest(self.k, (h.score for h in self._scored()))
        return best + [-np.inf] * (self.k - len(best))

    def ordinary(self, eos_among_best: bool) -> bool:
        """Whether a step is an ordinary one: no eos among its k best candidates, the budget not spent, no
        stopping rule to check. Then `step` would keep the k best candidates and not stop: `advance`."""
        return not eos_among_best and self.ordinary_steps() > 0

    def advance(self, parents, tokens, scores: np.ndarray) -> None:
        """Ordinary steps (`ordinary`), ranked by the caller (numpy's beam_steps, or the library's ordinary steps):
        each step's k best candidates' rows and ids (steps × k), and the rows' cumulative scores after the last."""
        for step_parents, step_tokens in zip(parents, tokens):
            self.live = [self.live[p] + [t] for p, t in zip(step_parents, step_tokens)]
        self.steps += len(parents)
        self.scores = scores

    def _scored(self) -> list[Hypothesis]:
        penalty = self.options.length_penalty
        return [Hypothesis(tokens, score / (self.prefix + len(tokens) + eos) ** penalty if penalty else score, finish,
                           mean_log_prob(score, len(tokens), finish == "eos"))  # a forced eos is not counted
                for tokens, score, eos, finish in self.finished]

    def results(self) -> list[Hypothesis]:
        return sorted(self._scored(), key=lambda h: -h.score)[: self.options.num_hypotheses]

    def settled(self) -> list[int]:
        """The tokens every hypothesis that can still be in the result starts with: they never change."""
        return _common_prefix(self.live + [tokens for tokens, *_ in self.finished])


class ConstrainedBeamSearch(BeamSearch):
    """Beam search whose hypotheses each contain every constraint (a token sequence: a glossary's target term), by
    dynamic beam allocation (Post & Vilar 2018, "Fast Lexically Constrained Decoding with Dynamic Beam Allocation").

    Each row tracks the constraints its hypothesis has met and the one it is inside (`_after`: a token that leaves
    a constraint unfinished abandons it). Each step ranks, from each row's whole distribution, the 2k best
    extensions overall, each row's best, and each row's extensions by the next token of a constraint (the one it is
    inside, or the first token of any it has not met); eos only once every constraint is met. The candidates fall
    into banks by the constraint tokens their hypotheses have met (0 … C), and the beam is shared among them: the
    best k // (C + 1) of each bank, then the best of the rest until k are chosen. The k chosen,
    best first, and the other candidates as spares, take BeamSearch's step (`select`: which finish, when the search
    stops). A hypothesis that reaches its budget without every constraint finishes by length; `results` puts those
    after the ones that contain every constraint."""

    def __init__(self, options: DecodingOptions, budget: int, eos_id: int, prefix: int = 0,
                 masks: TokenMasks | None = None, favoured: list[int] = ()):
        super().__init__(options, budget, eos_id, prefix, masks, favoured)
        self.constraints = [list(c) for c in options.constraints]
        self.banks = sum(len(c) for c in self.constraints) + 1
        self.candidates = 0  # each row's whole distribution: a constraint's next token may rank anywhere
        self.state: list[tuple[frozenset, tuple[int, int] | None]] = [(frozenset(), None)] * self.k

    def step(self, ids: np.ndarray | None, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """scores (rows, V): each row's logits by token id (ids None: candidates 0) -> parents and tokens."""
        k, eos = self.k, self.eos_id
        scores = log_softmax(scores) if self.masks is None else self.masks.apply(scores, self.live, self.steps)
        if self.favoured:
            scores = self._favour(np.array(scores, np.float32))
        total = self.scores[:, None] + scores.astype(np.float64)  # (k, V): rows at -inf give -inf
        unmet = [len(met) < len(self.constraints) for met, _ in self.state]
        total[unmet, eos] = -np.inf
        pairs = set(np.argpartition(-total.ravel(), 2 * k - 1)[:2 * k].tolist())
        for r in range(k):
            if np.isfinite(self.scores[r]):
                pairs.add(r * total.shape[1] + int(total[r].argmax()))
                pairs.update(r * total.shape[1] + t for t in self._wanted(r))
        pairs = [p for p in pairs if np.isfinite(total.flat[p])]
        pairs.sort(key=lambda p: (-total.flat[p], p))  # best first; ties: lower row, then lower token
        width = total.shape[1]
        bank = [self._met(self._after(self.state[p // width], p % width)) for p in pairs]
        share = k // self.banks  # at least 1: beam_size is above the constraints' tokens (DecodingOptions.check)
        per_bank: dict[int, list[int]] = {}
        for i, own in enumerate(bank):  # best first within each bank
            per_bank.setdefault(own, []).append(i)
        taken = {i for members in per_bank.values() for i in members[:share]}
        rest = [i for i in range(len(pairs)) if i not in taken]
        chosen = sorted([*taken, *rest[:k - len(taken)]])  # best first
        order = [pairs[i] for i in chosen + rest[k - len(taken):][:k]]  # then the spares
        cand_row, cand_id = np.array(order) // width, np.array(order) % width
        before = self.state
        parents, tokens = self.select(cand_row, cand_id, total.flat[order])
        self.state = [before[p] if t == eos else self._after(before[p], t)
                      for p, t in zip(parents.tolist(), tokens.tolist())]
        return parents, tokens

    def _wanted(self, r: int) -> list[int]:
        """The tokens that take row r further into a constraint."""
        met, inside = self.state[r]
        wanted = {c[0] for i, c in enumerate(self.constraints) if i not in met}
        if inside is not None:
            wanted.add(self.constraints[inside[0]][inside[1]])
        return sorted(wanted)

    def _after(self, state: tuple[frozenset, tuple[int, int] | None], token: int) \
            -> tuple[frozenset, tuple[int, int] | None]:
        """A row's constraints met and the one it is inside (constraint, tokens matched), after `token`."""
        met, inside = state
        if inside is not None:
            c, n = inside
            if self.constraints[c][n] == token:
                return (met | {c}, None) if n + 1 == len(self.constraints[c]) else (met, (c, n + 1))
        for c, tokens in enumerate(self.constraints):  # none in progress, or abandoned: one may start here
            if c not in met and tokens[0] == token:
                return (met | {c}, None) if len(tokens) == 1 else (met, (c, 1))
        return met, None

    def _met(self, state: tuple[frozenset, tuple[int, int] | None]) -> int:
        """The constraint tokens a row has met: its bank."""
        met, inside = state
        return sum(len(self.constraints[c]) for c in met) + (inside[1] if inside else 0)

    def ordinary_steps(self) -> int:
        return 0  # every step ranks the whole distribution here, never in the library

    def contains_all(self, tokens: list[int]) -> bool:
        return all(any(tokens[i:i + len(c)] == c for i in range(len(tokens) - len(c) + 1)) for c in self.constraints)

    def results(self) -> list[Hypothesis]:
        ranked = sorted(self._scored(), key=lambda h: (not self.contains_all(h.tokens), -h.score))
        return ranked[: self.options.num_hypotheses]


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


def beam_steps(searches: list[BeamSearch | None], ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One step of several beam searches of one beam size k, whose rows lie one after another, k each (None:
    a search that is over, its rows decoding on, ignored) -> each row's parent row (an index into all the
    rows) and next token. The same as each search's `step` on its own rows; the ranking of the candidates,
    and what follows on an ordinary step (`BeamSearch.ordinary`: most steps), run once for all of them,
    the rest of a step in the searches concerned (a finished row, the budget, a stopping rule)."""
    if len(searches) == 1 and searches[0] is not None:  # one search: its own step costs less than the set-up
        return searches[0].step(ids, scores)
    if ids is None:  # with masks, each search ranks its own rows' whole distributions
        k = next(s.k for s in searches if s is not None)
        parents, tokens = np.arange(len(scores)), np.zeros(len(scores), np.int64)
        for j, search in enumerate(searches):
            if search is not None:
                own = slice(j * k, (j + 1) * k)
                chosen, tokens[own] = search.step(None, scores[own])
                parents[own] = chosen + j * k
        return parents, tokens
    n, k = len(searches), next(s.k for s in searches if s is not None)
    width = 2 * k
    beams = np.array([np.zeros(k) if s is None else s.scores for s in searches])  # (n, k), each search's own
    total = (beams[:, :, None] + scores[:, :width].reshape(n, k, width)).ravel()  # search by search, row by row
    best = np.argsort(-total.reshape(n, k * width), axis=1, kind="stable")[:, :width]  # as BeamSearch.step
    flat = (best + np.arange(0, n * k * width, k * width)[:, None]).ravel()
    cand_row, cand_score = best // width, total[flat].reshape(n, width)  # each search's 2k best, best first
    cand_id = np.ascontiguousarray(ids[:, :width]).ravel()[flat].reshape(n, width)
    parents = (cand_row[:, :k] + np.arange(0, n * k, k)[:, None]).ravel()
    tokens = cand_id[:, :k].ravel().astype(np.int64)
    eos = (cand_id[:, :k] == next(s.eos_id for s in searches if s is not None)).any(axis=1).tolist()
    rows, ids_k = cand_row[:, :k].tolist(), cand_id[:, :k].tolist()
    for j, search in enumerate(searches):
        own = slice(j * k, (j + 1) * k)
        if search is None:  # its rows decode on, ignored: each continues itself
            parents[own], tokens[own] = np.arange(j * k, (j + 1) * k), ids[own, 0]
        elif search.ordinary(eos[j]):
            search.advance([rows[j]], [ids_k[j]], cand_score[j, :k])
        else:
            chosen, tokens[own] = search.select(cand_row[j], cand_id[j], cand_score[j])
            parents[own] = chosen + j * k
    return parents, tokens


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


def make_search(options: DecodingOptions, budget: int, eos_id: int, forced: list[int] = (), unk_id: int = -1,
                favoured: list[int] = ()) -> BeamSearch | Sampling:
    """The search of one non-greedy request (greedy requests are decoded vectorised by the callers; with disabled
    tokens a beam of one). `forced`: the target tokens before its first step (transformers' forced_bos_token_id, a
    target_prefix), which beam search counts in every hypothesis's length; `budget` counts the tokens after them.
    `favoured`: a target_prefix that prefix_bias_beta favours instead of forcing."""
    masks = TokenMasks(options, eos_id, unk_id, forced) if options.masked else None
    if options.sampling:
        return Sampling(options, budget, eos_id, masks)
    if options.constraints:
        return ConstrainedBeamSearch(options, budget, eos_id, len(forced), masks, favoured)
    return BeamSearch(options, budget, eos_id, len(forced), masks, favoured)


def constrained_beam(options: DecodingOptions, constraints: tuple[tuple[int, ...], ...]) -> DecodingOptions:
    """The options of a sentence whose hypotheses must contain `constraints` (token sequences): beam search, as
    wide as the options say and at least one beam more than the constraints' tokens (a beam per bank:
    ConstrainedBeamSearch). No constraints: the options as they are."""
    if not constraints:
        return options
    return replace(options, constraints=constraints,
                   beam_size=max(options.beam_size, sum(len(c) for c in constraints) + 1))


class TokenMasks:
    """CTranslate2's logits processors, in its order, on a search's rows' logits over the whole vocabulary, then the
    log-softmax: repetition_penalty on every token of the row's sequence (a forced prefix's included, the start
    token not: CTranslate2's alive sequence), then the disabled tokens: eos before min_decoding_length tokens, unk
    with disable_unk, each of suppress_sequences' last token where the sequence ends with the rest of it (a single
    token: always), and with no_repeat_ngram_size n every token that would repeat an n-gram of the sequence."""

    def __init__(self, options: DecodingOptions, eos_id: int, unk_id: int, start: list[int]):
        self.options, self.eos_id, self.unk_id, self.start = options, eos_id, unk_id, list(start)
        self.always = [s[0] for s in options.suppress_sequences if len(s) == 1] + ([unk_id] if options.disable_unk else [])
        self.sequences = [list(s) for s in options.suppress_sequences if len(s) > 1]

    def apply(self, logits: np.ndarray, histories: list[list[int]], step: int) -> np.ndarray:
        """logits (R, V) of rows whose tokens after the start and prefix are histories[r], at the search's step
        `step` (0: its first) -> their log-probs, penalised and masked (a copy)."""
        out = np.array(logits, np.float32)
        penalty = self.options.repetition_penalty
        if penalty != 1:
            for r, history in enumerate(histories):
                seen = list(set(self.start + history))
                out[r, seen] = np.where(out[r, seen] < 0, out[r, seen] * penalty, out[r, seen] / penalty)
        if step < self.options.min_decoding_length:
            out[:, self.eos_id] = -np.inf
        if self.always:
            out[:, self.always] = -np.inf
        n = self.options.no_repeat_ngram_size
        for r, history in enumerate(histories):
            sequence = self.start + history
            for suppressed in self.sequences:
                if sequence[len(sequence) - len(suppressed) + 1:] == suppressed[:-1]:
                    out[r, suppressed[-1]] = -np.inf
            if n and len(sequence) >= n:
                tail = sequence[len(sequence) - n + 1:]
                banned = [sequence[i + n - 1] for i in range(len(sequence) - n + 1) if sequence[i:i + n - 1] == tail]
                out[r, banned] = -np.inf
        return log_softmax(out)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's log-probabilities (float32) from its logits; a row of -inf stays -inf."""
    out = np.array(logits, np.float32)
    live = np.isfinite(out).any(axis=1)
    top = out[live].max(axis=1, keepdims=True)
    out[live] -= top + np.log(np.exp(out[live] - top).sum(axis=1, keepdims=True))
    return out


def best_candidates(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k best tokens and their log-probs (R, k) from its log-probs over the vocabulary (R, V), best
    first, ties by lower id (as the decoder's TopK head ranks them)."""
    part = np.argpartition(-log_probs, k - 1, axis=1)[:, :k]
    cut = np.take_along_axis(log_probs, part, axis=1).min(axis=1, keepdims=True)
    ids = np.zeros((len(log_probs), k), np.int64)
    for r, row in enumerate(log_probs):
        tied = np.flatnonzero(row >= cut[r, 0])  # every token at least as good as the k-th: ties included, by id
        ids[r] = tied[np.argsort(-row[tied], kind="stable")][:k]
    return ids, np.take_along_axis(log_probs, ids, axis=1)


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    prefix = seqs[0]
    for s in seqs[1:]:
        n = 0
        while n < min(len(prefix), len(s)) and prefix[n] == s[n]:
            n += 1
        prefix = prefix[:n]
    return prefix
