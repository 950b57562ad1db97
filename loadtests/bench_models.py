"""Two models behind one server: does a flood of requests on one hold up the other?

    nmtserve bench models bundles/opus-shaped bundles/fr-en --report runs/bench/models-cpu.json

One `nmtserve serve FLOODED,PROBED` process, each model with its own engine and --threads ONNX
Runtime threads. Each run, in this order:
- probes alone: `probes` Translate calls of one sentence to the probed model, one after another;
- flood alone: `flood_clients` closed-loop clients send the flooded model calls of `flood_sentences`
  sentences each (more than its running batch holds: requests wait) for `seconds`;
- both: the same flood and, once it runs, the same probes, again and again for `seconds`.
Reported, as the median and min–max over runs: the probes' p50 and p90 latency alone and under the
flood, and the flood's sentences/s alone and while the probes run. Every call must succeed.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.errors import NmtserveError
from nmtserve.loadtests.machine import describe, machine_info
from nmtserve.loadtests.measure import percentile
from nmtserve.loadtests.workload import ServerProcess, default_sentence_file, mixed, read_sentences


@dataclass
class ModelsBenchConfig:
    flooded: str  # bundle
    probed: str  # bundle
    flooded_sentences: str | None = None  # sentence files; default: the bundles' training data test splits
    probed_sentences: str | None = None
    flood_clients: int = 16
    flood_sentences: int = 8  # per call
    probes: int = 30
    seconds: float = 15.0
    runs: int = 3
    threads: int = 1  # ONNX Runtime intra-op threads of each model
    max_decoding_length: int = 32  # of every call, flood and probes


class Flood:
    """Closed-loop clients calling one model until stopped; counts the sentences translated."""

    def __init__(self, stub, model: str, pool: list[str], clients: int, per_call: int, seed: int, options):
        from nmtserve.v1 import translation_pb2 as pb

        self.done, self.errors, self.lock, self.stop = 0, [], threading.Lock(), threading.Event()
        calls = [pb.TranslateRequest(sentences=mixed(pool, per_call, seed=seed * 1000 + i), model=model,
                                     options=options) for i in range(clients)]
        self.threads = [threading.Thread(target=self._client, args=(stub, call)) for call in calls]

    def _client(self, stub, call) -> None:
        import grpc

        while not self.stop.is_set():
            try:
                stub.Translate(call, timeout=300)
            except grpc.RpcError as e:
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


def _probe(stub, model: str, sentences: list[str], options, seconds: float = 0.0) -> list[float]:
    """Latencies of one call per sentence, one after another; with `seconds`, over the sentences again
    until that long has passed."""
    from nmtserve.v1 import translation_pb2 as pb

    latencies, end = [], time.perf_counter() + seconds
    for sentence in itertools.chain(sentences, itertools.takewhile(lambda _: time.perf_counter() < end,
                                                                   itertools.cycle(sentences))):
        t0 = time.perf_counter()
        stub.Translate(pb.TranslateRequest(sentences=[sentence], model=model, options=options), timeout=300)
        latencies.append(time.perf_counter() - t0)
    return latencies


def _rate(flood: Flood, seconds: float) -> float:
    """Sentences/s the flood translates over the next `seconds`."""
    start, t0 = flood.done, time.perf_counter()
    time.sleep(seconds)
    return (flood.done - start) / (time.perf_counter() - t0)


def run_models_bench(cfg: ModelsBenchConfig, progress: Progress) -> dict:
    from nmtserve.client import open_channel
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    flood_pool = read_sentences(cfg.flooded_sentences or default_sentence_file(cfg.flooded))
    probe_pool = read_sentences(cfg.probed_sentences or default_sentence_file(cfg.probed))
    runs = []
    with tempfile.TemporaryDirectory() as logs, \
            ServerProcess(f"{cfg.flooded},{cfg.probed}", "--threads", str(cfg.threads), "--metrics-port", "-1",
                          log=Path(logs) / "server.log") as server, open_channel(server.target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        flooded, probed = [m.model for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models]
        options = pb.DecodingOptions(max_decoding_length=cfg.max_decoding_length)
        _probe(stub, probed, probe_pool[:4], options)  # warm-up: a channel's and a process's first calls
        _probe(stub, flooded, flood_pool[:4], options)
        progress.expect(cfg.runs)
        for run in range(cfg.runs):
            probes = mixed(probe_pool, cfg.probes, seed=run)
            progress.stage(f"run {run + 1}/{cfg.runs}: {probed} alone, {flooded} alone, both")
            alone = _probe(stub, probed, probes, options)
            flood = (stub, flooded, flood_pool, cfg.flood_clients, cfg.flood_sentences, run, options)
            with Flood(*flood) as flooding:
                flood_alone = _rate(flooding, cfg.seconds)
            with Flood(*flood) as flooding:
                time.sleep(min(2.0, cfg.seconds / 4))  # the flood's first calls fill the running batch
                start, t0 = flooding.done, time.perf_counter()
                under = _probe(stub, probed, probes, options, cfg.seconds)
                flood_with_probes = (flooding.done - start) / (time.perf_counter() - t0)
            if flooding.errors:
                raise NmtserveError(f"{len(flooding.errors)} flood call(s) failed, e.g. {flooding.errors[0]}")
            if not flood_alone:
                raise NmtserveError(f"no flood call finished in {cfg.seconds} s: give more --seconds")
            runs.append({"probe_alone_p50_ms": percentile(alone, 50) * 1e3,
                         "probe_alone_p90_ms": percentile(alone, 90) * 1e3,
                         "probe_flooded_p50_ms": percentile(under, 50) * 1e3,
                         "probe_flooded_p90_ms": percentile(under, 90) * 1e3,
                         "flood_alone_sentences_per_s": flood_alone,
                         "flood_with_probes_sentences_per_s": flood_with_probes})
    results = {key: {"median": round(statistics.median(r[key] for r in runs), 1),
                     "min": round(min(r[key] for r in runs), 1), "max": round(max(r[key] for r in runs), 1)}
               for key in runs[0]}
    ratios = {"probe p50 flooded/alone": round(results["probe_flooded_p50_ms"]["median"]
                                               / results["probe_alone_p50_ms"]["median"], 2),
              "flood sentences/s with probes/alone": round(results["flood_with_probes_sentences_per_s"]["median"]
                                                           / results["flood_alone_sentences_per_s"]["median"], 2)}
    return {"flooded": {"bundle": cfg.flooded, "model": flooded}, "probed": {"bundle": cfg.probed, "model": probed},
            "flood_clients": cfg.flood_clients, "flood_sentences_per_call": cfg.flood_sentences, "probes": cfg.probes,
            "threads_per_model": cfg.threads, "runs": cfg.runs, "machine": machine_info(), "results": results,
            "ratios": ratios}


def format_table(report: dict) -> str:
    flooded, probed = report["flooded"]["model"], report["probed"]["model"]
    lines = [describe(report["machine"]),
             f"one server, {flooded} flooded by {report['flood_clients']} clients × {report['flood_sentences_per_call']} "
             f"sentences, {probed} probed one sentence at a time; {report['threads_per_model']} ORT thread(s) per model; "
             f"median [min–max] of {report['runs']} runs"]
    for key, cell in report["results"].items():
        lines.append(f"{key:<36}{cell['median']:>10,.1f} [{cell['min']:,.1f}–{cell['max']:,.1f}]")
    lines += [f"{name}: {value:.2f}" for name, value in report["ratios"].items()]
    return "\n".join(lines)
