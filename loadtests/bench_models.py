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

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.errors import NmtserveError
from nmtserve.loadtests.flood import Flood, probe, rate
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
        probe(stub, probed, probe_pool[:4], options)  # warm-up: a channel's and a process's first calls
        probe(stub, flooded, flood_pool[:4], options)
        progress.expect(cfg.runs)
        for run in range(cfg.runs):
            probes = mixed(probe_pool, cfg.probes, seed=run)
            progress.stage(f"run {run + 1}/{cfg.runs}: {probed} alone, {flooded} alone, both")
            alone = probe(stub, probed, probes, options)
            flood = (stub, flooded, flood_pool, cfg.flood_clients, cfg.flood_sentences, run, options)
            with Flood(*flood) as flooding:
                flood_alone = rate(flooding, cfg.seconds)
            with Flood(*flood) as flooding:
                time.sleep(min(2.0, cfg.seconds / 4))  # the flood's first calls fill the running batch
                start, t0 = flooding.done, time.perf_counter()
                under = probe(stub, probed, probes, options, cfg.seconds)
                flood_with_probes = (flooding.done - start) / (time.perf_counter() - t0)
            if flooding.errors or flooding.rejected:
                raise NmtserveError(f"{len(flooding.errors) + flooding.rejected} flood call(s) failed, e.g. "
                                    f"{(flooding.errors or ['RESOURCE_EXHAUSTED'])[0]}")
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
