"""The running decoder batch: which request sits in which row, the holes, and the decoder state
those rows share (export/runtime/batch.py's BatchState, whose tensors the translator owns).

The engine decides who joins and who leaves; RunningBatch keeps rows and state in step. A request
takes `request.width` rows: one when greedy or sampled, beam_size for beam search, all holding a copy
of its source's cross-attention K/V (encoded once). A finished request's rows stay in place as holes
(None) that the next newcomers fill, so under steady load no step copies the KV cache; `compact`
removes holes once they are a quarter of the batch, on the host by moving only the rows past the kept
count into them, and newcomers beyond the holes are written into the room the buffers keep past the
rows (`room`, BatchState.append): a running row is copied only when the buffers must grow. Greedy,
beam and sampled requests share every decoder step: the step returns each row's best candidates (as
many as the most demanding request needs; a request sampling the whole vocabulary gets its row's
log-probs, unranked, and draws from them itself, so it does not make every row rank the vocabulary), a
greedy request takes its row's best, and a beam or sampled request's search (nmtserve/search.py) takes
its own rows' candidates and says which of its rows each continues (the beams of one size ranked at
once, `search.beam_steps`, as offline); a row that continues another of its beam points at that row's
cache slots (BatchState.origin, on nmtserve's kernels; else its cache rows are copied), among its own
rows only, and only when a parent changes. K/V never leave this object and the translator.

Blast radius of one: when the encoder fails for a group of newcomers, or the decoder step fails,
the rows are bisected (the decoder on copies of the state) until the ones that fail on their own
are found; only those requests fail, and everyone else's step is run again without them.

Only the engine thread touches a RunningBatch.
"""

from __future__ import annotations

import math
import time

import numpy as np

from nmtserve.export.runtime.batch import BatchState
from nmtserve.export.runtime.decoder import Decoder
from nmtserve.export.runtime.hand_back import Burst, HandBack, gained
from nmtserve.export.runtime.native import Continuing
from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.search import BeamSearch, beam_steps

FINISHED = (None, FinishReason.EOS, FinishReason.LENGTH)  # by the step's finish code (Decoder._finish_codes)


class RunningBatch:
    def __init__(self, translator: Decoder, room: int = 0, reserve: bool = True):
        self.tr = translator
        self.room = room  # the most rows the state's buffers make room for when newcomers outgrow them (append)
        # the cache holds the running requests' longest budget from their admission (`slots`), so that no newcomer's
        # row copies it as it fills it (continuous batching); without, a static batch's cache doubles as it fills,
        # which steps faster while it is small
        self.reserve = reserve
        self.rows: list[Request | None] = []  # rows[i] is row i of `state`; None is a hole
        self.state: BatchState | None = None  # None when no request runs
        self._placement: list[tuple[Request, np.ndarray]] | None = None  # placement(), until rows change
        self._slots = 0  # the cache slots the running requests' budgets may fill (placement() works it out)
        self._ahead: list[tuple[list[Request], BatchState]] = []  # groups encoded ahead of their admission (admit)

    @property
    def requests(self) -> list[Request]:
        """Each running request once, in row order."""
        return [r for r, _ in self.placement()]

    def placement(self) -> list[tuple[Request, np.ndarray]]:
        """Each running request with its rows (ascending: row j of a beam is its j-th row); kept until
        admit, leave, compact or clear changes the rows (the engine asks several times a step)."""
        if self._placement is None:
            rows: dict[int, tuple[Request, list[int]]] = {}
            for i, r in enumerate(self.rows):
                if r is not None:
                    rows.setdefault(id(r), (r, []))[1].append(i)
            self._placement = [(r, np.array(found)) for r, found in rows.values()]
            self._slots = max((len(r.prefix) + r.budget(self.tr.limits) + 1 for r, _ in self._placement), default=0)
        return self._placement

    def slots(self) -> int:
        """The cache slots the running requests may fill (their largest budget, and one): the state keeps
        them (`reserve` once they join, when the batch reserves; `trim` never below, nor below a fresh state's), so
        no row copies the cache as it fills it."""
        self.placement()
        return self._slots

    def admit(self, requests: list[Request], ahead: list[list[Request]] = (), narrow: bool = False) \
            -> list[tuple[Request, Exception]]:
        """Encode the newcomers once and place their rows: into holes first (no copy of the running
        cache), the rest appended as new rows. `ahead`: groups of requests that later admissions will take as they
        are (static batching), encoded in the same encoder call and kept until then (on the host, without forced
        prefixes). narrow: one row per request, whatever its width (a batch for `search_run`, which widens it after
        the first step). Returns the newcomers the encoder fails on, with the error."""
        # on the host the rows go into the running state's buffers, which take only their cross K/V: no caches
        caches = self.state is None or not self.state.ops.views
        try:
            if self._ahead and len(self._ahead[0][0]) == len(requests) \
                    and all(a is b for a, b in zip(self._ahead[0][0], requests)):
                fresh = self._ahead.pop(0)[1]
            elif ahead and caches and self.tr.ops.views and not any(r.prefix for g in [requests, *ahead] for r in g):
                fresh = self._encode_ahead([requests, *ahead])
            else:
                fresh = self.tr.prefill([r.src_ids for r in requests], caches, [r.prefix for r in requests])
        except Exception as e:
            if len(requests) == 1:
                return [(requests[0], e)]
            half = len(requests) // 2
            return self.admit(requests[:half], narrow=narrow) + self.admit(requests[half:], narrow=narrow)
        encoded = time.monotonic()
        for request in requests:
            request.encoded = encoded
        owners = requests if narrow else [r for r in requests for _ in range(r.width)]
        self._placement = None
        if len(owners) > len(requests):  # a beam's rows share its source
            fresh = fresh.gather(np.repeat(np.arange(len(requests)), [r.width for r in requests]))
        holes = [i for i, r in enumerate(self.rows) if r is None][: len(owners)]
        if holes:
            self.state.insert(holes, fresh)  # its first rows
            for i, request in zip(holes, owners):
                self.rows[i] = request
        if len(owners) > len(holes):  # the rest
            self.state = fresh if self.state is None else self.state.append(fresh, self.room, len(holes))
            self.rows.extend(owners[len(holes):])
        if self.reserve and not narrow:
            self.state.reserve(self.slots())
        return []

    def _encode_ahead(self, groups: list[list[Request]]) -> BatchState:
        """Fresh rows for the first group, from one encoder call for all the groups; the others' rows (each a view of
        its rows of the call's cross K/V) are kept for their admissions (`_ahead`)."""
        whole = self.tr.prefill([r.src_ids for group in groups for r in group], caches=False)
        states, start = [], 0
        for group in groups:
            rows = slice(start, start + len(group))
            start = rows.stop
            states.append(BatchState.from_encoded(whole.cross_k[:, rows], whole.cross_v[:, rows], whole.cross_eos[:, rows],
                                                  whole.src_mask[rows], self.tr.bos_id, origin=self.tr.cache_origin))
        self._ahead = list(zip(groups[1:], states[1:]))
        return states[0]

    def leave(self, requests: list[Request]) -> None:
        """The requests' rows become holes; a batch of holes only is dropped."""
        gone = {id(r) for r in requests}
        rows = [i for i, r in enumerate(self.rows) if r is not None and id(r) in gone]
        if not rows:
            return
        self._placement = None
        for i in rows:
            self.rows[i] = None
        if any(r is not None for r in self.rows):
            self.state.free(rows)
        else:
            self.clear()

    def compact(self) -> None:
        """Remove the holes once they are a quarter of the batch. On the host in place (BatchState.relocate):
        the requests with a row at or past the kept count move, whole and in order, into the first places that
        the others do not hold, and only their rows are copied; the buffers keep the room past them for
        newcomers (`admit`). On a device every kept row is copied (`filter`: an OrtValue is not a view)."""
        holes = sum(r is None for r in self.rows)
        if not holes or holes * 4 < len(self.rows):
            return
        self._placement = None
        if not self.state.ops.views:
            self.state = self.state.filter(np.array([r is not None for r in self.rows]))
            self.rows = [r for r in self.rows if r is not None]
            return
        n = len(self.rows) - holes
        moving = {id(r) for r in self.rows[n:] if r is not None}
        movers = [i for i, r in enumerate(self.rows) if r is not None and id(r) in moving]
        sources = np.arange(n)
        sources[[i for i, r in enumerate(self.rows[:n]) if r is None or id(r) in moving]] = movers
        self.state = self.state.relocate(sources)
        self.rows = [self.rows[i] for i in sources]

    def step(self) -> tuple[list[tuple[Request, int | None, float | None, FinishReason | None]],
                            list[tuple[Request, Exception]]]:
        """One decoder step of every row -> (request, token, log-prob, how it finished: None, it runs on) of each
        greedy request, (request, None, None, None) of each beam or sampled request once its search has taken its
        rows' candidates (the search says when it is done); and
        the requests whose rows fail the step on their own (they leave, with the error). When no row
        fails alone, the error is the batch's and is raised."""
        self.state.trim(self.slots())
        placement = self.placement()
        # a search that ranks the vocabulary itself (candidates 0: a sampler without top-k, disabled tokens or a
        # repetition penalty: logits.TokenMasks) gets its rows' logits over the whole vocabulary, unranked; the step
        # ranks only the k best of each other row, as the others need
        whole = [i for i, (r, _) in enumerate(placement) if r.search is not None and r.search.candidates == 0]
        k = max([r.search.candidates if r.search else 1 for r, _ in placement] + [1])
        # greedy rows that no one reads a score of: the step skips the log-softmax (with_search_head)
        scored = any(r.scored or r.search is not None for r, _ in placement)
        try:
            ids, scores, *vocabulary, finish = self.tr.decode_candidates(
                self.state, k, scores=scored, whole=np.concatenate([placement[i][1] for i in whole]) if whole else None,
                budget=self._budget(placement))
        except Exception:
            culprits = self._failing_rows([i for i, r in enumerate(self.rows) if r is not None])
            if not culprits:
                raise
            failed = list({id(self.rows[i]): (self.rows[i], e) for i, e in culprits}.values())
            self.leave([r for r, _ in failed])
            if self.state is None:
                return [], failed
            outputs, more = self.step()  # everyone else's step, without them
            return outputs, failed + more
        tokens, parents = ids[:, 0].copy(), None  # holes keep theirs: never read
        # Python numbers, once
        best, best_scores, finish = tokens.tolist(), scores[:, 0].tolist() if scored else None, finish.tolist()
        outputs, whole_logits = [], {}  # by placement index: each request's rows' logits over the vocabulary
        if whole:
            ends = np.cumsum([len(placement[i][1]) for i in whole])
            whole_logits = dict(zip(whole, np.split(vocabulary[0], ends[:-1])))
        beams: dict[int, list[tuple[BeamSearch, np.ndarray]]] = {}  # beam size -> its searches and their rows
        for j, (request, rows) in enumerate(placement):
            if request.search is None:
                row = int(rows[0])
                outputs.append((request, best[row], best_scores[row] if scored else math.nan, FINISHED[finish[row]]))
                continue
            outputs.append((request, None, None, None))
            parents = np.arange(len(self.rows)) if parents is None else parents
            if isinstance(request.search, BeamSearch) and j not in whole_logits:
                beams.setdefault(request.search.k, []).append((request.search, rows))
                continue
            own = (None, whole_logits[j]) if j in whole_logits else (ids[rows], scores[rows])
            chosen_parents, chosen = request.search.step(*own, self.tr.ranker.rank) \
                if isinstance(request.search, BeamSearch) else request.search.step(*own)
            parents[rows], tokens[rows] = rows[chosen_parents], chosen
        for searches in beams.values():  # the beams of one size ranked at once (search.beam_steps), their rows gathered
            rows = np.concatenate([rows for _, rows in searches])
            chosen_parents, chosen = beam_steps([search for search, _ in searches], ids[rows], scores[rows],
                                                self.tr.ranker.rank)
            parents[rows], tokens[rows] = rows[chosen_parents], chosen
        self.state.choose(tokens, parents)  # parents: only when a search chose them
        return outputs, []

    def greedy_run(self, stop_at: float = 0.0, occupancy: bool = True, steps: int = 0,
                   continuing: Continuing | None = None, hand_back: HandBack | None = None) \
            -> tuple[list[tuple[Request, list[int], float, FinishReason | None]], list[tuple[int, int]]]:
        """A batch of greedy requests (one row each) decoded in nmtserve's library, with no Python between steps,
        until each request has finished (eos or its budget), the cache's end, or a step past `stop_at`: the finished
        rows leave the batch there (translator.decode_greedy_run; no holes). With `steps`, the server's burst: up to
        that many steps, until the first step in which a request finishes; no row moves, and the
        caller lets the finished ones leave (translator.decode_greedy_steps) -> each request with the tokens it
        gained (eos excluded), the sum of their log-probs (nan when no row is scored) and how it finished (None: it
        runs on); and each step's (rows, valid cache slots) (without occupancy, (0, 0) a step). Raises what the
        library's first step raises; the caller then takes one step with `step`, which finds the rows that fail.
        With `continuing`, a continuous burst (native.Continuing: through row ends, until newcomers may join), whose
        finished requests `hand_back` hands out as it goes on (hand_back.py): those leave here, and are left out of
        the results."""
        self.state.trim(self.slots())
        placement = self.placement()
        requests = [r for r, _ in placement]  # in row order
        columns = [int(own[0]) for _, own in placement]  # each request's row
        rows = columns if self.state.holes else slice(None)  # a slice without holes: the arrays below are views
        scored = any(r.scored for r in requests)
        start, budget = self.state.positions[rows].copy(), self._budget(placement)
        handed: set[int] = set()
        if continuing is not None:
            burst = Burst(requests, columns, continuing)
            if continuing.fd >= 0:
                hand_back.burst = burst
            try:
                tokens, scores, end, by_eos = self.tr.decode_greedy_steps(self.state, steps, budget, scored, stop_at,
                                                                          continuing)
            finally:
                if continuing.fd >= 0:
                    hand_back.burst = None
                handed = burst.close()
        elif steps:
            tokens, scores, end, by_eos = self.tr.decode_greedy_steps(self.state, steps, budget, scored, stop_at)
        else:  # a whole run: the rows left and their state, taken once the results are out
            state, left, tokens, scores, end, by_eos = self.tr.decode_greedy_run(self.state, budget, scored, stop_at)
        taken, end = len(tokens), end[rows]
        ended = np.where(end < 0, taken, end + 1)  # the steps each request took
        values = scores[:, rows].T.tolist() if scored else [None] * len(requests)  # Python numbers, once
        outputs = []
        for request, own, own_values, took, at, eos in zip(requests, tokens[:, rows].T.tolist(), values,
                                                           ended.tolist(), end.tolist(), by_eos[rows].tolist()):
            if id(request) in handed:
                continue
            finish = None if at < 0 else FinishReason.EOS if eos else FinishReason.LENGTH
            outputs.append((request, *gained(own, own_values, took, eos), finish))  # eos's log-prob in the sum
        stepped = [(0, 0)] * taken
        if occupancy:
            running = ended[None, :] > np.arange(taken)[:, None]  # (steps, requests): whom each step ran
            stepped = list(zip(running.sum(axis=1).tolist(), ((start[None, :] + np.arange(1, taken + 1)[:, None])
                                                              * running).sum(axis=1).tolist()))
        if handed:
            self.leave([r for r in requests if id(r) in handed])
        if steps or continuing is not None:
            return outputs, stepped
        self._placement = None
        if state is None:
            self.clear()
        else:
            self.state, self.rows = state, [self.rows[i] for i in left.tolist()]
        return outputs, stepped

    def search_run(self) -> list[Request]:
        """A fresh batch of beam searches or samplings of one kind, admitted one row each (`admit`'s narrow), run
        until every search is done (translator.decode_search_run) -> its requests, whose searches hold the
        results; the batch is then empty."""
        requests = [r for r, _ in self.placement()]
        self.tr.decode_search_run(self.state, [r.search for r in requests])
        self.clear()
        return requests

    def _budget(self, placement: list[tuple[Request, np.ndarray]]) -> np.ndarray:
        """Each row's budget for the step's stopping rule (step_graphs.with_stop_rule): a greedy request's row
        stops at the position where the request has all the tokens its budget allows (the other rows' finish codes
        are never read)."""
        budget = self.state.positions.copy()
        greedy = [(int(rows[0]), r.budget(self.tr.limits) - len(r.tokens)) for r, rows in placement if r.search is None]
        if greedy:
            at, left = zip(*greedy)
            budget[list(at)] += left
        return budget

    def _failing_rows(self, rows: list[int]) -> list[tuple[int, Exception]]:
        """The rows whose step fails on a copy of the state holding just them, found by bisection."""
        try:
            self.tr.decode_one_token(self.state.take(np.array(rows)))
            return []
        except Exception as e:
            if len(rows) == 1:
                return [(rows[0], e)]
            half = len(rows) // 2
            return self._failing_rows(rows[:half]) + self._failing_rows(rows[half:])

    def cache_slots(self) -> int:
        """Self-attention cache slots the rows have filled (what the next step attends over, less its own)."""
        return int(self.state.positions.sum()) if self.state is not None else 0

    def clear(self) -> None:
        """No running rows; what was encoded ahead is kept."""
        self.rows, self.state, self._placement = [], None, None
