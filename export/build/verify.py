"""Verification of a bundle against the PyTorch model it came from.

1. onnx.checker and strict shape inference on every graph file;
2. per-graph max-abs-diff against PyTorch over a grid of shapes with batch 1, source length 1
   and step 1 (an empty cache) among them;
3. a teacher-forced step-by-step cached decode in ONNX Runtime against PyTorch's;
4. end-to-end greedy translation of a data split: share of sentences with tokens identical to
   the PyTorch reference, and BLEU/chrF of every variant that runs here;
5. decoder-step latency at steps 1, 16, 64 and 128 (it should stay nearly flat).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from nmtserve.decoding import sorted_batches
from nmtserve.export.build.variants import VARIANTS
from nmtserve.export.runtime.bundle import load_bundle
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.training.checkpoint import LoadedModel
from nmtserve.training.data import pad, read_corpus, split_file
from nmtserve.training.decode import greedy_decode
from nmtserve.training.evaluate import score
from nmtserve.training.model import KVCache

FP32_TOLERANCE = 1e-4
IDENTICAL_SHARE_REQUIRED = 0.99  # fp32 ORT vs PyTorch; near-ties may flip a rare argmax
INT8_BLEU_DROP_ALLOWED = 0.5
FP16_BLEU_DROP_ALLOWED = 0.1
SHAPE_GRID = [(1, 1, 0), (1, 2, 1), (3, 1, 4), (4, 11, 7), (8, 5, 16)]  # (batch, source length, cache length)
LATENCY_STEPS = (1, 16, 64, 128)


def check_graph_files(bundle_dir: Path, variants: dict) -> dict:
    results = {}
    for name, v in variants.items():
        for graph in ("encoder", "decoder"):
            path = bundle_dir / v[graph]
            onnx.checker.check_model(str(path), full_check=True)
            onnx.shape_inference.infer_shapes(onnx.load(str(path)), check_type=True, strict_mode=True)
            results[v[graph]] = "ok"
    return results


def _random_inputs(model, batch: int, src_len: int, past_len: int, seed: int):
    c = model.config
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, c.vocab_size, (batch, src_len), generator=g)
    src_mask = torch.ones(batch, src_len, dtype=torch.bool)
    if batch > 1 and src_len > 1:
        src_mask[-1, src_len // 2:] = False  # one padded row
    kv = (c.n_decoder_layers, batch, c.n_heads, past_len, c.head_dim)
    past_valid = torch.ones(batch, past_len, dtype=torch.bool)
    if batch > 1 and past_len > 1:
        past_valid[0, : past_len // 2] = False  # a row that joined later
    tokens = torch.randint(4, c.vocab_size, (batch,), generator=g)
    positions = past_valid.sum(1)
    return src, src_mask, tokens, positions, torch.randn(kv, generator=g), torch.randn(kv, generator=g), past_valid


def graph_parity(model, translator: OnnxTranslator) -> dict:
    """Max-abs-diff of every output of both graphs over SHAPE_GRID."""
    worst = {"encoder": 0.0, "decoder": 0.0}
    dtype = translator.kv_dtype
    for i, (b, s, t) in enumerate(SHAPE_GRID):
        src, src_mask, tokens, positions, past_k, past_v, past_valid = _random_inputs(model, b, s, t, seed=i)
        with torch.no_grad():
            ref_ck, ref_cv = model.cross_kv(model.encode(src, src_mask))
            ref = model.decode_step(tokens, positions, KVCache(past_k, past_v, past_valid), ref_ck, ref_cv, src_mask)
        ck, cv = translator.encode(src.numpy(), src_mask.numpy())
        worst["encoder"] = max(worst["encoder"], _diff(ck, ref_ck), _diff(cv, ref_cv))
        got = translator.step(tokens.numpy(), positions.numpy(), past_k.numpy().astype(dtype), past_v.numpy().astype(dtype),
                              past_valid.numpy(), ref_ck.numpy().astype(dtype), ref_cv.numpy().astype(dtype), src_mask.numpy())
        worst["decoder"] = max(worst["decoder"], *(_diff(g, r) for g, r in zip(got, ref)))
    return {"shapes": [list(x) for x in SHAPE_GRID], "max_abs_diff": worst}


def _diff(a: np.ndarray, b: torch.Tensor) -> float:
    return float(np.abs(a.astype(np.float32) - b.numpy()).max()) if a.size else 0.0


def cached_decode_parity(model, translator: OnnxTranslator, sources: list[list[int]], steps: int = 24) -> dict:
    """Teacher-forced: both decoders see PyTorch's greedy tokens; compare log-probs at every step."""
    src, src_mask = pad(sources, translator.pad_id)
    with torch.no_grad():
        ref_ck, ref_cv = model.cross_kv(model.encode(src, src_mask))
    ck, cv = translator.encode(src.numpy(), src_mask.numpy())
    cache = KVCache.empty(model.config, len(sources))
    past_k, past_v, past_valid = translator.empty_cache(len(sources))
    tokens = torch.full((len(sources),), translator.bos_id)
    worst = 0.0
    for step in range(steps):
        positions = torch.full((len(sources),), step)
        with torch.no_grad():
            ref_lp, rk, rv = model.decode_step(tokens, positions, cache, ref_ck, ref_cv, src_mask)
        cache.append(rk, rv)
        lp, nk, nv = translator.step(tokens.numpy(), positions.numpy(), past_k, past_v, past_valid, ck, cv, src_mask.numpy())
        past_k, past_v = np.concatenate([past_k, nk], 3), np.concatenate([past_v, nv], 3)
        past_valid = np.concatenate([past_valid, np.ones((len(sources), 1), bool)], 1)
        worst = max(worst, _diff(lp, ref_lp))
        tokens = ref_lp.argmax(-1)
    return {"sentences": len(sources), "steps": steps, "max_abs_diff_log_probs": worst}


def reference_tokens(model, sources: list[list[int]], batch_size: int) -> list[list[int]]:
    """PyTorch greedy tokens, batched by sorted length like OnnxTranslator."""
    out: list[list[int]] = [[] for _ in sources]
    for rows in sorted_batches([len(s) for s in sources], batch_size):
        src, mask = pad([sources[i] for i in rows], 0)
        for i, toks in zip(rows, greedy_decode(model, src, mask)[0]):
            out[i] = toks
    return out


def step_latency(translator: OnnxTranslator, batch: int, repeats: int = 20) -> dict:
    """Median decoder-step milliseconds with a cache of each length in LATENCY_STEPS."""
    rng = np.random.default_rng(0)
    src_len = 16
    ck = rng.standard_normal((translator.n_layers, batch, translator.n_heads, src_len, translator.head_dim)).astype(translator.kv_dtype)
    src_mask = np.ones((batch, src_len), bool)
    result = {}
    for step in LATENCY_STEPS:
        kv = rng.standard_normal((translator.n_layers, batch, translator.n_heads, step - 1, translator.head_dim)).astype(translator.kv_dtype)
        args = (np.full(batch, 5, np.int64), np.full(batch, step - 1, np.int64), kv, kv, np.ones((batch, step - 1), bool), ck, ck, src_mask)
        translator.step(*args)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            translator.step(*args)
            times.append((time.perf_counter() - t0) * 1000)
        result[str(step)] = round(statistics.median(times), 3)
    return result


def verify_bundle(bundle_dir: Path, loaded: LoadedModel, split: str = "test", limit: int = 0,
                  batch_size: int = 32) -> dict:
    """Run every check; `passed` is False if any fp32 tolerance or BLEU bound is broken."""
    bundle = load_bundle(bundle_dir)
    model = loaded.model.eval()
    report: dict = {"checker": check_graph_files(bundle_dir, bundle.manifest["variants"]), "variants": {}}
    runnable = [v for v in bundle.variants if "cpu" in VARIANTS[v]["devices"]
                or "CUDAExecutionProvider" in ort.get_available_providers()]
    report["not_measured"] = {v: "needs CUDA; this machine's onnxruntime has no CUDAExecutionProvider"
                              for v in bundle.variants if v not in runnable}

    data_dir = (loaded.payload.get("train_config") or {}).get("data")
    pairs = read_corpus([split_file(data_dir, split)]).pairs if data_dir else []
    pairs = pairs[:limit] if limit else pairs
    tok = loaded.tokenizer
    sources = [tok.encode(s)[: model.config.max_len] or [tok.eos_id] for s, _ in pairs]
    references = [t for _, t in pairs]
    ref_tokens = reference_tokens(model, sources, batch_size) if pairs else []
    if pairs:
        report["pytorch"] = score([tok.decode(t) for t in ref_tokens], references).to_dict()
        report["data"] = {"split": split, "sentences": len(pairs), "source": str(split_file(data_dir, split))}

    for variant in runnable:
        device = "cpu" if "cpu" in VARIANTS[variant]["devices"] else "cuda"
        tr = OnnxTranslator(bundle, device=device, variant=variant)
        entry = {"device": device, "graph_parity": graph_parity(model, tr),
                 "cached_decode": cached_decode_parity(model, tr, sources[:8] or [[5, 6, 7]]),
                 "step_latency_ms": {"batch_1": step_latency(tr, 1), "batch_32": step_latency(tr, 32)}}
        if pairs:
            got = [tokens for tokens, _ in tr.translate_ids(sources, max_batch_size=batch_size)]
            entry["identical_to_pytorch"] = round(sum(a == b for a, b in zip(got, ref_tokens)) / len(pairs), 4)
            entry["scores"] = score([tok.decode(t) for t in got], references).to_dict()
        report["variants"][variant] = entry
    report["checks"] = _judge(report)
    report["passed"] = all(report["checks"].values())
    return report


def _judge(report: dict) -> dict:
    checks = {}
    fp32 = report["variants"].get("fp32")
    if fp32:
        diffs = fp32["graph_parity"]["max_abs_diff"]
        checks["fp32_encoder_below_1e-4"] = diffs["encoder"] < FP32_TOLERANCE
        checks["fp32_decoder_below_1e-4"] = diffs["decoder"] < FP32_TOLERANCE
        checks["fp32_cached_decode_below_1e-4"] = fp32["cached_decode"]["max_abs_diff_log_probs"] < FP32_TOLERANCE
        if "identical_to_pytorch" in fp32:
            checks["fp32_identical_tokens_at_least_99%"] = fp32["identical_to_pytorch"] >= IDENTICAL_SHARE_REQUIRED
    for variant, allowed in (("int8", INT8_BLEU_DROP_ALLOWED), ("fp16", FP16_BLEU_DROP_ALLOWED)):
        entry = report["variants"].get(variant)
        if entry and fp32 and "scores" in entry:
            drop = fp32["scores"]["bleu"] - entry["scores"]["bleu"]
            entry["bleu_drop_vs_fp32"] = round(drop, 2)
            checks[f"{variant}_bleu_within_{allowed}_of_fp32"] = drop <= allowed
    return checks
