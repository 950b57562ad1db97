"""What a beam's copies of its source's cross-attention K/V cost, against sharing one copy.

    nmtserve bench cross-kv bundles/default --requests 8 --beam-size 4

The engine gives each of a beam's k rows its own copy of the request's cross K/V (encoded once,
copied k times when the request joins: RunningBatch.admit). The alternative keeps one copy per
request and maps rows to it; ONNX Runtime's CPU attention takes K/V per row, so the decoder graph
would gather the rows' K/V from the shared copies with a Gather node, at every step. Measured on
the bundle's own sessions (ONNX Runtime, this process, median of `runs` repeats), for `requests`
sources of the test split at beam k: the encoder for them; the copy at admission; one decoder step
of the k × requests rows; the gather that sharing would add to every step (numpy.take of the same
bytes: what a Gather node moves); and the bytes each layout holds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from nmtserve.loadtests.machine import describe, machine_info
from nmtserve.loadtests.workload import default_sentence_file, mixed, read_sentences


@dataclass
class CrossKvBenchConfig:
    bundle: str
    requests: int = 8
    beam_size: int = 4
    runs: int = 20
    threads: int = 1
    sentences_file: str | None = None  # default: the bundle's training data test split


def _median_ms(fn, runs: int, setup=lambda: None) -> tuple[float, float, float]:
    """fn(setup()) timed `runs` times (setup not counted): median, min, max in ms."""
    times = []
    for _ in range(runs):
        arg = setup()
        t0 = time.perf_counter()
        fn(arg)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times)


def run_cross_kv_bench(cfg: CrossKvBenchConfig) -> dict:
    from nmtserve.export.runtime.translator import OnnxTranslator

    tr = OnnxTranslator(cfg.bundle, intra_op_threads=cfg.threads, shared_cross=False)  # the engine's step
    sentences = mixed(read_sentences(cfg.sentences_file or default_sentence_file(cfg.bundle)), cfg.requests, seed=0)
    sources = [tr.tokenizer.encode(s, tr.limits.max_source_tokens) or [tr.eos_id] for s in sentences]
    rows = np.repeat(np.arange(cfg.requests), cfg.beam_size)
    fresh = tr.prefill(sources)
    beams = fresh.gather(rows)
    results = {
        "encoder": _median_ms(lambda _: tr.prefill(sources), cfg.runs),
        "copy at admission (once per request)": _median_ms(lambda _: fresh.gather(rows), cfg.runs),
        # each repeat decodes the first step from its own copy of the same state
        "decoder step of the rows": _median_ms(lambda state: tr.decode_candidates(state, 2 * cfg.beam_size),
                                               cfg.runs, setup=lambda: fresh.gather(rows)),
        "gather per step if shared": _median_ms(
            lambda _: (np.take(fresh.cross_k, rows, axis=1), np.take(fresh.cross_v, rows, axis=1)), cfg.runs),
    }
    cross_bytes = fresh.cross_k.nbytes + fresh.cross_v.nbytes
    return {"bundle": cfg.bundle, "requests": cfg.requests, "beam_size": cfg.beam_size, "runs": cfg.runs,
            "threads": cfg.threads, "source_tokens": [len(s) for s in sources],
            "padded_source_length": int(fresh.src_mask.shape[1]),
            "machine": machine_info(),
            "ms_median_min_max": {k: [round(x, 3) for x in v] for k, v in results.items()},
            "cross_kv_bytes": {"shared": cross_bytes, "copied": beams.cross_k.nbytes + beams.cross_v.nbytes}}


def format_table(report: dict) -> str:
    lines = [describe(report["machine"]),
             f"{report['requests']} requests at beam {report['beam_size']} ({report['requests'] * report['beam_size']} "
             f"rows), sources padded to {report['padded_source_length']} tokens, {report['threads']} ORT thread(s), "
             f"median of {report['runs']}"]
    for name, (median, low, high) in report["ms_median_min_max"].items():
        lines.append(f"{name:<46}{median:>9.3f} ms  [{low:.3f}–{high:.3f}]")
    b = report["cross_kv_bytes"]
    lines.append(f"cross K/V held: shared {b['shared'] / 1e6:.2f} MB, copied {b['copied'] / 1e6:.2f} MB")
    return "\n".join(lines)
