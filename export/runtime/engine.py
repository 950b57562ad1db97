"""Continuous (iteration-level) batching over a bundle's ONNX Runtime sessions. Protobuf-free.

One scheduler thread owns the waiting queue and the running batch (export/runtime/running_batch.py).
Each iteration has three phases: schedule (drop cancelled or expired requests, admit waiting ones
within the budgets), execute (the newcomers join the running batch, one decoder step for every
row; when every running request is greedy and none streams, up to max_burst_steps steps in nmtserve's
library at once, with no Python between them, through the rows' ends until newcomers may join, each request
handed back by the hand-back thread as its row finishes: hand_back.py), process outputs (hand each request its
token, finish requests at eos or their budget).
Requests join and leave between steps; no row ever waits for another to finish. A request is decoded greedily,
by beam search (beam_size rows) or by sampling, as its DecodingOptions say; all three share each decoder step,
and a request's result depends on its own rows only. The engine never sees K/V: the running batch and the
translator keep them.

A static batch of greedy requests none of which streams runs to its end at once, in the library where it runs
(`WHOLE`). The offline translator drives this same engine in its own thread (`Engine.run`): static batches, the
next ones encoded ahead, a batch of like beam searches or samplings run whole (`EngineConfig.whole_searches`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

from nmtserve.errors import NmtserveError
from nmtserve.export.runtime.decoder import Decoder
from nmtserve.export.runtime.hand_back import HandBack, first_step_end
from nmtserve.export.runtime.memory import LIBC, release_free_memory
from nmtserve.export.runtime.native import Continuing
from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.export.runtime.running_batch import RunningBatch
from nmtserve.search import make_search

WHOLE = -1  # Engine._burst: a static batch runs to its end at once (greedy_run, or search_run for searches)
CONTINUE = -2  # Engine._burst: a continuous burst, through row ends until newcomers may join (native.Continuing)
TRIM_SECONDS = 5.0  # how often a busy engine gives the C heap's free pages back (release_free_memory)


@dataclasses.dataclass
class EngineConfig:
    """Each engine's running batch: its budgets and how newcomers join it."""
    max_running_rows: int = 64  # a beam search takes beam_size rows
    max_batch_tokens: int = 16384  # Σ over running rows of source tokens + output budget
    max_waiting: int = 256
    batching: str = "continuous"  # or "static": admit only into an empty batch, run it to completion
    # continuous batching: newcomers join a running batch once `admit_rows` of their rows wait and are free
    # (at most a quarter of max_running_rows), or once `admit_steps` decoder steps have passed since the
    # latest admission (text-generation-inference's max_waiting_tokens): a group is encoded in one call;
    # a batch of fewer than half `admit_rows` rows takes them at once
    admit_rows: int = 16
    admit_steps: int = 8
    # a batch of greedy requests steps in nmtserve's library (Decoder.native_steps); when none streams, up to this
    # many steps at once with no Python between them, through the rows' ends until newcomers may join (a continuous
    # burst: each request is handed back as its row finishes, hand_back.py); 1: one step an iteration
    max_burst_steps: int = 16
    # static batching: an admission also encodes the groups the next admissions will take, up to this many
    # requests in all, in the same encoder call (the offline translator's; a call's fixed cost paid once)
    encode_ahead: int = 0
    # static batching: a batch of beam searches or samplings of one kind, none streaming, runs to its end in one
    # call (Decoder.decode_search_run; the offline translator's), where an error fails the whole batch
    whole_searches: bool = False


class EngineOverloaded(NmtserveError):
    """The waiting queue is full: refused at once rather than left to time out."""


class EngineStopped(NmtserveError):
    """The engine no longer takes requests (shutting down)."""


class Engine:
    """Owns the waiting queue, the budgets and the loop over the running batch."""

    def __init__(self, translator: Decoder, config: EngineConfig | None = None,
                 on_step: Callable[[int, int, float], None] | None = None):
        self.tr = translator
        self.config = config or EngineConfig()
        if self.config.batching not in ("continuous", "static"):
            raise ValueError(f"batching {self.config.batching!r}: choose continuous or static")
        self.on_step = on_step  # (rows, valid cache slots, seconds) after every iteration
        # `lock` guards `waiting`, `stopping` and `running_count`, and the loop sleeps on it for work.
        # `batch` belongs to the engine thread alone; other threads read `running_count`, which the
        # engine thread sets under the lock whenever requests join or leave the batch.
        self.lock = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()
        self.stopping = False
        self.running_count = 0
        self.batch = RunningBatch(translator, room=self.config.max_running_rows,
                                  reserve=self.config.batching == "continuous")
        self.ids = itertools.count()
        self.steps = 0
        self.admitted_step = 0  # the step count at the latest admission (EngineConfig.admit_steps)
        self.admissions = 0  # groups admitted (each one encoder call), since the start
        self.ahead: list[list[Request]] = []  # groups the next admissions will take (EngineConfig.encode_ahead)
        self.next_trim = time.monotonic() + TRIM_SECONDS
        self.waiting_count = np.zeros(1, np.int32)  # len(waiting), for the library's continuous bursts (native.Continuing)
        # a started engine's continuous bursts hand finished requests back through this thread (hand_back.py)
        self.hand_back: HandBack | None = None
        self.thread = threading.Thread(target=self._loop, name="nmtserve-engine", daemon=True)

    # -- life cycle
    def start(self) -> Engine:
        if self.config.batching == "continuous" and self.tr.native_steps and self.config.max_burst_steps > 1:
            self.hand_back = HandBack(self._hand_out).start()
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.thread.join()
        if self.hand_back is not None:
            self.hand_back.stop()

    # -- requests
    def submit(self, request: Request) -> Request:
        """Queue a request; EngineOverloaded at once when the waiting queue is full."""
        with self.lock:
            if self.stopping:
                raise EngineStopped("the engine is shutting down")
            if len(self.waiting) >= self.config.max_waiting:
                raise EngineOverloaded(f"waiting queue full ({self.config.max_waiting} requests)")
            request.id = request.id or f"r{next(self.ids)}"
            request.arrived_step = self.steps
            self.waiting.append(request)
            self.waiting_count[0] = len(self.waiting)
            self.lock.notify()
        return request

    def stats(self) -> dict:
        with self.lock:
            return {"waiting": len(self.waiting), "running": self.running_count, "steps": self.steps,
                    "admissions": self.admissions}

    def idle(self) -> bool:
        """No request waiting or running."""
        with self.lock:
            return not self.waiting and not self.running_count

    def busy(self) -> bool:
        """Requests waiting or running, read without the lock: a hint, for the callbacks an engine thread makes
        (`on_finish`), which may hold its own engine's lock while another engine's thread holds its."""
        return bool(self.waiting) or self.running_count > 0

    # -- the loop
    def run(self, requests: list[Request]) -> None:
        """Decode the requests in the calling thread, with no engine thread, and return once every one has
        finished (the offline translator's way in: OnnxTranslator.search_ids). They are admitted in the order given;
        the waiting queue takes them all."""
        with self.lock:
            self.config = dataclasses.replace(self.config, max_waiting=max(self.config.max_waiting, len(requests)))
        for request in requests:
            self.submit(request)
        while self._iterate(wait=False):
            pass

    def _loop(self) -> None:
        if LIBC is not None:
            LIBC.prctl(15, b"nmtserve-engine", 0, 0, 0)  # PR_SET_NAME: top -H and perf show the thread by name
        while self._iterate(wait=True):
            pass

    def _iterate(self, wait: bool) -> bool:
        """One iteration: schedule, execute, process -> False once there is nothing left to do (with `wait`, it
        first sleeps until there is work or the engine stops)."""
        if time.monotonic() >= self.next_trim:
            release_free_memory()
            self.next_trim = time.monotonic() + TRIM_SECONDS
        with self.lock:
            while wait and not self.waiting and not self.running_count and not self.stopping:
                self.lock.wait()
            if not self.waiting and not self.running_count and (self.stopping or not wait):
                return False
            admitted = self._schedule()
            self.waiting_count[0] = len(self.waiting)
            burst = self._burst(admitted)
        started = time.perf_counter()
        try:
            stepped = self._execute(admitted, burst)
            if self.on_step:
                seconds = (time.perf_counter() - started) / max(1, len(stepped))
                for rows, slots in stepped:
                    self.on_step(rows, slots, seconds)
        except Exception as e:  # an engine error fails the requests it touched, not the engine
            running = self.batch.requests
            placed = {id(r) for r in running}
            failed = running + [r for r in admitted if id(r) not in placed]
            self.batch.clear()
            self._publish()
            for request in failed:
                self._finish(request, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
        return True

    def _schedule(self) -> list[Request]:
        """(Lock held.) Drop cancelled/expired requests; take waiting ones within the budgets."""
        now = time.monotonic()
        for request in [r for r in self.waiting if r.cancelled or r.deadline is not None and now >= r.deadline]:
            self.waiting.remove(request)
            self._finish(request, self._dropped(request, now))
        self._leave([(r, why) for r in self.batch.requests if (why := self._dropped(r, now))])
        if not self.waiting:
            return []  # no one to admit
        running = self.batch.requests
        if self.config.batching == "static" and running:
            return []  # static batching: the running batch finishes before anyone joins
        rows, gather = sum(r.width for r in running), self._gather()
        if running and rows >= gather // 2 and self.steps - self.admitted_step < self.config.admit_steps \
                and min(self.config.max_running_rows - rows, sum(r.width for r in self.waiting)) < gather:
            return []  # newcomers gather, to be encoded together (EngineConfig.admit_rows)
        budget = self.config.max_batch_tokens - sum(r.cost(self.tr.limits) for r in running)
        admitted = []
        for request in sorted(self.waiting, key=self._latest_start) if running else self.waiting:
            if rows + request.width > self.config.max_running_rows:
                break
            cost = request.cost(self.tr.limits)
            if cost > budget and (running or admitted):
                break  # an oversized request still runs alone rather than never
            request.admitted = now
            if not request.options.greedy:
                request.search = make_search(request.options, request.budget(self.tr.limits), self.tr.eos_id,
                                             request.prefix, self.tr.unk_id, request.favoured,
                                             self.tr.word_continuations if request.options.constraints else None)
            budget -= cost
            rows += request.width
            admitted.append(request)
        self.ahead = []
        if admitted and self.config.batching == "static" and self.config.encode_ahead > len(admitted):
            n = len(admitted)
            rest = list(itertools.islice(self.waiting, len(admitted), self.config.encode_ahead))
            if len(rest) < len(self.waiting) - n:  # the queue goes on: whole groups only, as admissions take them
                rest = rest[:len(rest) // n * n]
            self.ahead = [rest[i:i + n] for i in range(0, len(rest), n)]
        if admitted:
            self.admitted_step = self.steps
            self.admissions += 1
            if running:
                taken = {id(r) for r in admitted}
                self.waiting = collections.deque(r for r in self.waiting if id(r) not in taken)
            else:  # taken from the head, in order
                for _ in admitted:
                    self.waiting.popleft()
        self.running_count += len(admitted)  # counted from the moment they leave the queue
        return admitted

    @staticmethod
    def _latest_start(request: Request) -> int:
        """Newcomers join a running batch least slack first: by the step at which they must start to finish
        with the others that arrived with them, taking a request's decoding steps to be about its source
        length. A long request joins before short ones that came a little earlier (their wait plus their
        few steps is still less), so latency depends less on length; none waits for more than the
        longest source's steps beyond its turn in arrival order."""
        return request.arrived_step - len(request.src_ids)

    @staticmethod
    def _dropped(request: Request, now: float) -> FinishReason | None:
        if request.cancelled:
            return FinishReason.CANCELLED
        if request.deadline is not None and now >= request.deadline:
            return FinishReason.DEADLINE
        return None

    def _burst(self, admitted: list[Request]) -> int:
        """(Lock held.) How many greedy steps this iteration runs in the library. WHOLE, with static batching (no
        one joins) and none streaming: a batch of greedy requests runs until they finish (`RunningBatch.greedy_run`,
        in the library where it runs), and with whole_searches a newly admitted batch of like beam searches or
        samplings too (`RunningBatch.search_run`). Else none (0: one step of every row, `RunningBatch.step`) unless
        every request in the batch is greedy and none streams (a streamed token a step: one step in Python costs less
        than a library call); then, with continuous batching, CONTINUE: up to max_burst_steps steps in the library,
        through row ends, until newcomers may join (`_continuing`; a started engine's hand-back thread hands the
        finished requests back meanwhile); one with max_burst_steps 1."""
        running = self.batch.requests + admitted
        if self.config.whole_searches and self.config.batching == "static" and admitted and not self.batch.requests \
                and not any(r.on_token is not None for r in admitted) \
                and all(r.search is not None for r in admitted) \
                and len({(type(r.search), r.search.rows, r.search.candidates) for r in admitted}) == 1:
            return WHOLE
        if not running or any(r.search is not None for r in running):
            return 0
        if self.config.batching == "static" and self.config.max_burst_steps > 1 \
                and not any(r.on_token is not None for r in running):
            return WHOLE
        if not self.tr.native_steps:
            return 0
        if any(r.on_token is not None for r in running):
            return 0
        return CONTINUE if self.config.max_burst_steps > 1 else 1

    def _execute(self, admitted: list[Request], burst: int = 0) -> list[tuple[int, int]]:
        """Newcomers join, one decoder step (with `burst`, up to that many greedy steps in the library; WHOLE: the
        batch's whole search; CONTINUE: a continuous burst), its tokens processed -> (rows, valid cache slots) of each
        step run. A request the encoder or the decoder fails on alone finishes with ERROR; the others go on."""
        searches = burst == WHOLE and any(r.search is not None for r in admitted)  # a whole search run
        failed = self.batch.admit(admitted, self.ahead, narrow=searches) if admitted else []
        self.batch.compact()
        outputs, whole = None, None  # one step's outputs, or what a run in one call stepped
        if searches and self.batch.state is not None:
            whole = self._search_whole()
        elif self.batch.state is not None:
            deadline = min((r.deadline for r in self.batch.requests if r.deadline is not None), default=0.0)
            if burst == WHOLE and self.batch.state.holes:  # a request left (cancelled, expired): its hole stays
                burst = self.config.max_burst_steps if self.tr.native_steps else 0
            if burst != 0:
                try:
                    whole = self._run_greedy(deadline, self.config.max_burst_steps, self._continuing()) \
                        if burst == CONTINUE else self._run_greedy(deadline, 0 if burst == WHOLE else burst)
                except Exception:
                    pass  # one step below meets the error again and finds whom it belongs to
            if whole is None:
                outputs, step_failed = self.batch.step()
                failed += step_failed
        if failed:
            self._publish()
            for request, error in failed:
                self._finish(request, FinishReason.ERROR, error=f"{type(error).__name__}: {error}")
        if outputs is None:
            return whole or []
        stepped = [(len(self.batch.rows), self.batch.cache_slots())]
        self.steps += 1
        self._process(outputs)
        return stepped

    def _run_greedy(self, stop_at: float, steps: int, continuing: Continuing | None = None) -> list[tuple[int, int]]:
        """The batch's greedy requests run in one call (`RunningBatch.greedy_run`): until they finish, the cache is
        full or a step passes stop_at (steps 0), or a burst of up to `steps` that ends when one finishes, or with
        `continuing` through row ends until newcomers may join (the hand-back thread hands the finished ones back
        meanwhile). Their tokens are emitted; those that finished leave, told after the count is published."""
        started = time.monotonic()
        outputs, stepped = self.batch.greedy_run(stop_at, self.on_step is not None, steps, continuing, self.hand_back)
        first, leaving = first_step_end(started, len(stepped)), []
        for request, tokens, score, finish in outputs:
            self._gain(request, tokens, score, first)
            if finish is not None:
                leaving.append((request, finish))
        self.steps += len(stepped)
        self.batch.leave([r for r, _ in leaving])  # a whole run's finished rows have left already
        self._publish()
        self._tell(leaving)
        return stepped

    def _continuing(self) -> Continuing:
        """A continuous burst's terms (native.Continuing): newcomers join as `_schedule` lets them."""
        rows = sum(r.width for r in self.batch.requests)
        return Continuing(self.waiting_count, self.config.max_running_rows - rows, self._gather(),
                          max(1, self.admitted_step + self.config.admit_steps - self.steps), np.zeros(1, np.int64),
                          -1 if self.hand_back is None else self.hand_back.fd)

    def _hand_out(self, results: list[tuple[Request, list[int], float, FinishReason]], first: float) -> None:
        """(The hand-back thread, while a continuous burst goes on) finish the requests whose rows have finished:
        they no longer count as running (their rows leave when the burst ends), then each is told. `first`: when
        the burst's first step ended."""
        with self.lock:
            self.running_count -= len(results)
        for request, tokens, score, finish in results:
            self._gain(request, tokens, score, first)
            self._finish(request, finish)

    def _gather(self) -> int:
        """The rows newcomers gather to join in one encoder call (EngineConfig.admit_rows, at most a quarter)."""
        return min(self.config.admit_rows, max(1, self.config.max_running_rows // 4))

    def _gain(self, request: Request, tokens: list[int], score: float, first: float) -> None:
        """A greedy request's tokens and log-probs from a run in the library, whose first step ended at `first`: a
        request's first token came then if it had none before (the run's steps are timed together, not each)."""
        request.first_token = request.first_token or first
        self._emit(request, tokens)
        request.score += score

    def _search_whole(self) -> list[tuple[int, int]]:
        """The batch's searches run to their ends in one call (`RunningBatch.search_run`); each request settles."""
        requests = self.batch.search_run()
        self._publish()
        self._tell([(request, self._settle(request)) for request in requests])
        return []

    def _process(self, outputs: list[tuple[Request, int | None, float | None, FinishReason | None]]) -> None:
        now = time.monotonic()
        leaving = []
        for request, token, score, finish in outputs:
            request.first_token = request.first_token or now
            if request.search is not None:
                if request.search.done:
                    leaving.append((request, self._settle(request)))
                else:
                    self._emit(request, request.search.settled()[len(request.tokens):])
                continue
            request.score += score
            if finish is not FinishReason.EOS:  # eos itself is not emitted
                self._emit(request, [token])
            if finish is not None:
                leaving.append((request, finish))
        self._leave(leaving)

    @staticmethod
    def _emit(request: Request, tokens: list[int]) -> None:
        for token in tokens:
            request.tokens.append(token)
            if request.on_token:
                request.on_token(request, token)

    @staticmethod
    def _settle(request: Request) -> FinishReason:
        """A finished search's n-best list; its best hypothesis becomes the request's result."""
        request.hypotheses = request.search.results()
        best = request.hypotheses[0]
        request.tokens, request.score = list(best.tokens), best.score
        return FinishReason.EOS if best.finish == "eos" else FinishReason.LENGTH

    def _leave(self, leaving: list[tuple[Request, FinishReason]]) -> None:
        """Rows are freed (and the count published) before anyone is told."""
        if not leaving:
            return
        self.batch.leave([r for r, _ in leaving])
        self._publish()
        self._tell(leaving)

    def _tell(self, leaving: list[tuple[Request, FinishReason]]) -> None:
        """Finish requests whose rows have left; those that asked for attention get their hypotheses' first (one
        aligner call for them all), and fail alone if that call fails."""
        asking = [(r, why) for r, why in leaving if r.attention and why in (FinishReason.EOS, FinishReason.LENGTH)]
        error = None
        if asking:
            for request, why in asking:
                request.finish = why  # what a greedy request's hypothesis says (done is set later, by _finish)
                request.hypotheses = request.results()
            pairs = [(r, h) for r, _ in asking for h in r.hypotheses]
            try:
                found = self.tr.attention([r.src_ids for r, _ in pairs], [[*r.prefix, *h.tokens] for r, h in pairs])
                for (_, hypothesis), weights in zip(pairs, found):
                    hypothesis.attention = weights
            except Exception as e:
                error = f"attention: {type(e).__name__}: {e}"
        failed = {id(r) for r, _ in asking} if error else set()
        for request, why in leaving:
            if id(request) in failed:
                self._finish(request, FinishReason.ERROR, error)
            else:
                self._finish(request, why)

    def _publish(self) -> None:
        """Set running_count from the batch (engine thread; the Condition's lock is re-entrant)."""
        with self.lock:
            self.running_count = len(self.batch.requests)

    @staticmethod
    def _finish(request: Request, reason: FinishReason, error: str | None = None) -> None:
        if request.done.is_set():
            return
        request.finish, request.error, request.finished = reason, error, time.monotonic()
        request.done.set()
        if request.on_finish:
            request.on_finish(request)


class EnginePool:
    """A model's engines (`serve --inter-threads N`): each its own thread, waiting queue and running batch, over
    the same sessions through a decoding context of its own (OnnxTranslator.replica). On a CPU, N running
    batches of one intra-op thread each keep the cores busier than one batch on N threads, whose kernels
    are short at these sizes (docs/performance-journal.md, "Batches at once"); one client's request still runs on one thread.
    A request goes to the engine with the fewest requests waiting and running; its result does not depend
    on which (it depends on its own rows only). The pool has an Engine's interface."""

    def __init__(self, translator: Decoder, count: int = 1, config: EngineConfig | None = None,
                 on_step: Callable[[int, int, float], None] | None = None):
        self.engines = [Engine(translator if i == 0 else translator.replica(), config, on_step) for i in range(count)]
        self.tr = translator
        for engine in self.engines[1:]:
            engine.ids = self.engines[0].ids  # request ids unique across the engines

    def start(self) -> EnginePool:
        for engine in self.engines:
            engine.start()
        return self

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    def submit(self, request: Request) -> Request:
        """To the least busy engine; EngineOverloaded when even its waiting queue is full."""
        loads = [engine.stats() for engine in self.engines]
        least = min(range(len(loads)), key=lambda i: loads[i]["waiting"] + loads[i]["running"])
        return self.engines[least].submit(request)

    def stats(self) -> dict:
        """Waiting and running requests, decoder steps and admissions, summed over the engines."""
        each = [engine.stats() for engine in self.engines]
        return {key: sum(s[key] for s in each) for key in each[0]}

    def idle(self) -> bool:
        return all(engine.idle() for engine in self.engines)

    def busy(self) -> bool:
        """(Engine.busy) Any engine with requests waiting or running, read without their locks."""
        return any(engine.busy() for engine in self.engines)
