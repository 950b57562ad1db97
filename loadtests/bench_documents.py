"""A whole document in one TranslateText call against its sentences sent as separate Translate calls.

    nmtserve bench documents bundles/opus-shaped --sentences-file runs/opus-shaped/sentences.txt

One `nmtserve serve` process. The document is `sentences` sentences of the file, five to a paragraph.
Each run, in turn: the document in one TranslateText call; its sentences (as the server splits them)
in separate Translate calls one after another, as a naive client sends them; and the same calls all
at once from one thread each, the best a client can do without TranslateText. Reported per way:
the document's latency (first call sent to last answer) and output tokens/s, median and min–max over
runs. All three ask for the same decoding options, so they decode the same tokens.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.loadtests.machine import describe, machine_info
from nmtserve.loadtests.workload import ServerProcess, default_sentence_file, read_sentences

WAYS = ("one TranslateText call", "separate calls, one after another", "separate calls, all at once")


@dataclass
class DocumentsBenchConfig:
    bundle: str
    sentences_file: str | None = None  # default: the bundle's training data test split
    sentences: int = 50
    max_decoding_length: int = 32
    runs: int = 3
    threads: int = 1


def run_documents_bench(cfg: DocumentsBenchConfig, progress: Progress) -> dict:
    from nmtserve.client import open_channel
    from nmtserve.server.documents import sentence_spans
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    pool = read_sentences(cfg.sentences_file or default_sentence_file(cfg.bundle))[: cfg.sentences]
    document = "\n\n".join(" ".join(pool[i:i + 5]) for i in range(0, len(pool), 5))
    options = pb.DecodingOptions(max_decoding_length=cfg.max_decoding_length)
    timings: dict[str, list[tuple[float, int]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as logs, \
            ServerProcess(cfg.bundle, "--threads", str(cfg.threads), "--metrics-port", "-1",
                          log=Path(logs) / "server.log") as server, open_channel(server.target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        info = stub.ListModels(pb.ListModelsRequest(), timeout=30).models[0]
        sentences = [document[a:b] for a, b in sentence_spans(document, info.source_language)]

        def one_call() -> int:
            return stub.TranslateText(pb.TranslateTextRequest(texts=[document], options=options),
                                      timeout=600).translations[0].output_tokens

        def separate(sentence: str) -> int:
            return stub.Translate(pb.TranslateRequest(sentences=[sentence], options=options),
                                  timeout=600).translations[0].output_tokens

        def one_after_another() -> int:
            return sum(separate(s) for s in sentences)

        def all_at_once() -> int:
            with ThreadPoolExecutor(len(sentences)) as pool:
                return sum(pool.map(separate, sentences))

        ways = dict(zip(WAYS, (one_call, one_after_another, all_at_once)))
        separate(sentences[0])  # warm-up: a channel's and a process's first calls
        progress.expect(cfg.runs * len(ways))
        for run in range(cfg.runs):
            for way, send in ways.items():
                progress.stage(f"run {run + 1}/{cfg.runs}: {way}")
                t0 = time.perf_counter()
                tokens = send()
                timings[way].append((time.perf_counter() - t0, tokens))
    results = {}
    for way, measured in timings.items():
        seconds, rates = [s for s, _ in measured], [t / s for s, t in measured]
        results[way] = {"latency_s": _stats(seconds), "tokens_per_s": _stats(rates), "output_tokens": measured[0][1]}
    one = results[WAYS[0]]["latency_s"]["median"]
    return {"bundle": cfg.bundle, "model": info.model, "sentences": len(sentences), "characters": len(document),
            "max_decoding_length": cfg.max_decoding_length, "threads": cfg.threads, "runs": cfg.runs,
            "machine": machine_info(), "results": results,
            "speedup": {way: round(results[way]["latency_s"]["median"] / one, 2) for way in WAYS[1:]}}


def _stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def format_table(report: dict) -> str:
    lines = [describe(report["machine"]),
             f"{report['model']}: a document of {report['sentences']} sentences ({report['characters']:,} characters), "
             f"at most {report['max_decoding_length']} tokens each; median [min–max] of {report['runs']} runs",
             f"{'':<36}{'latency s':>24}{'tokens/s':>24}"]
    for way, r in report["results"].items():
        lat, rate = r["latency_s"], r["tokens_per_s"]
        lines.append(f"{way:<36}{lat['median']:>8.2f} [{lat['min']:.2f}–{lat['max']:.2f}]".ljust(60)
                     + f"{rate['median']:>8,.0f} [{rate['min']:,.0f}–{rate['max']:,.0f}]")
    lines += [f"{way}: {ratio:.2f}× the one call's latency" for way, ratio in report["speedup"].items()]
    return "\n".join(lines)
