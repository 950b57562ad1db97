"""OnnxTranslator: greedy translation over a bundle with ONNX Runtime. Torch-free.

    from nmtserve.export.runtime.translator import OnnxTranslator
    tr = OnnxTranslator("bundles/default", device="cpu", variant="int8")
    for t in tr.translate_batch(["The cat sleeps."], return_scores=True):
        print(t.text, t.score)

Inputs are sorted by length and cut into batches of at most `max_batch_size` to cut padding;
within a batch, finished rows leave at once, so the remaining ones run smaller steps.

With io_binding (the default on CUDA) the K/V caches and cross K/V stay on the device as
OrtValues bound by pointer, one layer at a time, to the sessions' inputs and outputs; the decoder
graph gets an ArgMax appended, so a step sends the device only the small per-row arrays (tokens,
positions, masks) and brings back only the chosen ids and their log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from nmtserve.decoding import sorted_batches
from nmtserve.errors import BundleError, ConfigError
from nmtserve.export.runtime.batch import BatchState
from nmtserve.export.runtime.bundle import Bundle, load_bundle
from nmtserve.export.runtime.tensors import DeviceTensors, HostTensors

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
    # no CPU arena: the arena keeps the largest buffers any shape ever needed, and the running batch's
    # shapes change every step. Measured with `nmtserve soak` (default bundle, 24 clients, 180 s):
    # resident memory peaked at 785 MB with it, 739 MB without memory patterns, 523 MB without the
    # arena, at the same throughput (README, "Soak")
    so.enable_cpu_mem_arena = False
    return so


def make_session(path: Path, device: str = "cpu", intra_op_threads: int = 0,
                 model: bytes | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session on `device` (from `model` bytes if given, else the file at `path`);
    asking for CUDA and silently getting CPU is an error."""
    if device not in PROVIDERS:
        raise ConfigError(f"device {device!r}: choose cpu or cuda")
    if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ConfigError("device 'cuda': this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    try:
        session = ort.InferenceSession(model if model is not None else str(path), session_options(intra_op_threads),
                                       providers=PROVIDERS[device])
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
        raise BundleError(f"{path}: onnxruntime cannot load it ({str(e).splitlines()[0][:200]})") from None
    if session.get_providers()[0] != PROVIDERS[device][0]:
        raise ConfigError(f"{path}: asked for {device} but onnxruntime fell back to {session.get_providers()[0]}")
    return session


def with_greedy_outputs(path: Path) -> bytes:
    """The decoder-step graph plus outputs next_tokens (B,) int64 = argmax of log_probs and
    next_scores (B,) = their log-probabilities, after the original outputs."""
    model = onnx.load(str(path))
    graph = model.graph
    graph.node.extend([
        helper.make_node("ArgMax", ["log_probs"], ["next_tokens"], axis=-1, keepdims=0),
        helper.make_node("Constant", [], ["greedy_axis"], value=helper.make_tensor("greedy_axis", onnx.TensorProto.INT64, [1], [1])),
        helper.make_node("Unsqueeze", ["next_tokens", "greedy_axis"], ["greedy_index"]),
        helper.make_node("GatherElements", ["log_probs", "greedy_index"], ["greedy_score"], axis=1),
        helper.make_node("Squeeze", ["greedy_score", "greedy_axis"], ["next_scores"])])
    graph.output.extend([helper.make_tensor_value_info("next_tokens", onnx.TensorProto.INT64, ["batch"]),
                          helper.make_tensor_value_info("next_scores", onnx.TensorProto.FLOAT, ["batch"])])
    return model.SerializeToString()


class OnnxTranslator:
    """Encoder and decoder-step sessions of one bundle variant, and greedy search over them."""

    def __init__(self, bundle: str | Path | Bundle, device: str = "cpu", variant: str = "fp32",
                 intra_op_threads: int = 0, io_binding: bool | None = None):
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        self.device, self.variant = device, variant
        self.io_binding = device == "cuda" if io_binding is None else io_binding
        self.encoder = make_session(self.bundle.graph_path(variant, "encoder"), device, intra_op_threads)
        decoder_path = self.bundle.graph_path(variant, "decoder")
        self.decoder = make_session(decoder_path, device, intra_op_threads,
                                    model=with_greedy_outputs(decoder_path) if self.io_binding else None)
        self.ops = DeviceTensors(device, PROVIDERS[device], session_options(1)) if self.io_binding else HostTensors
        self.tokenizer = self.bundle.tokenizer()
        m = self.bundle.model
        self.n_layers, self.n_heads, self.head_dim = m["n_decoder_layers"], m["n_heads"], m["d_model"] // m["n_heads"]
        self.limits = self.bundle.limits
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
        return self.decoder.run(["log_probs", "new_k", "new_v"], feed)

    # -- the same on the batch state, wherever its tensors live: callers never see K/V
    def prefill(self, sources: list[list[int]]) -> BatchState:
        """Encode token-id sources once -> fresh rows for the decoder batch (on this translator's device)."""
        src_ids, src_mask = self.pad(sources)
        if not self.io_binding:
            return BatchState.from_encoded(*self.encode(src_ids, src_mask), src_mask, self.bos_id)
        batch, src_len = src_ids.shape
        shape = (self.n_layers, batch, self.n_heads, src_len, self.head_dim)
        cross_k, cross_v = self.ops.empty(shape, self.kv_dtype), self.ops.empty(shape, self.kv_dtype)
        binding = self.encoder.io_binding()
        binding.bind_cpu_input("src_ids", src_ids)
        binding.bind_cpu_input("src_mask", src_mask)
        self._bind_layers(binding.bind_output, "cross_k", cross_k)
        self._bind_layers(binding.bind_output, "cross_v", cross_v)
        self.encoder.run_with_iobinding(binding)
        return BatchState.from_encoded(cross_k, cross_v, src_mask, self.bos_id, ops=self.ops)

    def decode_one_token(self, state: BatchState) -> tuple[np.ndarray, np.ndarray]:
        """One greedy step of every row -> tokens (B,) int64 and their log-probs (B,); the step's K/V
        are written into `state`, and every row but the holes advances (a hole's token is meaningless)."""
        tokens, scores, new_k, new_v = self._greedy_step(state)
        state.append(new_k, new_v, tokens)
        return tokens, scores

    def _greedy_step(self, state: BatchState) -> tuple[np.ndarray, np.ndarray, object, object]:
        """tokens (B,), their log-probs (B,), new_k, new_v (L, B, H, 1, Dh) where `state.ops` keeps them."""
        if not self.io_binding:
            log_probs, new_k, new_v = self.step(state.tokens, state.positions, state.k, state.v, state.valid,
                                                state.cross_k, state.cross_v, state.src_mask)
            tokens = log_probs.argmax(axis=-1).astype(np.int64)
            return tokens, log_probs[np.arange(len(tokens)), tokens], new_k, new_v
        binding = self.decoder.io_binding()
        for name, value in (("tokens", state.tokens), ("positions", state.positions), ("past_valid", state.valid),
                            ("src_mask", state.src_mask)):
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for prefix, stacked in (("past_k", state.k), ("past_v", state.v), ("cross_k", state.cross_k),
                                ("cross_v", state.cross_v)):
            self._bind_layers(binding.bind_input, prefix, stacked)
        binding.bind_output("log_probs", self.device)  # stays on the device
        binding.bind_output("new_k", self.device)
        binding.bind_output("new_v", self.device)
        binding.bind_output("next_tokens", "cpu")
        binding.bind_output("next_scores", "cpu")
        self.decoder.run_with_iobinding(binding)
        _, new_k, new_v, tokens, scores = binding.get_outputs()
        return tokens.numpy(), scores.numpy(), new_k, new_v

    def _bind_layers(self, bind, prefix: str, stacked: ort.OrtValue) -> None:
        """Bind layer l of a stacked (L, …) device tensor to `{prefix}_{l}` by address: no copy."""
        shape = stacked.shape()
        layer_bytes = stacked.tensor_size_in_bytes() // shape[0]
        for layer in range(shape[0]):
            bind(f"{prefix}_{layer}", self.device, 0, self.kv_dtype, shape[1:], stacked.data_ptr() + layer * layer_bytes)

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
        state = self.prefill(sources)
        budget = np.array([self.limits.output_budget(len(s), max_decoding_length) for s in sources])
        rows = np.arange(len(sources))  # original index of each running row
        outputs: list[list[int]] = [[] for _ in sources]
        scores = np.zeros(len(sources))
        while state is not None:
            tokens, token_scores = self.decode_one_token(state)
            scores[rows] += token_scores
            for r, t in zip(rows, tokens):
                if t != self.eos_id:
                    outputs[r].append(int(t))
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
        ids = [self.tokenizer.encode(t)[: self.limits.max_source_tokens] or [self.eos_id] for t in texts]
        out = self.translate_ids(ids, max_batch_size=max_batch_size, max_decoding_length=max_decoding_length)
        return [Translation(self.tokenizer.decode(tokens), tokens, score if return_scores else None)
                for tokens, score in out]
