"""OnnxTranslator: greedy translation over a bundle with ONNX Runtime. Torch-free.

    from export.translator import OnnxTranslator
    tr = OnnxTranslator("bundles/default", device="cpu", variant="int8")
    for t in tr.translate_batch(["The cat sleeps."], return_scores=True):
        print(t.text, t.score)

Inputs are sorted by length and cut into batches of at most `max_batch_size` to cut padding;
within a batch, finished rows leave at once, so the remaining ones run smaller steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from export.batch import BatchState
from export.bundle import Bundle, load_bundle
from nmtserve.errors import BundleError, ConfigError
from nmtserve.decoding import output_budget, sorted_batches

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


@dataclass
class Translation:
    text: str
    tokens: list[int]  # target ids, eos excluded
    score: float | None = None  # sum of the chosen tokens' log-probabilities (eos included), if asked


def session_options(intra_op_threads: int = 0) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = intra_op_threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


def make_session(path: Path, device: str = "cpu", intra_op_threads: int = 0) -> ort.InferenceSession:
    """An ONNX Runtime session on `device`; asking for CUDA and silently getting CPU is an error."""
    if device not in PROVIDERS:
        raise ConfigError(f"device {device!r}: choose cpu or cuda")
    if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ConfigError("device 'cuda': this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    try:
        session = ort.InferenceSession(str(path), session_options(intra_op_threads), providers=PROVIDERS[device])
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
        raise BundleError(f"{path}: onnxruntime cannot load it ({str(e).splitlines()[0][:200]})") from None
    if session.get_providers()[0] != PROVIDERS[device][0]:
        raise ConfigError(f"{path}: asked for {device} but onnxruntime fell back to {session.get_providers()[0]}")
    return session


class OnnxTranslator:
    """Encoder and decoder-step sessions of one bundle variant, and greedy search over them."""

    def __init__(self, bundle: str | Path | Bundle, device: str = "cpu", variant: str = "fp32",
                 intra_op_threads: int = 0):
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        self.device, self.variant = device, variant
        self.encoder = make_session(self.bundle.graph_path(variant, "encoder"), device, intra_op_threads)
        self.decoder = make_session(self.bundle.graph_path(variant, "decoder"), device, intra_op_threads)
        self.tokenizer = self.bundle.tokenizer()
        m = self.bundle.model
        self.n_layers, self.n_heads, self.head_dim = m["n_decoder_layers"], m["n_heads"], m["d_model"] // m["n_heads"]
        self.max_len = m["max_len"]
        self.kv_dtype = np.float16 if self.bundle.manifest["variants"][variant].get("kv_dtype") == "float16" else np.float32
        ids = self.bundle.special_ids
        self.pad_id, self.bos_id, self.eos_id = ids["pad"], ids["bos"], ids["eos"]

    # -- the two graphs; K/V are stacked (L, B, H, T|S, Dh) here and fed one layer per input
    def encode(self, src_ids: np.ndarray, src_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """src_ids (B, S) int64, src_mask (B, S) bool -> cross_k, cross_v (L, B, H, S, Dh)."""
        outputs = self.encoder.run(None, {"src_ids": src_ids, "src_mask": src_mask})
        return np.stack(outputs[0::2]), np.stack(outputs[1::2])

    def step(self, tokens, positions, past_k, past_v, past_valid, cross_k, cross_v, src_mask):
        """One decoder step -> log_probs (B, V), new_k, new_v (L, B, H, 1, Dh).

        past_k[l] of a C-ordered (L, …) array is itself contiguous: no input is copied.
        """
        feed = {"tokens": tokens, "positions": positions, "past_valid": past_valid, "src_mask": src_mask}
        for layer in range(self.n_layers):
            feed[f"past_k_{layer}"], feed[f"past_v_{layer}"] = past_k[layer], past_v[layer]
            feed[f"cross_k_{layer}"], feed[f"cross_v_{layer}"] = cross_k[layer], cross_v[layer]
        return self.decoder.run(None, feed)

    def empty_cache(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A zero-length cache (k, v, valid), for callers that concatenate."""
        shape = (self.n_layers, batch, self.n_heads, 0, self.head_dim)
        return np.zeros(shape, self.kv_dtype), np.zeros(shape, self.kv_dtype), np.zeros((batch, 0), bool)


    # -- search
    def pad(self, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full((len(seqs), max(len(s) for s in seqs)), self.pad_id, dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        return ids, ids != self.pad_id

    def greedy(self, sources: list[list[int]], max_decoding_length: int = 256) -> list[tuple[list[int], float]]:
        """Greedy search for one batch of token-id sources; finished rows leave the batch at once."""
        src_ids, src_mask = self.pad(sources)
        state = BatchState.from_encoded(*self.encode(src_ids, src_mask), src_mask, self.bos_id)
        budget = np.array([output_budget(len(s), max_decoding_length, self.max_len) for s in sources])
        rows = np.arange(len(sources))  # original index of each running row
        outputs: list[list[int]] = [[] for _ in sources]
        scores = np.zeros(len(sources))
        while state is not None:
            log_probs, new_k, new_v = self.step(state.tokens, state.positions, state.k, state.v, state.valid,
                                                state.cross_k, state.cross_v, state.src_mask)
            tokens = log_probs.argmax(axis=-1).astype(np.int64)
            scores[rows] += log_probs[np.arange(len(rows)), tokens]
            for r, t in zip(rows, tokens):
                if t != self.eos_id:
                    outputs[r].append(int(t))
            state.append(new_k, new_v, tokens)
            keep = (tokens != self.eos_id) & (state.positions < budget[rows])
            if not keep.all():
                state, rows = state.filter(keep), rows[keep]
        return list(zip(outputs, scores.tolist()))

    def translate_ids(self, sources: list[list[int]], *, max_batch_size: int = 32,
                      max_decoding_length: int = 256) -> list[tuple[list[int], float]]:
        """Greedy (tokens, score) for token-id sources, batched by sorted length."""
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size {max_batch_size}: must be at least 1")
        results: list = [None] * len(sources)
        for rows in sorted_batches([len(s) for s in sources], max_batch_size):
            for i, result in zip(rows, self.greedy([sources[i] for i in rows], max_decoding_length)):
                results[i] = result
        return results

    def translate_batch(self, texts: list[str], *, max_batch_size: int = 32, max_decoding_length: int = 256,
                        return_scores: bool = False) -> list[Translation]:
        """Translate texts; inputs are sorted by length so that each batch has little padding."""
        ids = [self.tokenizer.encode(t)[: self.max_len] or [self.eos_id] for t in texts]
        out = self.translate_ids(ids, max_batch_size=max_batch_size, max_decoding_length=max_decoding_length)
        return [Translation(self.tokenizer.decode(tokens), tokens, score if return_scores else None)
                for tokens, score in out]
