"""Offline translation benchmark: the same weights, threads and sentences through PyTorch (greedy
with its KV cache), ONNX Runtime fp32/int8 (OnnxTranslator) and CTranslate2 fp32/int8.

    nmtserve bench offline bundles/default --json

Engines take turns within each run, so drift of the machine hits them alike; each figure is
the median of `runs` runs. Ratios are against CTranslate2 of the same precision.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nmtserve.errors import ConfigError

BATCH_SIZES = (1, 8, 32, 64)
ENGINES = ("pytorch", "ort_fp32", "ort_int8", "ct2_fp32", "ct2_int8")


@dataclass
class BenchConfig:
    bundle: str
    checkpoint: str | None = None  # default: the bundle's source checkpoint
    sentences: int = 300
    runs: int = 5
    threads: int = 2
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    engines: tuple[str, ...] = ENGINES
    split: str = "test"


@dataclass
class EngineResult:
    times: dict[int, list[float]] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)  # target tokens produced (eos excluded)
    outputs: list[list[int]] | None = None  # token ids of the last run at the largest batch


def _engines(cfg: BenchConfig, loaded, bundle, workdir: Path) -> dict[str, Callable[[list[list[int]], int], list[list[int]]]]:
    """name -> function(sources as token ids, batch size) -> target token ids."""
    import torch

    from nmtserve.decoding import sorted_batches
    from nmtserve.export.runtime.translator import OnnxTranslator
    from nmtserve.training.data import pad
    from nmtserve.training.decode import greedy_decode

    torch.set_num_threads(cfg.threads)
    engines: dict = {}

    def pytorch(sources, batch_size):
        out = [None] * len(sources)
        for rows in sorted_batches([len(s) for s in sources], batch_size):
            src, mask = pad([sources[i] for i in rows], 0)
            for i, toks in zip(rows, greedy_decode(loaded.model, src, mask)[0]):
                out[i] = toks
        return out

    engines["pytorch"] = pytorch
    for variant in ("fp32", "int8"):
        if f"ort_{variant}" in cfg.engines and variant in bundle.variants:
            tr = OnnxTranslator(bundle, variant=variant, intra_op_threads=cfg.threads)
            engines[f"ort_{variant}"] = (lambda t: lambda s, b: [x for x, _ in t.translate_ids(s, max_batch_size=b)])(tr)
    if any(e.startswith("ct2_") for e in cfg.engines):
        import ctranslate2

        from nmtserve.export.build.to_ctranslate2 import convert

        path = convert(loaded, workdir / "ct2")
        sp = loaded.tokenizer.sp
        for compute in ("float32", "int8"):
            name = "ct2_fp32" if compute == "float32" else "ct2_int8"
            ct = ctranslate2.Translator(str(path), device="cpu", compute_type=compute, intra_threads=cfg.threads,
                                        inter_threads=1)

            def run(sources, batch_size, ct=ct):
                pieces = [[sp.id_to_piece(i) for i in s] for s in sources]
                results = ct.translate_batch(pieces, beam_size=1, max_batch_size=batch_size, batch_type="examples",
                                             max_decoding_length=256)
                return [[sp.piece_to_id(p) for p in r.hypotheses[0]] for r in results]

            engines[name] = run
    return {name: fn for name, fn in engines.items() if name in cfg.engines}


def run_bench(cfg: BenchConfig) -> dict:
    from nmtserve.export.runtime.bundle import load_bundle
    from nmtserve.training.checkpoint import load_model
    from nmtserve.training.data import read_corpus, split_file

    bundle = load_bundle(cfg.bundle)
    checkpoint = cfg.checkpoint or bundle.manifest["source"]["checkpoint"]
    loaded = load_model(checkpoint)
    data_dir = bundle.manifest["source"].get("data")
    if not data_dir:
        raise ConfigError("the bundle records no data directory; give --checkpoint of a run on the built-in corpus")
    pairs = read_corpus([split_file(data_dir, cfg.split)]).pairs[: cfg.sentences]
    sources = [loaded.tokenizer.encode(s)[: loaded.model.config.max_len] or [loaded.tokenizer.eos_id] for s, _ in pairs]
    with tempfile.TemporaryDirectory() as tmp:
        engines = _engines(cfg, loaded, bundle, Path(tmp))
        results = {name: EngineResult() for name in engines}
        for name, fn in engines.items():  # warm-up: first-call allocations, lazy kernels
            fn(sources[:16], 8)
        for batch in cfg.batch_sizes:
            for _ in range(cfg.runs):
                for name, fn in engines.items():
                    t0 = time.perf_counter()
                    outputs = fn(sources, batch)
                    results[name].times.setdefault(batch, []).append(time.perf_counter() - t0)
                    results[name].tokens[batch] = sum(len(o) for o in outputs)
                    results[name].outputs = outputs
    return _report(cfg, results, len(sources), checkpoint)


def _report(cfg: BenchConfig, results: dict[str, EngineResult], n_sentences: int, checkpoint: str) -> dict:
    table = {}
    for name, r in results.items():
        table[name] = {}
        for batch, times in r.times.items():
            median = statistics.median(times)
            table[name][str(batch)] = {"median_s": round(median, 4), "sentences_per_s": round(n_sentences / median, 1),
                                       "target_tokens_per_s": round(r.tokens[batch] / median, 1),
                                       "runs": [round(t, 4) for t in times]}
    ratios = {}
    for ours, theirs in (("ort_fp32", "ct2_fp32"), ("ort_int8", "ct2_int8"), ("pytorch", "ct2_fp32")):
        if ours in table and theirs in table:
            ratios[f"{ours}/{theirs}"] = {b: round(table[ours][b]["target_tokens_per_s"] / table[theirs][b]["target_tokens_per_s"], 3)
                                         for b in table[ours]}
    agreement = {}
    reference = results.get("pytorch")
    for name, r in results.items():
        if reference and name != "pytorch" and r.outputs is not None:
            same = sum(a == b for a, b in zip(r.outputs, reference.outputs))
            agreement[f"{name}_vs_pytorch_identical"] = round(same / n_sentences, 4)
    import platform

    return {"checkpoint": checkpoint, "bundle": cfg.bundle, "sentences": n_sentences, "runs": cfg.runs,
            "threads": cfg.threads, "machine": {"processor": platform.processor() or platform.machine(),
                                                "python": platform.python_version()},
            "results": table, "ratios": ratios, "token_agreement": agreement}


def format_table(report: dict) -> str:
    batches = list(next(iter(report["results"].values())).keys())
    lines = [f"{report['sentences']} sentences, {report['threads']} threads, median of {report['runs']} runs — target tokens/s",
             f"{'engine':<10}" + "".join(f"{'batch ' + b:>12}" for b in batches)]
    for name, row in report["results"].items():
        lines.append(f"{name:<10}" + "".join(f"{row[b]['target_tokens_per_s']:>12.0f}" for b in batches))
    for name, row in report["ratios"].items():
        lines.append(f"{name:<18}" + "".join(f"{row[b]:>8.2f}" for b in batches))
    for name, share in report["token_agreement"].items():
        lines.append(f"{name}: {share:.1%}")
    return "\n".join(lines)
