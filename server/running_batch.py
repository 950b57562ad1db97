"""The running decoder batch: which request sits in which row, the holes, and the decoder state
those rows share (export/runtime/batch.py's BatchState, whose tensors the translator owns).

The engine decides who joins and who leaves; RunningBatch keeps rows and state in step. A finished
row stays in place as a hole (None) that the next newcomer fills, so under steady load no step
copies the KV cache; `compact` removes holes once they are a quarter of the batch. K/V never
leave this object and the translator: a step hands back one token and log-prob per request.

Blast radius of one: when the encoder fails for a group of newcomers, or the decoder step fails,
the rows are bisected (the decoder on copies of the state) until the ones that fail on their own
are found; only those requests fail, and everyone else's step is run again without them.

Only the engine thread touches a RunningBatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nmtserve.export.runtime.batch import BatchState
from nmtserve.export.runtime.translator import OnnxTranslator

if TYPE_CHECKING:
    from nmtserve.server.engine import Request


class RunningBatch:
    def __init__(self, translator: OnnxTranslator):
        self.tr = translator
        self.rows: list[Request | None] = []  # rows[i] is row i of `state`; None is a hole
        self.state: BatchState | None = None  # None when no request runs

    @property
    def requests(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def admit(self, requests: list[Request]) -> list[tuple[Request, Exception]]:
        """Encode the newcomers once and place them: into holes first (no copy of the running cache),
        the rest appended as new rows. Returns the newcomers the encoder fails on, with the error."""
        try:
            fresh = self.tr.prefill([r.src_ids for r in requests])
        except Exception as e:
            if len(requests) == 1:
                return [(requests[0], e)]
            half = len(requests) // 2
            return self.admit(requests[:half]) + self.admit(requests[half:])
        holes = [i for i, r in enumerate(self.rows) if r is None][: len(requests)]
        if holes:
            self.state.insert(holes, fresh.take(np.arange(len(holes))) if len(holes) < fresh.size else fresh)
            for i, request in zip(holes, requests):
                self.rows[i] = request
        if len(requests) > len(holes):
            rest = fresh.take(np.arange(len(holes), fresh.size)) if holes else fresh
            self.state = rest if self.state is None else self.state.concatenate(rest)
            self.rows.extend(requests[len(holes):])
        return []

    def free(self, rows: list[int]) -> None:
        """These rows become holes; a batch of holes only is dropped."""
        if not rows:
            return
        for i in rows:
            self.rows[i] = None
        if self.requests:
            self.state.free(rows)
        else:
            self.clear()

    def compact(self) -> None:
        """Remove the holes once they are a quarter of the batch (a copy, amortised)."""
        holes = sum(r is None for r in self.rows)
        if holes and holes * 4 >= len(self.rows):
            self.state = self.state.filter(np.array([r is not None for r in self.rows]))
            self.rows = self.requests

    def step(self) -> tuple[list[tuple[int, Request, int, float]], list[tuple[Request, Exception]]]:
        """One decoder step of every row -> (row, request, token, log-prob) for each request (holes
        skipped), and the requests whose rows fail the step on their own (freed, with the error). When
        no row fails alone, the error is the batch's and is raised."""
        self.state.trim()
        try:
            tokens, scores = self.tr.decode_one_token(self.state)
        except Exception:
            culprits = self._failing_rows([i for i, r in enumerate(self.rows) if r is not None])
            if not culprits:
                raise
            failed = [(self.rows[i], e) for i, e in culprits]
            self.free([i for i, _ in culprits])
            if self.state is None:
                return [], failed
            outputs, more = self.step()  # everyone else's step, without them
            return outputs, failed + more
        outputs = [(i, r, int(t), float(s)) for i, (r, t, s) in enumerate(zip(self.rows, tokens, scores))
                   if r is not None]
        return outputs, []

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
        """Valid self-attention cache slots over all rows (what the last step attended over)."""
        return int(self.state.valid.sum()) if self.state is not None else 0

    def clear(self) -> None:
        self.rows, self.state = [], None
