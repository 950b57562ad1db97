"""The searches of one request, over the candidates of its rows: beam search (`BeamSearch`, `ConstrainedBeamSearch`
for glossaries), beam steps ranked for several searches at once (`beam_steps`), and `make_search`, which picks a
request's search (beam, constrained beam, or sampling: nmtserve/sampling.py). Numpy only, torch-free:
OnnxTranslator (export/runtime) and the server's engine both drive these, one object per request, so
a request's result depends on its own rows alone, never on what else shares the decoder batch.

A request decodes in `rows` rows of the decoder batch (beam_size for beam search, 1 when sampling).
After each decoder step its search gets, for each of its rows, the `candidates` best tokens and their
log-probabilities (the decoder graph's TopK head; 0 = the row's logits over the whole vocabulary, which the
search turns into log-probabilities itself: nmtserve/logits.py), and answers which row's
cache each row continues (`parents`, indices among the request's own rows) and which token it feeds
next. Which extensions a beam keeps is ranked by the bundle's ranker graph (`Rank`, passed in: the one ranking,
whichever loop decodes; it also says whether an eos is among a search's k best, which makes a step more than an
ordinary one); what a step then does (finished hypotheses, spares, stopping) is written here. Greedy search is
beam search with one beam, which the decoder's loops run vectorised (no object per request), stopping each row
where the bundle's decoder graph says (export/build/step_graphs.py, with_stop_rule).

The rules follow CTranslate2's (src/decoding.cc, src/sampling.cc), so that the same weights give the
same output there and here; `BeamSearch` and `Sampling` say exactly when a hypothesis finishes and when
the search stops.

    search = make_search(DecodingOptions(beam_size=4, num_hypotheses=2), budget=30, eos_id=3)
    while not search.done:
        ids, scores = decoder_step(search.candidates)   # (rows, K) each: the rows' best, ties by lower id
        parents, tokens = search.step(ids, scores, Ranker(bundle.ranker_path, 3).rank)
    search.results()   # [Hypothesis(tokens, score, finish, mean_log_prob), …], best first
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from nmtserve.decoding import DecodingOptions, Hypothesis, mean_log_prob
from nmtserve.logits import TokenMasks, best_candidates, log_softmax
from nmtserve.sampling import Sampling

# beam search's ranking: (beam (n, k), ids (n, k, w), scores (n, k, w)) -> each search's w best extensions, best
# first: rows, tokens, totals (n, w), and ended (n,): an eos among its k best; the bundle's ranker graph
# (export/build/ranker.py) through export/runtime/ranker.py
Rank = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


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

    def step(self, ids: np.ndarray | None, scores: np.ndarray, rank: Rank) -> tuple[np.ndarray, np.ndarray]:
        """ids, scores (rows, ≥ 2k): each row's best tokens and their log-probs, best first; or, with masks, ids
        None and scores (rows, V) each row's logits by token id -> parents (rows,) and next tokens (rows,). `rank`:
        the ranker (module docstring)."""
        k = self.k
        if ids is None:  # repeats penalised, tokens disabled, the log-softmax, a prefix favoured: each row's 2k best
            ids, scores = best_candidates(self._favour(self.masks.apply(scores, self.live, self.steps)), 2 * k)
        rows, tokens, totals, _ = rank(self.scores[None], ids[None, :, :2 * k], scores[None, :, :2 * k])
        return self.select(rows[0], tokens[0], totals[0])

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


class Progress(NamedTuple):
    """A row's way through its constraints (ConstrainedBeamSearch)."""
    met: frozenset = frozenset()  # the constraints its hypothesis contains
    inside: tuple[int, int] | None = None  # the constraint it is inside and the tokens of it matched
    just: int | None = None  # the constraint its last token finished


class ConstrainedBeamSearch(BeamSearch):
    """Beam search whose hypotheses each contain every constraint (a token sequence: a glossary's target term), by
    dynamic beam allocation (Post & Vilar 2018, "Fast Lexically Constrained Decoding with Dynamic Beam Allocation").

    Each row tracks the constraints its hypothesis has met and the one it is inside (`_after`: a token that leaves
    a constraint unfinished abandons it; with `continues`, the tokens that continue a word, a token that runs a just
    finished constraint on into a longer word unmeets it: "village" then "nt" is not the term). Each step ranks, from each row's whole distribution, the 2k best
    extensions overall, each row's best, and each row's extensions by the next token of a constraint (the one it is
    inside, or the first token of any it has not met); eos only once every constraint is met. The candidates fall
    into banks by the constraint tokens their hypotheses have met (0 … C), and the beam is shared among them: the
    best k // (C + 1) of each bank, then the best of the rest until k are chosen. The k chosen,
    best first, and the other candidates as spares, take BeamSearch's step (`select`: which finish, when the search
    stops). A hypothesis that reaches its budget without every constraint finishes by length; `results` puts those
    after the ones that contain every constraint."""

    def __init__(self, options: DecodingOptions, budget: int, eos_id: int, prefix: int = 0,
                 masks: TokenMasks | None = None, favoured: list[int] = (), continues: np.ndarray | None = None):
        super().__init__(options, budget, eos_id, prefix, masks, favoured)
        self.constraints = [list(c) for c in options.constraints]
        self.continues = continues
        self.banks = sum(len(c) for c in self.constraints) + 1
        self.candidates = 0  # each row's whole distribution: a constraint's next token may rank anywhere
        self.state: list[Progress] = [Progress()] * self.k

    def step(self, ids: np.ndarray | None, scores: np.ndarray, rank: Rank | None = None) -> tuple[np.ndarray, np.ndarray]:
        """scores (rows, V): each row's logits by token id (ids None: candidates 0) -> parents and tokens. Ranks its
        banks itself (`rank` unused)."""
        k, eos = self.k, self.eos_id
        scores = log_softmax(scores) if self.masks is None else self.masks.apply(scores, self.live, self.steps)
        if self.favoured:
            scores = self._favour(np.array(scores, np.float32))
        total = self.scores[:, None] + scores.astype(np.float64)  # (k, V): rows at -inf give -inf
        unmet = [len(state.met) < len(self.constraints) for state in self.state]
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
        met, inside, _ = self.state[r]
        wanted = {c[0] for i, c in enumerate(self.constraints) if i not in met}
        if inside is not None:
            wanted.add(self.constraints[inside[0]][inside[1]])
        return sorted(wanted)

    def _after(self, state: Progress, token: int) -> Progress:
        """A row's progress after `token`."""
        met, inside, just = state
        if just is not None and self.continues is not None and self.continues[token]:
            met = met - {just}  # the term ran on into a longer word
        if inside is not None:
            c, n = inside
            if self.constraints[c][n] == token:
                return Progress(met | {c}, None, c) if n + 1 == len(self.constraints[c]) else Progress(met, (c, n + 1))
        for c, tokens in enumerate(self.constraints):  # none in progress, or abandoned: one may start here
            if c not in met and tokens[0] == token:
                return Progress(met | {c}, None, c) if len(tokens) == 1 else Progress(met, (c, 1))
        return Progress(met)

    def _met(self, state: Progress) -> int:
        """The constraint tokens a row has met: its bank."""
        return sum(len(self.constraints[c]) for c in state.met) + (state.inside[1] if state.inside else 0)

    def ordinary_steps(self) -> int:
        return 0  # every step ranks the whole distribution here, never in the library

    def contains_all(self, tokens: list[int]) -> bool:
        """Whether every constraint is in `tokens`, none of them run on into a longer word."""
        def ends_a_word(end: int) -> bool:
            return end == len(tokens) or self.continues is None or not self.continues[tokens[end]]
        return all(any(tokens[i:i + len(c)] == c and ends_a_word(i + len(c)) for i in range(len(tokens) - len(c) + 1))
                   for c in self.constraints)

    def results(self) -> list[Hypothesis]:
        ranked = sorted(self._scored(), key=lambda h: (not self.contains_all(h.tokens), -h.score))
        return ranked[: self.options.num_hypotheses]


def beam_steps(searches: list[BeamSearch | None], ids: np.ndarray | None, scores: np.ndarray, rank: Rank) \
        -> tuple[np.ndarray, np.ndarray]:
    """One step of several beam searches of one beam size k, whose rows lie one after another, k each (None:
    a search that is over, its rows decoding on, ignored) -> each row's parent row (an index into all the
    rows) and next token. The same as each search's `step` on its own rows; the ranking of the candidates
    (`rank`), and what follows on an ordinary step (`BeamSearch.ordinary`: most steps), run once for all of
    them, the rest of a step in the searches concerned (a finished row, the budget, a stopping rule)."""
    if len(searches) == 1 and searches[0] is not None:  # one search: its own step costs less than the set-up
        return searches[0].step(ids, scores, rank)
    if ids is None:  # with masks, each search ranks its own rows' whole distributions
        k = next(s.k for s in searches if s is not None)
        parents, tokens = np.arange(len(scores)), np.zeros(len(scores), np.int64)
        for j, search in enumerate(searches):
            if search is not None:
                own = slice(j * k, (j + 1) * k)
                chosen, tokens[own] = search.step(None, scores[own], rank)
                parents[own] = chosen + j * k
        return parents, tokens
    n, k = len(searches), next(s.k for s in searches if s is not None)
    width = 2 * k
    beams = np.array([np.zeros(k) if s is None else s.scores for s in searches])  # (n, k), each search's own
    cand_row, cand_id, cand_score, ended = rank(beams, ids[:, :width].reshape(n, k, width),
                                                scores[:, :width].reshape(n, k, width))  # each search's 2k best
    parents = (cand_row[:, :k] + np.arange(0, n * k, k)[:, None]).ravel()
    tokens = cand_id[:, :k].ravel()
    rows, ids_k, ended = cand_row[:, :k].tolist(), cand_id[:, :k].tolist(), ended.tolist()
    for j, search in enumerate(searches):
        own = slice(j * k, (j + 1) * k)
        if search is None:  # its rows decode on, ignored: each continues itself
            parents[own], tokens[own] = np.arange(j * k, (j + 1) * k), ids[own, 0]
        elif search.ordinary(ended[j]):
            search.advance([rows[j]], [ids_k[j]], cand_score[j, :k])
        else:
            chosen, tokens[own] = search.select(cand_row[j], cand_id[j], cand_score[j])
            parents[own] = chosen + j * k
    return parents, tokens


def make_search(options: DecodingOptions, budget: int, eos_id: int, forced: list[int] = (), unk_id: int = -1,
                favoured: list[int] = (), continues: np.ndarray | None = None) -> BeamSearch | Sampling:
    """The search of one non-greedy request (greedy requests are decoded vectorised by the callers; with disabled
    tokens a beam of one). `forced`: the target tokens before its first step (transformers' forced_bos_token_id, a
    target_prefix), which beam search counts in every hypothesis's length; `budget` counts the tokens after them.
    `favoured`: a target_prefix that prefix_bias_beta favours instead of forcing. `continues`: (V,) the tokens that
    continue a word (constraints: a term must end a word)."""
    masks = TokenMasks(options, eos_id, unk_id, forced) if options.masked else None
    if options.sampling:
        return Sampling(options, budget, eos_id, masks)
    if options.constraints:
        return ConstrainedBeamSearch(options, budget, eos_id, len(forced), masks, favoured, continues)
    return BeamSearch(options, budget, eos_id, len(forced), masks, favoured)


def constrained_beam(options: DecodingOptions, constraints: tuple[tuple[int, ...], ...]) -> DecodingOptions:
    """The options of a sentence whose hypotheses must contain `constraints` (token sequences): beam search, as
    wide as the options say and at least one beam more than the constraints' tokens (a beam per bank:
    ConstrainedBeamSearch). No constraints: the options as they are."""
    if not constraints:
        return options
    return replace(options, constraints=constraints,
                   beam_size=max(options.beam_size, sum(len(c) for c in constraints) + 1))


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    prefix = seqs[0]
    for s in seqs[1:]:
        n = 0
        while n < min(len(prefix), len(s)) and prefix[n] == s[n]:
            n += 1
        prefix = prefix[:n]
    return prefix
