"""One client floods, another probes: closed-loop flooding clients and one-call-at-a-time probes, for the benchmarks
that ask whether a flood holds up someone else (bench models: another model; bench quotas: another API key)."""

from __future__ import annotations

import itertools
import threading
import time

from nmtserve.loadtests.workload import mixed


class Flood:
    """Closed-loop clients calling one model until stopped, as fast as they can; counts the sentences translated
    and the calls refused with RESOURCE_EXHAUSTED. A refusal is sent again at once, as a misbehaving client
    would, or with `polite` after the seconds of its retry-after trailer, as a client library would. A client
    stops at any other error (`errors`)."""

    def __init__(self, stub, model: str, pool: list[str], clients: int, per_call: int, seed: int, options,
                 metadata=None, polite: bool = False):
        from nmtserve.v1 import translation_pb2 as pb

        self.done, self.rejected, self.errors, self.lock, self.stop = 0, 0, [], threading.Lock(), threading.Event()
        self.metadata, self.polite = metadata, polite
        calls = [pb.TranslateRequest(sentences=mixed(pool, per_call, seed=seed * 1000 + i), model=model,
                                     options=options) for i in range(clients)]
        self.threads = [threading.Thread(target=self._client, args=(stub, call)) for call in calls]

    def _client(self, stub, call) -> None:
        import grpc

        while not self.stop.is_set():
            try:
                stub.Translate(call, metadata=self.metadata, timeout=300)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    with self.lock:
                        self.rejected += 1
                    if self.polite:
                        self.stop.wait(float(dict(e.trailing_metadata() or ()).get("retry-after", 1)))
                    continue
                self.errors.append(f"{e.code().name}: {e.details()}")
                return
            with self.lock:
                self.done += len(call.sentences)

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


class FloodProcess:
    """A Flood in a process of its own, with its own channel: a flood that spins on refusals holds its process's
    GIL, which the probes of a Flood in their own process would wait for. `done` and `rejected` as Flood's."""

    def __init__(self, target: str, model: str, pool: list[str], clients: int, per_call: int, seed: int, options,
                 metadata=None, polite: bool = False):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._done, self._rejected, self._stop = context.Value("q", 0), context.Value("q", 0), context.Event()
        self._errors = context.Queue()
        self.process = context.Process(target=_flood_process, daemon=True, args=(
            target, model, pool, clients, per_call, seed, options.SerializeToString(), metadata, polite,
            self._done, self._rejected, self._stop, self._errors))

    @property
    def done(self) -> int:
        return self._done.value

    @property
    def rejected(self) -> int:
        return self._rejected.value

    def __enter__(self) -> FloodProcess:
        self.process.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.process.join(60)
        self.errors = [] if self._errors.empty() else self._errors.get()


def _flood_process(target, model, pool, clients, per_call, seed, options, metadata, polite, done, rejected, stop,
                   errors) -> None:
    from nmtserve.client import open_channel
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    with open_channel(target) as channel:
        flood = Flood(pb_grpc.TranslationServiceStub(channel), model, pool, clients, per_call, seed,
                      pb.DecodingOptions.FromString(options), metadata, polite)
        with flood:
            while not stop.wait(0.05):
                done.value, rejected.value = flood.done, flood.rejected
        done.value, rejected.value = flood.done, flood.rejected
        errors.put(flood.errors)


def probe(stub, model: str, sentences: list[str], options, seconds: float = 0.0, metadata=None) -> list[float]:
    """Latencies of one call per sentence, one after another; with `seconds`, over the sentences again
    until that long has passed."""
    from nmtserve.v1 import translation_pb2 as pb

    latencies, end = [], time.perf_counter() + seconds
    for sentence in itertools.chain(sentences, itertools.takewhile(lambda _: time.perf_counter() < end,
                                                                   itertools.cycle(sentences))):
        t0 = time.perf_counter()
        stub.Translate(pb.TranslateRequest(sentences=[sentence], model=model, options=options), metadata=metadata,
                       timeout=300)
        latencies.append(time.perf_counter() - t0)
    return latencies


def rate(flood: Flood, seconds: float) -> float:
    """Sentences/s the flood translates over the next `seconds`."""
    start, t0 = flood.done, time.perf_counter()
    time.sleep(seconds)
    return (flood.done - start) / (time.perf_counter() - t0)
