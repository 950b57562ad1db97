"""Continuous (iteration-level) batching over a bundle's ONNX Runtime sessions. Protobuf-free.

One scheduler thread owns the waiting queue and the running batch. Each iteration has three
phases: schedule (drop cancelled or expired requests, admit waiting ones within the budgets),
execute (encode the newcomers once, merge them into the running batch, one decoder step for
every row), process outputs (hand each row its token, finish rows at eos or their budget).
Requests join and leave between steps; no row ever waits for another to finish. A finished row
stays as a hole that the next newcomer fills, so under steady load no step copies the KV cache;
holes are compacted away once they are a quarter of the batch.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from export.translator import OnnxTranslator
from nmtserve.decoding import output_budget
from nmtserve.errors import NmtserveError
from export.batch import BatchState


class EngineOverloaded(NmtserveError):
    """The waiting queue is full: refused at once rather than left to time out."""


class EngineStopped(NmtserveError):
    """The engine no longer takes requests (shutting down)."""


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


@dataclass
class EngineConfig:
    max_running_rows: int = 64
    max_batch_tokens: int = 16384  # Σ over running rows of source tokens + output budget
    max_waiting: int = 256
    max_decoding_length: int = 256
    batching: str = "continuous"  # or "static": admit only into an empty batch, run it to completion


@dataclass
class Request:
    """One sentence to translate; the engine fills tokens, score and finish, then sets `done`."""

    src_ids: list[int]
    max_decoding_length: int = 256
    batching: str = "continuous"  # or "static": admit only into an empty batch, run it to completion
    deadline: float | None = None  # time.monotonic() after which the request is dropped
    on_token: Callable[["Request", int], None] | None = None  # called from the engine thread
    on_finish: Callable[["Request"], None] | None = None  # called from the engine thread, once
    id: str = ""
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    finish: FinishReason | None = None
    error: str | None = None
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next iteration."""
        self.cancelled = True

    def cost(self, max_len: int) -> int:
        return len(self.src_ids) + output_budget(len(self.src_ids), self.max_decoding_length, max_len)


class Engine:
    """Owns the translator's sessions, the waiting queue and the running batch."""

    def __init__(self, translator: OnnxTranslator, config: EngineConfig | None = None,
                 on_step: Callable[[int, int, float], None] | None = None):
        self.tr = translator
        self.config = config or EngineConfig()
        if self.config.batching not in ("continuous", "static"):
            raise ValueError(f"batching {self.config.batching!r}: choose continuous or static")
        self.on_step = on_step  # (rows, valid cache slots, seconds) after every iteration
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = []  # one per batch row; None is a hole
        self.batch: BatchState | None = None
        self.lock = threading.Condition()
        self.stopping = False
        self.ids = itertools.count()
        self.steps = 0
        self.thread = threading.Thread(target=self._loop, name="nmtserve-engine", daemon=True)

    # -- life cycle
    def start(self) -> "Engine":
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.thread.join()

    # -- requests
    def submit(self, request: Request) -> Request:
        """Queue a request; EngineOverloaded at once when the waiting queue is full."""
        with self.lock:
            if self.stopping:
                raise EngineStopped("the engine is shutting down")
            if len(self.waiting) >= self.config.max_waiting:
                raise EngineOverloaded(f"waiting queue full ({self.config.max_waiting} requests)")
            request.id = request.id or f"r{next(self.ids)}"
            self.waiting.append(request)
            self.lock.notify()
        return request

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def stats(self) -> dict:
        with self.lock:
            return {"waiting": len(self.waiting), "running": len(self.running), "steps": self.steps}

    # -- the loop
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.waiting and not self.running and not self.stopping:
                    self.lock.wait()
                if self.stopping and not self.waiting and not self.running:
                    return
                admitted = self._schedule()
            started = time.perf_counter()
            try:
                stepped = self._execute(admitted)
                if self.on_step and stepped:
                    self.on_step(*stepped, time.perf_counter() - started)
            except Exception as e:  # an engine error fails the requests it touched, not the engine
                placed = {id(r) for r in self.slots}
                failed = self.running + [r for r in admitted if id(r) not in placed]
                with self.lock:
                    self.slots, self.batch = [], None
                for request in failed:
                    self._finish(request, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")

    def _schedule(self) -> list[Request]:
        """Drop cancelled/expired rows and waiting requests; admit waiting ones within the budgets."""
        now = time.monotonic()
        for request in list(self.waiting):
            reason = self._dropped(request, now)
            if reason:
                self.waiting.remove(request)
                self._finish(request, reason)
        leaving = [(i, r, self._dropped(r, now)) for i, r in enumerate(self.slots) if r is not None]
        leaving = [(i, r, why) for i, r, why in leaving if why]
        self._free([i for i, _, _ in leaving])  # rows are freed before anyone is told
        for _, request, why in leaving:
            self._finish(request, why)
        if self.config.batching == "static" and self.running:
            return []  # static batching: the running batch finishes before anyone joins
        budget = self.config.max_batch_tokens - sum(r.cost(self.tr.max_len) for r in self.running)
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.config.max_running_rows:
            cost = self.waiting[0].cost(self.tr.max_len)
            if cost > budget and (self.running or admitted):
                break  # an oversized request still runs alone rather than never
            request = self.waiting.popleft()
            request.admitted = now
            budget -= cost
            admitted.append(request)
        return admitted

    @staticmethod
    def _dropped(request: Request, now: float) -> FinishReason | None:
        if request.cancelled:
            return FinishReason.CANCELLED
        if request.deadline is not None and now >= request.deadline:
            return FinishReason.DEADLINE
        return None

    def _execute(self, admitted: list[Request]) -> tuple[int, int] | None:
        """Merge newcomers, run one decoder step, process its tokens -> (rows, valid cache slots)."""
        if admitted:
            fresh = self.tr.start([r.src_ids for r in admitted])  # encoded once, on the translator's device
            holes = [i for i, r in enumerate(self.slots) if r is None][: len(admitted)]
            if holes:  # newcomers take the holes first: no copy of the running cache
                self.batch.insert(holes, fresh.take(np.arange(len(holes))) if len(holes) < fresh.size else fresh)
            with self.lock:
                for i, request in zip(holes, admitted):
                    self.slots[i] = request
            if len(admitted) > len(holes):
                rest = fresh.take(np.arange(len(holes), fresh.size)) if holes else fresh
                self.batch = rest if self.batch is None else self.batch.concatenate(rest)
                with self.lock:
                    self.slots.extend(admitted[len(holes):])
        self._compact()
        if self.batch is None:
            return None
        b = self.batch
        b.trim()
        # the whole buffer goes in (slots past `length` are invalid): per-layer views stay contiguous
        tokens, scores, new_k, new_v = self.tr.decode(b)
        b.append(new_k, new_v, tokens)
        self.steps += 1
        stepped = b.size, int(b.valid.sum())
        self._process(tokens, scores)
        return stepped

    def _process(self, tokens: np.ndarray, scores: np.ndarray) -> None:
        now = time.monotonic()
        leaving = []
        for i, (request, token, score) in enumerate(zip(self.slots, tokens, scores)):
            if request is None:
                continue  # a hole: its output means nothing
            request.score += float(score)
            request.first_token = request.first_token or now
            if token == self.tr.eos_id:
                leaving.append((i, request, FinishReason.EOS))
                continue
            request.tokens.append(int(token))
            if request.on_token:
                request.on_token(request, int(token))
            if len(request.tokens) >= output_budget(len(request.src_ids), request.max_decoding_length, self.tr.max_len):
                leaving.append((i, request, FinishReason.LENGTH))
        self._free([i for i, _, _ in leaving])
        for _, request, why in leaving:
            self._finish(request, why)

    def _free(self, rows: list[int]) -> None:
        """Finished rows become holes; an all-hole batch is dropped."""
        if not rows:
            return
        with self.lock:
            for i in rows:
                self.slots[i] = None
            if not any(r is not None for r in self.slots):
                self.slots, self.batch = [], None
            else:
                self.batch.free(rows)

    def _compact(self) -> None:
        """Remove holes once they are a quarter of the batch (a copy; newcomers usually fill them first)."""
        holes = sum(r is None for r in self.slots)
        if holes and holes * 4 >= len(self.slots):
            keep = np.array([r is not None for r in self.slots])
            with self.lock:
                self.batch = self.batch.filter(keep)
                self.slots = [r for r in self.slots if r is not None]

    @staticmethod
    def _finish(request: Request, reason: FinishReason, error: str | None = None) -> None:
        if request.done.is_set():
            return
        request.finish, request.error, request.finished = reason, error, time.monotonic()
        request.done.set()
        if request.on_finish:
            request.on_finish(request)
