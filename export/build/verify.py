"""Verification of a bundle against the PyTorch model it came from.

1. onnx.checker and strict shape inference on every graph file (the variants' and the ranker);
2. per-graph parity with PyTorch over a grid of shapes with batch 1, source length 1 and step 1
   (an empty cache) among them;
3. a teacher-forced step-by-step cached decode in ONNX Runtime against PyTorch's;
4. end-to-end greedy translation of a data split: share of sentences with tokens identical to
   the PyTorch reference (or leaving it only where PyTorch's best two tokens tie), and BLEU/chrF of
   every variant that runs here;
5. decoder-step latency at steps 1, 16, 64 and 128 (it should stay nearly flat);
   2 to 5 for each variant's portable graphs and, where the bundle has them, its graphs on nmtserve's kernels
   (a bundle whose kernel graphs cannot run here fails: they would serve unverified);
6. for a checkpoint imported from Hugging Face (Marian, M2M100, NLLB), against transformers (the marian extra) on
   the directory it came from: log-probabilities of its model and of the imported one, and the fp32 bundle's greedy
   and beam-4 tokens against its generate's, on random sources of the model's own pieces.
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
from nmtserve.export.runtime import kernels
from nmtserve.export.runtime.batch import eos_of
from nmtserve.export.runtime.bundle import load_bundle
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.training.checkpoint import LoadedModel
from nmtserve.training.data import pad, read_corpus, split_file
from nmtserve.training.decode import greedy_decode
from nmtserve.training.evaluate import score
from nmtserve.training.model import KVCache

# What is compared is what decides the output, so that the verdict depends on the export and not on
# the training run. A log-prob of a token of probability e^-30 carries a float error in proportion to
# its size (3.8e-4 on one default run, 2.6e-5 on another, with identical tokens) and decides nothing:
# log-probs are compared where PyTorch gives the token at least MASS_PROB (relative to their size beyond
# 1 nat), caches relative to their scale.
FP32_TOLERANCE = 1e-4
MASS_PROB = 1e-4
TIE = 1e-4  # PyTorch's best two log-probs this close: float noise between two engines may pick either
IDENTICAL_SHARE_REQUIRED = 0.99  # fp32 ORT vs PyTorch: sentences identical, or leaving PyTorch's only at a tie
INT8_BLEU_DROP_ALLOWED = 0.5
FP16_BLEU_DROP_ALLOWED = 0.1
SHAPE_GRID = [(1, 1, 0), (1, 2, 1), (3, 1, 4), (4, 11, 7), (8, 5, 16)]  # (batch, source length, cache length)
LATENCY_STEPS = (1, 16, 64, 128)


def check_graph_files(bundle_dir: Path, manifest: dict) -> dict:
    """onnx's checker on every graph of every variant, and on the ranker; strict shape inference on those of
    standard ops (the kernel graphs' nmtserve ops have no schema that onnx knows: they are checked by running
    them)."""
    results = {}
    for v in [*manifest["variants"].values(), {"graphs": {"ranker": manifest["ranker"]}}]:
        for name, file in v["graphs"].items():
            path = bundle_dir / file
            standard = not name.endswith("_kernels")
            onnx.checker.check_model(str(path), full_check=standard)
            if standard:
                onnx.shape_inference.infer_shapes(onnx.load(str(path)), check_type=True, strict_mode=True)
            results[file] = "ok"
    return results


def _random_inputs(model, batch: int, src_len: int, past_len: int, seed: int):
    c = model.config
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, c.source_vocab_size or c.vocab_size, (batch, src_len), generator=g)
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
    """Worst difference of both graphs' outputs over SHAPE_GRID: caches relative to their scale,
    log-probs where they carry mass (see MASS_PROB); the plain max-abs-diff is reported beside."""
    worst = {"encoder_relative": 0.0, "decoder_cache_relative": 0.0, "decoder_log_probs": 0.0, "max_abs_diff": 0.0}
    dtype = translator.kv_dtype
    for i, (b, s, t) in enumerate(SHAPE_GRID):
        src, src_mask, tokens, positions, past_k, past_v, past_valid = _random_inputs(model, b, s, t, seed=i)
        with torch.no_grad():
            ref_ck, ref_cv = model.cross_kv(model.encode(src, src_mask))
            ref = model.decode_step(tokens, positions, KVCache(past_k, past_v, past_valid), ref_ck, ref_cv, src_mask)
        ck, cv, eos = translator.encode(src.numpy(), src_mask.numpy())
        got = translator.step(tokens.numpy(), positions.numpy(), past_k.numpy().astype(dtype), past_v.numpy().astype(dtype),
                              past_valid.numpy(), ref_ck.numpy().astype(dtype), ref_cv.numpy().astype(dtype), src_mask.numpy())
        ref_eos = torch.from_numpy(eos_of(ref_ck.numpy(), ref_cv.numpy(), src_mask.numpy()))
        real = src_mask[None, :, None, :, None]  # cross K/V at a row's padding are never read: unspecified
        pairs = {"encoder_relative": [(np.where(real.numpy(), ck, 0), ref_ck.where(real, 0)),
                                      (np.where(real.numpy(), cv, 0), ref_cv.where(real, 0)), (eos, ref_eos)],
                 "decoder_cache_relative": list(zip(got[1:], ref[1:]))}
        for key, outputs in pairs.items():
            worst[key] = max(worst[key], *(_relative_diff(a, r) for a, r in outputs))
        worst["decoder_log_probs"] = max(worst["decoder_log_probs"], _log_prob_diff(got[0], ref[0]))
        worst["max_abs_diff"] = max(worst["max_abs_diff"], *(_abs_diff(a, r) for a, r in [*pairs["encoder_relative"], *zip(got, ref)]))
    return {"shapes": [list(x) for x in SHAPE_GRID], **{k: float(f"{v:.3g}") for k, v in worst.items()}}


def _abs_diff(a: np.ndarray, b: torch.Tensor) -> float:
    """max |a - b|, where equal values (suppressed ids' -inf too) differ by 0."""
    a, b = a.astype(np.float32), b.numpy()
    with np.errstate(invalid="ignore"):
        return float(np.where(a == b, 0.0, np.abs(a - b)).max()) if a.size else 0.0


def _relative_diff(a: np.ndarray, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error on the tensor's own scale."""
    return _abs_diff(a, b) / max(float(b.abs().max()), 1e-6) if a.size else 0.0


def _log_prob_diff(a: np.ndarray, b: torch.Tensor) -> float:
    """max |a - b| / max(1, |b|) over the tokens to which b gives probability >= MASS_PROB (b's best
    token always counts): absolute near log-prob 0, relative further down, where fp32 error grows
    with the size of the log-prob (measured: up to 3.8e-5 at log-prob -7.7 on a default run)."""
    ref = b.numpy()
    mass = (ref >= np.log(MASS_PROB)) | (ref == ref.max(-1, keepdims=True))
    with np.errstate(invalid="ignore"):  # suppressed ids: -inf - -inf, outside the mass
        return float((np.abs(a.astype(np.float32) - ref) / np.maximum(1.0, np.abs(ref)))[mass].max())


def cached_decode_parity(model, translator: OnnxTranslator, sources: list[list[int]], steps: int = 24) -> dict:
    """Teacher-forced: both decoders see PyTorch's greedy tokens; at every step compare the log-probs
    that carry mass and whether ONNX Runtime's best token is PyTorch's (a tie may pick either). A row is
    judged up to the step that gives its eos: after it, no search reads the row (greedy and sampling stop,
    a beam's hypothesis is finished), and fed its own garbage the decoder can reach states where fp32
    itself is off — on a default model trained for 2,404 steps, row 0 of the test split at its first step
    after eos: PyTorch fp32 and ONNX Runtime each 2.7e-4 from PyTorch in float64, within 9e-6 at every
    step before. Those steps' worst difference is reported (`after_eos_log_prob_diff`), not judged."""
    src, src_mask = pad(sources, translator.pad_id)
    with torch.no_grad():
        ref_ck, ref_cv = model.cross_kv(model.encode(src, src_mask))
    ck, cv, _ = translator.encode(src.numpy(), src_mask.numpy())
    cache = KVCache.empty(model.config, len(sources))
    past_k, past_v, past_valid = translator.empty_cache(len(sources))
    tokens = torch.full((len(sources),), translator.bos_id)
    live = np.ones(len(sources), bool)  # rows that have not given eos before this step
    worst, after_eos, same, judged = 0.0, 0.0, [], 0
    for step in range(steps):
        positions = torch.full((len(sources),), step)
        with torch.no_grad():
            ref_lp, rk, rv = model.decode_step(tokens, positions, cache, ref_ck, ref_cv, src_mask)
        cache.append(rk, rv)
        lp, nk, nv = translator.step(tokens.numpy(), positions.numpy(), past_k, past_v, past_valid, ck, cv, src_mask.numpy())
        past_k, past_v = np.concatenate([past_k, nk], 3), np.concatenate([past_v, nv], 3)
        past_valid = np.concatenate([past_valid, np.ones((len(sources), 1), bool)], 1)
        if live.any():
            worst = max(worst, _log_prob_diff(lp[live], ref_lp[live]))
        if not live.all():
            after_eos = max(after_eos, _log_prob_diff(lp[~live], ref_lp[~live]))
        best_two = ref_lp.topk(2).values
        agree = (torch.from_numpy(lp.argmax(-1)) == ref_lp.argmax(-1)) | (best_two[:, 0] - best_two[:, 1] <= TIE)
        same += agree.numpy()[live].tolist()
        judged += int(live.sum())
        tokens = ref_lp.argmax(-1)
        live &= tokens.numpy() != translator.eos_id
    return {"sentences": len(sources), "steps": steps, "judged_row_steps": judged,
            "log_prob_diff": float(f"{worst:.3g}"), "after_eos_log_prob_diff": float(f"{after_eos:.3g}"),
            "same_best_token": round(float(np.mean(same)), 4)}


def reference_tokens(model, sources: list[list[int]], batch_size: int) -> list[list[int]]:
    """PyTorch greedy tokens, batched by sorted length like OnnxTranslator."""
    out: list[list[int]] = [[] for _ in sources]
    for rows in sorted_batches([len(s) for s in sources], batch_size):
        src, mask = pad([sources[i] for i in rows], 0)
        for i, toks in zip(rows, greedy_decode(model, src, mask)[0]):
            out[i] = toks
    return out


def diverging_off_a_tie(model, sources: list[list[int]], got: list[list[int]], expected: list[list[int]]) -> list[int]:
    """Indices of sentences whose tokens leave PyTorch's (`expected`) at a step where PyTorch's best two
    tokens are more than TIE apart in log-probability: a real difference, not float noise."""
    bad = []
    for i, (src, g, e) in enumerate(zip(sources, got, expected)):
        if g == e:
            continue
        j = next((k for k, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
        src_ids, src_mask = torch.tensor([src]), torch.ones(1, len(src), dtype=torch.bool)
        prefix = torch.tensor([[model.config.bos_id] + e[:j]])
        with torch.no_grad():
            log_probs = model.decode(prefix, model.encode(src_ids, src_mask), src_mask, torch.ones_like(prefix).bool())[0, -1]
        best, second = log_probs.topk(2).values.tolist()
        if best - second > TIE:
            bad.append(i)
    return bad


def step_latency(translator: OnnxTranslator, batch: int, repeats: int = 20) -> dict:
    """Median decoder-step milliseconds with a cache of each length in LATENCY_STEPS (within the model's
    position table), run as the runtime runs a step: on a BatchState (16-token sources) whose caches the
    step writes in place, on the translator's device."""
    state = translator.prefill([[5] * 15 + [translator.eos_id]] * batch)
    result = {}
    for step in [s for s in LATENCY_STEPS if s <= translator.limits.max_target_tokens]:
        while state.length < step - 1:
            translator.decode_one_token(state)
        state.open_slot()
        translator._step(state, 1)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            translator._step(state, 1)
            times.append((time.perf_counter() - t0) * 1000)
        result[str(step)] = round(statistics.median(times), 3)
    return result


def verify_bundle(bundle_dir: Path, loaded: LoadedModel, split: str = "test", limit: int = 0,
                  batch_size: int = 32) -> dict:
    """Run every check; `passed` is False if any fp32 tolerance or BLEU bound is broken."""
    bundle = load_bundle(bundle_dir)
    model = loaded.model.eval()
    report: dict = {"checker": check_graph_files(bundle_dir, bundle.manifest), "variants": {}}
    runnable = [v for v in bundle.variants if "cpu" in VARIANTS[v]["devices"]
                or "CUDAExecutionProvider" in ort.get_available_providers()]
    report["not_measured"] = {v: "needs CUDA; this machine's onnxruntime has no CUDAExecutionProvider"
                              for v in bundle.variants if v not in runnable}

    data_dir = (loaded.payload.get("train_config") or {}).get("data")
    pairs = read_corpus([split_file(data_dir, split)]).pairs if data_dir else []
    pairs = pairs[:limit] if limit else pairs
    tok = loaded.tokenizer
    sources = [tok.encode(s, model.config.max_len) or [tok.eos_id] for s, _ in pairs]
    references = [t for _, t in pairs]
    ref_tokens = reference_tokens(model, sources, batch_size) if pairs else []
    if pairs:
        report["pytorch"] = score([tok.decode(t) for t in ref_tokens], references).to_dict()
        report["data"] = {"split": split, "sentences": len(pairs), "source": str(split_file(data_dir, split))}

    translators = {}
    for variant in runnable:
        device = "cpu" if "cpu" in VARIANTS[variant]["devices"] else "cuda"
        paths = [(variant, False)]  # the portable graphs, and the kernel graphs where the bundle has them
        if bundle.has_graph(variant, "decoder_kernels"):
            reason = kernels.unavailable()
            if reason is None:
                paths.append((f"{variant}_kernels", True))
            else:
                report["not_measured"][f"{variant}_kernels"] = reason
        for name, on_kernels in paths:
            served = OnnxTranslator(bundle, device=device, variant=variant, shared_cross=False,
                                    attention_kernel=on_kernels)
            tr = translators[name] = OnnxTranslator(bundle, device=device, variant=variant, attention_kernel=on_kernels)
            entry = {"device": device, "graphs": [*served.graphs, tr.graphs[1]],
                     "graph_parity": graph_parity(model, served),
                     "cached_decode": cached_decode_parity(model, served, sources[:8] or [[5, 6, 7]]),
                     "cached_decode_shared_cross": cached_decode_parity(model, tr, sources[:8] or [[5, 6, 7]]),
                     "step_latency_ms": {"batch_1": step_latency(served, 1), "batch_32": step_latency(served, 32)}}
            if pairs:
                got = [tokens for tokens, _ in tr.translate_ids(sources, max_batch_size=batch_size)]
                identical = sum(a == b for a, b in zip(got, ref_tokens))
                off_a_tie = len(diverging_off_a_tie(model, sources, got, ref_tokens))
                entry["identical_to_pytorch"] = round(identical / len(pairs), 4)
                entry["identical_or_tie"] = round((len(pairs) - off_a_tie) / len(pairs), 4)
                entry["scores"] = score([tok.decode(t) for t in got], references).to_dict()
            report["variants"][name] = entry
    if "imported_from" in loaded.payload:
        report["transformers"] = transformers_parity(loaded, translators.get("fp32_kernels", translators["fp32"]))
    report["checks"] = _judge(report)
    report["passed"] = all(report["checks"].values())
    return report


def transformers_parity(loaded: LoadedModel, tr: OnnxTranslator, sentences: int = 50) -> dict:
    """The imported model against transformers' model (MarianMTModel, M2M100ForConditionalGeneration) loaded from the
    directory it came from
    (every file's sha256 must still match). Sources are random sequences of the vocabulary's pieces, so
    no text in the model's language is needed; budgets are nmtserve's (length_rule "nmtserve", whose
    2 × source + 10 cap keeps a random model's outputs short), and generate runs without forced eos.
    length_rule "transformers" against generate's own max_length and forced eos is checked by
    tests/export/test_marian.py."""
    from transformers import M2M100ForConditionalGeneration, MarianMTModel
    from transformers.utils import logging as transformers_logging

    from nmtserve.decoding import DecodingOptions
    from nmtserve.errors import CheckpointError
    from nmtserve.export.runtime.bundle import sha256_of

    origin = loaded.payload["imported_from"]
    directory = Path(origin["directory"])
    for name, digest in origin["files"].items():
        if not (directory / name).is_file() or sha256_of(directory / name) != digest:
            raise CheckpointError(f"{directory / name}: missing or changed since import; verification against "
                                  "transformers needs the directory the checkpoint came from")
    transformers_logging.set_verbosity_error()  # generate warns that max_new_tokens overrides max_length
    reference = M2M100ForConditionalGeneration if origin["format"] == "m2m100" else MarianMTModel
    hf = reference.from_pretrained(directory, dtype=torch.float32).eval()
    model, c, tok = loaded.model.eval(), loaded.model.config, loaded.tokenizer
    rng = np.random.default_rng(0)
    # a multilingual model's sources carry their language token, and its outputs start with the target's
    languages = getattr(tok, "languages", {}) if origin["format"] == "m2m100" else {}
    around, prefix = ([], []) if not languages else \
        ([languages[tok.source_language or tok.target_languages[0]]], tok.target_prefix(tok.target_language or
                                                                                          tok.target_languages[0]))
    specials = {c.pad_id, c.eos_id, c.bos_id, tok.unk_id, *languages.values()}
    pieces = [i for i in range(c.source_vocab_size or c.vocab_size) if i not in specials]
    targets = [i for i in range(c.vocab_size) if i not in specials]
    sources = [around + [int(i) for i in rng.choice(pieces, rng.integers(3, 30))] + [c.eos_id] for _ in range(sentences)]
    worst = 0.0
    with torch.no_grad():
        for src in sources[:8]:
            src_ids = torch.tensor([src])
            tgt = torch.tensor([[c.bos_id, *prefix] + [int(i) for i in rng.choice(targets, 12)]])
            logits = hf(input_ids=src_ids, decoder_input_ids=tgt).logits[0]
            suppress = model.suppress if model.suppress is not None else 0  # generate's bad_words_ids
            expected = torch.log_softmax(logits + suppress, dim=-1) if c.renormalize else \
                torch.log_softmax(logits, dim=-1) + suppress
            got = model(src_ids, torch.ones_like(src_ids).bool(), tgt, torch.ones_like(tgt).bool())[0]
            finite = torch.isfinite(expected)
            worst = max(worst, float((got - expected)[finite].abs().max()))
    report = {"directory": str(directory), "sentences": sentences, "log_prob_diff": worst}
    forced = {"forced_bos_token_id": prefix[0]} if prefix else {}
    for name, k in (("greedy", 1), ("beam4", 4)):
        options = DecodingOptions(beam_size=k, length_penalty=1.0, beam_stopping="transformers")
        got = [h[0].tokens for h in tr.search_ids(sources, options, max_batch_size=16,
                                                  prefixes=[prefix] * len(sources) if prefix else None)]
        same = 0
        for src, tokens in zip(sources, got):
            budget = tr.limits.output_budget(len(src), options.max_decoding_length)  # the forced token counted
            out = hf.generate(torch.tensor([src]), num_beams=k, length_penalty=1.0, max_new_tokens=budget,
                              forced_eos_token_id=None, bad_words_ids=[[i] for i in c.suppressed_ids] or None, **forced)
            same += tokens == [t for t in out[0].tolist()[1 + len(prefix):] if t not in (c.eos_id, c.pad_id)]
        report[f"{name}_identical"] = round(same / sentences, 4)
    return report


def _judge(report: dict) -> dict:
    """The verdicts: fp32's tolerances against PyTorch and transformers, each lower precision's BLEU against
    fp32's, on the portable graphs and on the kernel graphs alike; kernel graphs that could not run fail."""
    checks = {}
    for suffix in ("", "_kernels"):
        fp32 = report["variants"].get("fp32" + suffix)
        if fp32:
            graphs = fp32["graph_parity"]
            checks[f"fp32{suffix}_encoder_within_1e-4"] = graphs["encoder_relative"] < FP32_TOLERANCE
            checks[f"fp32{suffix}_decoder_within_1e-4"] = \
                max(graphs["decoder_cache_relative"], graphs["decoder_log_probs"]) < FP32_TOLERANCE
            for name, key in (("cached_decode_within_1e-4", "cached_decode"),
                              ("shared_cross_cached_decode_within_1e-4", "cached_decode_shared_cross")):
                checks[f"fp32{suffix}_{name}"] = (fp32[key]["log_prob_diff"] < FP32_TOLERANCE
                                                  and fp32[key]["same_best_token"] >= IDENTICAL_SHARE_REQUIRED)
            if "identical_or_tie" in fp32:
                checks[f"fp32{suffix}_identical_tokens_at_least_99%"] = fp32["identical_or_tie"] >= IDENTICAL_SHARE_REQUIRED
        for variant, allowed in (("int8", INT8_BLEU_DROP_ALLOWED), ("fp16", FP16_BLEU_DROP_ALLOWED)):
            entry = report["variants"].get(variant + suffix)
            if entry and fp32 and "scores" in entry:
                drop = fp32["scores"]["bleu"] - entry["scores"]["bleu"]
                entry["bleu_drop_vs_fp32"] = round(drop, 2)
                checks[f"{variant}{suffix}_bleu_within_{allowed}_of_fp32"] = drop <= allowed
    hf = report.get("transformers")
    if hf:
        checks["log_probs_within_1e-4_of_transformers"] = hf["log_prob_diff"] < FP32_TOLERANCE
        checks["fp32_greedy_and_beam4_equal_generate_at_least_99%"] = \
            min(hf["greedy_identical"], hf["beam4_identical"]) >= IDENTICAL_SHARE_REQUIRED
    for name in report.get("not_measured", {}):
        if name.endswith("_kernels"):  # a bundle's kernel graphs that nothing ran are not verified
            checks[f"{name}_ran"] = False
    return checks
