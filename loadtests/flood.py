"""One client floods, another probes: closed-loop flooding clients and one-call-at-a-time probes, for the benchmarks
that ask whether a flood holds up someone else (bench models: another model; bench quotas: another API key)."""

from __future__ import annotations

import itertools
import threading
import time

from nmtserve.loadtests.workload import mixed


class Flood:
    """Closed-loop clients calling one model until stopped, as fast as they can (a refusal is not waited out:
    its retry-after is ignored, as a misbehaving client would); counts the sentences translated and the calls
    refused with RESOURCE_EXHAUSTED. A client stops at any other error (`errors`)."""

    def __init__(self, stub, model: str, pool: list[str], clients: int, per_call: int, seed: int, options,
                 metadata=None):
        from nmtserve.v1 import translation_pb2 as pb

        self.done, self.rejected, self.errors, self.lock, self.stop = 0, 0, [], threading.Lock(), threading.Event()
        self.metadata = metadata
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
