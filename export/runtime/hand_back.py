"""Results handed back while a continuous burst goes on (the server's engines, export/runtime/engine.py).

A continuous burst of greedy steps runs in nmtserve's library through row ends (native.Continuing): a row that
finishes stays in place until the burst ends, which is when newcomers may join. Its request need not wait for that:
after each step in which a row finishes, the library writes a byte to a pipe, and the engine's hand-back thread, which
sleeps on the pipe without the GIL, hands those requests their tokens and finishes them while the library steps on.
The engine thread takes the GIL once a burst instead of once a step, and a client waits for its own request only.

A `Burst` hands each request's result out once: the finished ones to the hand-back thread as the run goes on
(`finished`), the rest to the engine thread when it ends (`close`); requests that asked for attention wait for the
engine thread (one aligner call for them all)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from nmtserve.export.runtime.native import Continuing
from nmtserve.export.runtime.request import FinishReason, Request

log = logging.getLogger("nmtserve.engine")
Result = tuple[Request, list[int], float, "FinishReason | None"]  # the tokens a request gained, their log-probs' sum


def gained(tokens: list[int], values: list[float] | None, took: int, eos: bool) -> tuple[list[int], float]:
    """A row's tokens and the sum of their log-probs (nan when unscored) after `took` steps; eos is not a token."""
    return tokens[:took - 1] if eos else tokens[:took], math.nan if values is None else sum(values[:took])


def first_step_end(started: float, steps: int) -> float:
    """When the first of a library run's `steps` steps, begun at `started`, ended: the library does not time each
    step, and a run's steps take alike, so the time so far over the steps taken."""
    return started + (time.monotonic() - started) / max(1, steps)


class Burst:
    """The results of one continuous burst: `requests`, each at its row `rows[i]` of `continuing.out` (the library's
    outputs: tokens and scores a step, each row's last step, whether on eos)."""

    def __init__(self, requests: list[Request], rows: list[int], continuing: Continuing):
        self.requests, self.rows, self.continuing = requests, np.array(rows), continuing
        self.taken = np.array([r.attention for r in requests], bool)  # handed out, or left to the engine thread
        self.handed: list[Request] = []
        self.started = time.monotonic()  # as the library's first step begins
        self.lock = threading.Lock()  # held while results are handed out: `close` waits for them
        self.closed = False

    def finished(self, deliver: Callable[[list[Result], float], None]) -> None:
        """(The hand-back thread) deliver the results of the requests whose rows have finished, not yet taken, with
        when the burst's first step ended."""
        with self.lock:
            if self.closed or self.continuing.out is None:
                return
            steps = int(self.continuing.progress[0])
            tokens, values, end, by_eos = self.continuing.out
            ends = end[self.rows]
            ready = np.flatnonzero((ends >= 0) & (ends < steps) & ~self.taken)
            self.taken[ready] = True
            results = []
            for i, row, at in zip(ready.tolist(), self.rows[ready].tolist(), ends[ready].tolist()):
                eos = bool(by_eos[row])
                own, total = gained(tokens[:at + 1, row].tolist(), None if values is None else
                                    values[:at + 1, row].tolist(), at + 1, eos)
                results.append((self.requests[i], own, total, FinishReason.EOS if eos else FinishReason.LENGTH))
            if results:
                self.handed += [r for r, *_ in results]
                deliver(results, first_step_end(self.started, steps))

    def close(self) -> set[int]:
        """(The engine thread, once the run has ended) the ids of the requests handed out; no more will be."""
        with self.lock:
            self.closed = True
            return {id(r) for r in self.handed}


class HandBack:
    """An engine's hand-back thread and its pipe: `deliver` takes the finished requests' results there."""

    def __init__(self, deliver: Callable[[list[Result], float], None]):
        self.deliver = deliver
        self.read_fd, self.fd = os.pipe()
        os.set_blocking(self.fd, False)  # the library never waits on a full pipe: the reader wakes anyway
        self.burst: Burst | None = None
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name="nmtserve-hand-back", daemon=True)

    def start(self) -> HandBack:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.closing:
            return
        self.closing = True
        try:
            os.write(self.fd, b"\0")
        except BlockingIOError:  # a full pipe wakes it as well
            pass
        self.thread.join()
        os.close(self.read_fd)
        os.close(self.fd)

    def _loop(self) -> None:
        while True:
            os.read(self.read_fd, 4096)  # without the GIL, until the library (or stop) writes
            if self.closing:
                return
            burst = self.burst
            if burst is not None:
                try:
                    burst.finished(self.deliver)
                except Exception:  # a failing callback must not end the thread that hands every result back
                    log.exception("handing back results")
