"""OnnxTranslator: translation over a bundle with ONNX Runtime, greedy, beam search or sampling. Torch-free.

    from nmtserve.export.runtime.translator import OnnxTranslator
    tr = OnnxTranslator("bundles/default", device="cpu", variant="int8")
    for t in tr.translate_batch(["The cat sleeps."], beam_size=4, num_hypotheses=2, return_scores=True):
        print(t.text, t.score, [(a.text, a.score) for a in t.alternatives])

Inputs are sorted by length and cut into batches of at most `max_batch_size` to cut padding; within a
batch, finished rows (a beam's: when its search is done) decode on, ignored, until they are a quarter of
the batch, then leave together, so the remaining ones run smaller steps. Small batches are encoded ahead,
up to ENCODE_AHEAD sources in one encoder call on the host, then decoded one after another: each graph's
weights stay in the CPU cache between its runs, and a call's fixed cost is paid once (a batch's result is
the same either way). With inter_threads > 1 (CTranslate2's name) that many batches, or groups of them,
decode at once on threads of their own, each with its own binding over the same two sessions (ONNX
Runtime runs one session's graphs concurrently): on a CPU this uses the cores better than one batch on
more intra-op threads, whose parallel regions are short at these sizes (docs/performance.md, "Batches at
once").

The graphs are the bundle's, loaded as export wrote them (export/build/step_graphs.py): this module never
edits a graph. The decoder step's search head returns each row's k best tokens and their log-probabilities
(k = 1 greedy, 2 × beam for beam search), never the whole distribution unless sampling from it, and then only
the sampling rows' (`whole_rows`). Every cache is bound by address, one layer at a time, as both the step's
input and its `present` output, so the attention writes the new K/V into the cache in place. On a CPU with
nmtserve's kernel library (export/runtime/kernels.py) the variant's `*_kernels` graphs run, and the step's
session is the library's, whose greedy and beam loops run their steps with no Python between them
(export/runtime/native.py); elsewhere the portable graphs, and the log says which and why. With io_binding
(the default on CUDA) the caches and cross K/V are OrtValues on the device, so a step sends the device only
the small per-row arrays and brings back only the candidates; without it they are numpy arrays.

Offline (shared_cross, the default) the `decoder_shared` step reads each source's one copy of its cross K/V
for all its rows: after a beam's first step the state is widened (BatchState.widen), and nothing copies the
cross K/V per row. The server's engine, whose steps mix rows of different widths, runs the `decoder` step
(shared_cross=False), each row with its own copy (BatchState.gather).
"""

from __future__ import annotations

import copy
import logging
import math
import queue
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from nmtserve.decoding import guided_groups, sorted_batches
from nmtserve.errors import BundleError, ConfigError
from nmtserve.export.runtime import kernels, memory
from nmtserve.export.runtime.batch import FRESH_SLOTS, BatchState, eos_of, own_slots
from nmtserve.export.runtime.bundle import Bundle, default_variant, load_bundle
from nmtserve.export.runtime.native import NativeBinding, NativeError, NativeSession
from nmtserve.export.runtime.tensors import DeviceTensors, HostTensors
from nmtserve.search import BeamSearch, DecodingOptions, Hypothesis, beam_steps, make_search

# Two decoding contexts over one CUDA device (serve --inter-threads 2, the pool's test on an H200,
# onnxruntime-gpu 1.31.1) gave requests GroupQueryAttention errors ("total_sequence_length must be
# positive, got 0") and cut-off tokens, with one decoder session each too; cause not found. One running
# batch is what a GPU wants anyway (docs/benchmarks.md, "GPU runs"), so on CUDA a model has one.
CUDA_INTER_THREADS = ("inter_threads {n} on cuda: one decoding context per model on a GPU (two at once gave wrong "
                      "tokens there; one running batch fills the GPU): use inter_threads 1")
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
# ONNX Runtime graph optimisations left out on CPU: SkipLayerNormFusion turns the int8 encoder's residual Add
# and LayerNormalization into SkipLayerNormalization, whose CPU kernel is slower than the two (encoder alone,
# 1 thread, 200 sentences: 32.1 against 39.3 ms at batch 8, 32.5 against 38.5 at 32; docs/performance.md, "The int8
# encoder without SkipLayerNormalization")
CPU_DISABLED_OPTIMIZERS = ["SkipLayerNormFusion"]
SPINNING = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}  # session_options says why
FALLBACK = "ONNX Runtime's own nodes"  # how the log and GetModelInfo name the portable graphs' kernels
ROW_INPUTS = ("tokens", "positions", "cross_slot")  # the decoder step's per-row inputs (export/build/graphs.py)
ENCODE_AHEAD = 64  # search_ids encodes batches of up to this many sources in all before decoding them
log = logging.getLogger("nmtserve.runtime")
_DEVICES: dict = {}  # ONNX Runtime's C-level device of each device name, made once (bind_address)


@dataclass
class Translation:
    text: str
    tokens: list[int]  # target ids, eos excluded
    score: float | None = None  # sum of the chosen tokens' log-probabilities (eos included; beam search:
    # divided by length ** length_penalty), if asked
    alternatives: list[Translation] = field(default_factory=list)  # the rest of the n-best list, best first

    @property
    def hypotheses(self) -> list[Translation]:
        """The n-best list, best first."""
        return [self, *self.alternatives]


def bind_address(binding: ort.IOBinding | NativeBinding, name: str, where: str, dtype, shape, address: int,
                 output: bool = False) -> None:
    """`binding.bind_input` (or `bind_output`) of a buffer at `address` on device `where`, through the
    binding's C object with a device made once per name: the Python wrappers make a new device on every
    call and keep bookkeeping for WebGPU graph capture only, which was half of the time of binding a new
    batch (docs/performance.md, "Binding a new batch"). A NativeBinding binds host memory."""
    if isinstance(binding, NativeBinding):
        assert where == "cpu", where
        binding.bind(name, dtype, shape, address, output)
        return
    device = _DEVICES.get(where)
    if device is None:
        device = _DEVICES[where] = ort.OrtDevice.make(where, 0)._get_c_device()
    (binding._iobinding.bind_output if output else binding._iobinding.bind_input)(name, device, dtype, shape, address)


def run_bound(session: ort.InferenceSession | NativeSession, binding: ort.IOBinding | NativeBinding) -> None:
    """`session.run_with_iobinding(binding)` through the session's C object: the Python wrapper looks up
    WebGPU graph capture on every call (a few µs of each decoder step: our Python between steps)."""
    if isinstance(binding, NativeBinding):
        binding.run()
    else:
        session._sess.run_with_iobinding(binding._iobinding, None)


def session_options(intra_op_threads: int = 0) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = intra_op_threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # no CPU arena: the arena keeps the largest buffers any shape ever needed, and the running batch's
    # shapes change every step. Measured with `nmtserve soak` (default bundle, 24 clients, 180 s):
    # resident memory peaked at 785 MB with it, 739 MB without memory patterns, 523 MB without the
    # arena, at the same throughput (docs/performance.md, "Memory under sustained traffic")
    so.enable_cpu_mem_arena = False
    # workers spin between the kernels of one run (a futex wake-up per parallel kernel cost 115 µs of
    # a 530 µs decoder step at batch 1) and stop when the run returns: a worker still spinning after
    # it holds a core that our Python between steps, and the other session's run, need. Offline greedy
    # with 2 threads on 2 cores, tok/s at batch 1/8/32/64 (docs/performance.md, "Spinning"): fp32 1,097/3,712/5,785/
    # 6,279 never spinning, 688/2,237/3,074/3,679 spinning always, 1,268/4,060/6,215/6,748 like this
    for key, value in SPINNING.items():
        so.add_session_config_entry(key, value)
    return so


def make_session(path: Path, device: str = "cpu", intra_op_threads: int = 0, custom_ops: Path | None = None,
                 initializers: dict[str, ort.OrtValue] | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session on `device` of the graph file at `path` as it is (with the custom-op library `custom_ops` registered, and `initializers` read from the caller's OrtValues in place
    of the graph's own, which the caller keeps alive); asking for CUDA and silently getting CPU is an error."""
    if device not in PROVIDERS:
        raise ConfigError(f"device {device!r}: choose cpu or cuda")
    if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ConfigError("device 'cuda': this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    options = session_options(intra_op_threads)
    if custom_ops is not None:
        options.register_custom_ops_library(str(custom_ops))
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    try:
        session = ort.InferenceSession(str(path), options,
                                       providers=PROVIDERS[device],
                                       disabled_optimizers=CPU_DISABLED_OPTIMIZERS if device == "cpu" else None)
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
        raise cannot_load(path, e) from None
    if session.get_providers()[0] != PROVIDERS[device][0]:
        raise ConfigError(f"{path}: asked for {device} but onnxruntime fell back to {session.get_providers()[0]}")
    return session


def cannot_load(path: Path, error: Exception) -> BundleError:
    return BundleError(f"{path}: onnxruntime cannot load it ({(str(error).splitlines() or [''])[0][:200]})")


class OnnxTranslator:
    """Encoder and decoder-step sessions of one bundle variant, and greedy search over them."""

    def __init__(self, bundle: str | Path | Bundle, device: str = "cpu", variant: str | None = None,
                 intra_op_threads: int = 0, io_binding: bool | None = None, shared_cross: bool = True,
                 inter_threads: int = 1, attention_kernel: bool | None = None, native_steps: bool | None = None,
                 keep_freed_memory: bool = True):
        if inter_threads < 1:
            raise ConfigError(f"inter_threads {inter_threads}: must be at least 1")
        if inter_threads > 1 and device == "cuda":
            raise ConfigError(CUDA_INTER_THREADS.format(n=inter_threads))
        self.inter_threads = inter_threads  # batches decoded at once (search_ids), each on a thread of its own
        if keep_freed_memory:  # glibc's malloc keeps freed caches for the next batch (process-wide: memory.py)
            memory.keep_freed_memory()
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        variant = variant or default_variant(device)  # fp32 on a CPU, fp16 on CUDA
        self.device, self.variant = device, variant
        self.io_binding = device == "cuda" if io_binding is None else io_binding
        devices = self.bundle.variant(variant).get("devices", [device])
        if device not in devices:
            raise ConfigError(f"variant {variant!r} runs on {' or '.join(devices)}, not {device}"
                              + (" (on cuda: the fp16 variant; ONNX Runtime's CUDA attention kernel has no fp32)"
                                 if device == "cuda" else ""))
        # the bundle's graphs on nmtserve's kernels (attention_kernel; None: wherever they can run) or portable
        self.attention_kernel, self.kernel_note, warn = self._choose_kernels(attention_kernel)
        # shared_cross: a beam's rows share their source's cross K/V (the `decoder_shared` graphs), as offline
        # search wants; the server's engine, whose steps mix rows of different widths, gives each row its own copy
        self.shared_cross = shared_cross
        suffix = "_kernels" if self.attention_kernel else ""
        self.graphs = ("encoder" + suffix, ("decoder_shared" if shared_cross else "decoder") + suffix)
        log.log(logging.WARNING if warn else logging.INFO, "%s %s on %s: graphs %s and %s (%s)", self.bundle.path,
                variant, device, *self.graphs, self.kernel_note)
        # the weights every graph holds (the tied embedding), one host copy read by both sessions
        self.shared_weights = self.bundle.shared_weights(variant)
        self._shared_values = {name: ort.OrtValue.ortvalue_from_numpy(w) for name, w in self.shared_weights.items()}
        custom_ops = kernels.LIBRARY if self.attention_kernel else None
        encoder_path, decoder_path = (self.bundle.graph_path(variant, name) for name in self.graphs)
        self.encoder = make_session(encoder_path, device, intra_op_threads, custom_ops=custom_ops,
                                    initializers=self._shared_values)
        # on nmtserve's kernels, a beam row that continues another's hypothesis points at that row's cache slots
        # instead of copying them (BatchState.origin; the kernel graphs' cache_origin input)
        self.cache_origin = self.attention_kernel
        # native_steps: the step's session held by nmtserve's library, greedy steps looping there without
        # Python between them (export/runtime/native.py); with the kernels (None), or as asked
        if native_steps and not self.attention_kernel:
            raise ConfigError("native_steps: the step's session in nmtserve's library needs its kernels, on a CPU, "
                              "without io_binding")
        self.native_steps = self.attention_kernel if native_steps is None else native_steps
        if self.native_steps:
            try:
                self.decoder = NativeSession(decoder_path.read_bytes(), intra_op_threads, self.shared_weights, {
                    **SPINNING, "optimization.disable_specified_optimizers": ",".join(CPU_DISABLED_OPTIMIZERS)})
            except NativeError as e:
                raise cannot_load(decoder_path, e) from None
        else:
            self.decoder = make_session(decoder_path, device, intra_op_threads, custom_ops=custom_ops,
                                        initializers=self._shared_values)
        self._binding, self._bound = self.decoder.io_binding(), {}  # see _binding_for
        self._with_scores = np.array(True)  # the step's with_scores input, bound by address
        self.kv_dtype = np.float16 if self.bundle.variant(variant).get("kv_dtype") == "float16" else np.float32
        self.ops = DeviceTensors(device, PROVIDERS[device], session_options(1), self.bundle.tensor_ops(variant)) \
            if self.io_binding else HostTensors
        self.tokenizer = self.bundle.tokenizer()
        m = self.bundle.model
        self.n_layers, self.n_heads, self.head_dim = m["n_decoder_layers"], m["n_heads"], m["d_model"] // m["n_heads"]
        self.d_model = m["d_model"]
        # the decoder step's buffers with a row each, bound by _binding_for (kinds for the library's compaction,
        # NativeBinding.greedy_run and beam_run: 0 rows, 1 a self-attention cache, 2 its origins, 3 a source's)
        layers = range(self.n_layers)
        self._row_names = tuple((f"{io}_{x}_{layer}", 1) for io in ("past", "present") for x in "kv" for layer in layers) \
            + tuple((f"{io}{x}_{layer}", 3) for io in ("", "present_") for x in ("cross_k", "cross_v", "cross_eos")
                    for layer in layers) \
            + (("cache_origin", 2), ("cross_slot", 3)) \
            + tuple((name, 0) for name in ("tokens", "positions", "candidate_ids", "candidate_scores"))
        self.eos_width = 2 * self.d_model  # a layer's cross_eos per row: the eos key, then its value
        self.vocab_size = m["vocab_size"]
        self.limits = self.bundle.limits
        ids = self.bundle.special_ids
        self.pad_id, self.bos_id, self.eos_id = ids["pad"], ids["bos"], ids["eos"]

    def _choose_kernels(self, asked: bool | None) -> tuple[bool, str, bool]:
        """Whether to run the variant's `*_kernels` graphs, why in words (for the log and GetModelInfo), and whether
        that is a fallback to warn of (a CPU where the library or the bundle's kernel graphs are missing).
        Asked for (True) where they cannot run: a ConfigError naming the reason."""
        if asked is False:
            return False, f"{FALLBACK}: nmtserve's kernels off as asked", False
        if self.device != "cpu":
            reason, warn = f"nmtserve's kernels run on a CPU, not {self.device}", False
        elif self.io_binding:
            reason, warn = "nmtserve's kernels run on host states, not with io_binding", False
        elif not self.bundle.has_graph(self.variant, "decoder_kernels"):
            reason, warn = f"the bundle's {self.variant} variant has no kernel graphs (export it again)", True
        else:
            reason, warn = kernels.unavailable(), True
        if reason is None:
            return True, "nmtserve's kernels", False
        if asked:
            raise ConfigError(f"attention_kernel: {reason}")
        return False, f"{FALLBACK}: {reason}", warn

    # -- the two graphs; K/V are stacked (L, B, H, T|S, Dh) here and fed one layer per input
    def encode(self, src_ids: np.ndarray, src_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """src_ids (B, S) int64, src_mask (B, S) bool -> cross_k, cross_v (L, B, H, S, Dh) and cross_eos
        (L, B, 2, H, Dh): each row's key and value at its last source slot."""
        outputs = self.encoder.run(None, {"src_ids": src_ids, "src_mask": src_mask})
        n, (batch, heads, _, head_dim) = self.n_layers, outputs[0].shape
        eos = np.stack(outputs[2 * n:]).reshape(n, batch, 2, heads, head_dim)
        return np.stack(outputs[0:2 * n:2]), np.stack(outputs[1:2 * n:2]), eos

    def step(self, tokens, positions, past_k, past_v, past_valid, cross_k, cross_v, src_mask):
        """One decoder step on plain arrays (the checks' form, as PyTorch's decode_step: past (L, B, H, T, Dh)
        with past_valid (B, T), cross (L, B, H, S, Dh)) -> log_probs (B, V), new_k, new_v (L, B, H, 1, Dh).
        Copies each row's valid slots to the front of a cache with room for the new one."""
        n_layers, batch, heads, _, head_dim = past_k.shape
        room = (n_layers, batch, heads, past_valid.shape[1] + 1, head_dim)
        k, v = np.zeros(room, self.kv_dtype), np.zeros(room, self.kv_dtype)
        filled = past_valid.sum(1)
        for row in range(batch):
            k[:, row, :, : filled[row]] = past_k[:, row][:, :, past_valid[row]]
            v[:, row, :, : filled[row]] = past_v[:, row][:, :, past_valid[row]]
        assert (np.asarray(positions) == filled).all(), "a row's position is the number of slots it has filled"
        cross_k, cross_v = (np.ascontiguousarray(x, self.kv_dtype) for x in (cross_k, cross_v))
        state = BatchState(k, v, cross_k, cross_v, eos_of(cross_k, cross_v, src_mask), np.ascontiguousarray(src_mask, bool),
                           filled.astype(np.int64), np.array(tokens, np.int64), np.zeros(batch, bool),
                           origin=own_slots(batch, room[3]) if self.cache_origin else None)
        self._with_scores[...] = True
        ids, scores = self._step(state, self.vocab_size)  # every token, best first
        log_probs = np.empty((batch, self.vocab_size), np.float32)
        np.put_along_axis(log_probs, ids, scores, axis=1)
        new_k = np.stack([k[:, row, :, filled[row]] for row in range(batch)], axis=1)[:, :, :, None]
        new_v = np.stack([v[:, row, :, filled[row]] for row in range(batch)], axis=1)[:, :, :, None]
        return log_probs, new_k, new_v

    # -- the same on the batch state, wherever its tensors live: callers never see K/V
    def prefill(self, sources: list[list[int]], caches: bool = True) -> BatchState:
        """Encode token-id sources once -> fresh rows for the decoder batch (on this translator's device).
        caches=False: their self-attention caches have no slots (rows that another state's `insert` or
        `append` takes, which read only their cross K/V)."""
        src_ids, src_mask = self.pad(sources)
        capacity = FRESH_SLOTS if caches else 0
        if not self.io_binding:
            cross_k, cross_v, eos = self.encode(src_ids, src_mask)
            return BatchState.from_encoded(cross_k, cross_v, eos, src_mask, self.bos_id, capacity,
                                           origin=self.cache_origin)
        batch, src_len = src_ids.shape
        shape = (self.n_layers, batch, self.n_heads, src_len, self.head_dim)
        cross_k, cross_v = self.ops.empty(shape, self.kv_dtype), self.ops.empty(shape, self.kv_dtype)
        eos = self.ops.empty((self.n_layers, batch, 2, self.n_heads, self.head_dim), self.kv_dtype)
        binding = self.encoder.io_binding()
        binding.bind_cpu_input("src_ids", src_ids)
        binding.bind_cpu_input("src_mask", src_mask)
        for prefix, stacked, layer_shape in (("cross_k", cross_k, shape[1:]), ("cross_v", cross_v, shape[1:]),
                                             ("cross_eos", eos, (batch, self.eos_width))):
            for layer, address in enumerate(self._layer_addresses(stacked)):
                bind_address(binding, f"{prefix}_{layer}", self.device, self.kv_dtype, layer_shape, address, output=True)
        run_bound(self.encoder, binding)
        return BatchState.from_encoded(cross_k, cross_v, eos, src_mask, self.bos_id, capacity, ops=self.ops)

    def decode_one_token(self, state: BatchState) -> tuple[np.ndarray, np.ndarray]:
        """One greedy step of every row -> tokens (B,) int64 and their log-probs (B,); the step's K/V
        are written into `state`, and every row but the holes advances (a hole's token is meaningless)."""
        ids, scores = self.decode_candidates(state, 1)
        state.choose(ids[:, 0])
        return ids[:, 0], scores[:, 0]

    def decode_candidates(self, state: BatchState, k: int, scores: bool = True, whole: np.ndarray | None = None) \
            -> tuple[np.ndarray, ...]:
        """One step of every row -> its k best next tokens (B, k) int64 and their log-probs (B, k), best
        first (k = 0: None and every row's log-probs over the vocabulary (B, V), unranked); scores=False
        (k = 1 only): the best by the values before the log-softmax, which the step skips, and the scores are
        those values (`with_search_head`). With `whole` (R,) int64, rows that need the whole vocabulary among
        rows that need k (a sampler without top-k in the server's batch): those rows' log-probs over the
        vocabulary (R, V) as a third value, unranked. The step's K/V are written into `state`; the caller then
        picks each row's next token, and for a beam its parent row, with `state.choose`."""
        if not scores and (k != 1 or whole is not None):
            raise ValueError(f"k {k}, whole rows {None if whole is None else whole.tolist()}: a step without scores "
                             "gives each row's one best token only (k = 1, no whole rows)")
        state.open_slot()
        self._with_scores[...] = scores
        if k == 0:  # a sampler draws from them unranked (Sampling.step), as in the server's batch
            self._step(state, 1, np.arange(state.size))
            state.advance()
            return None, self._whole.copy()
        ids, scores = self._step(state, k, whole)
        state.advance()
        return (ids, scores) if whole is None else (ids, scores, self._whole.copy())

    def decode_greedy_steps(self, state: BatchState, steps: int, scores: bool = True, stop: np.ndarray | None = None,
                            stop_at: float = 0.0) -> tuple[np.ndarray, np.ndarray | None]:
        """(native_steps only) Greedy steps of every row in the library, each row fed its own best token, until
        a step in which a row (not a hole) says eos, `steps` steps, the cache's end, or a stop asked for
        (`NativeBinding.greedy_steps`: `stop` flag, `stop_at`) -> each step's tokens (n, B) int64 and, with
        scores, their log-probs (n, B) float32 (without: None). The K/V and positions advance as with
        `decode_one_token` n times; `state.tokens` ends as the last step's tokens."""
        state.open_slot()
        self._with_scores[...] = scores
        binding = self._greedy_binding(state)
        steps = steps if steps == 1 else min(steps, state.capacity - state.length)  # open_slot made room for one
        return self._native_greedy_steps(state, binding, steps, scores, stop, stop_at)

    def _native_greedy_steps(self, state: BatchState, binding: NativeBinding, steps: int, scores: bool,
                             stop: np.ndarray | None = None, stop_at: float = 0.0) -> tuple[np.ndarray, np.ndarray | None]:
        out = np.empty((steps, state.size), np.int64)
        out_scores = np.empty(out.shape, np.float32) if scores else None
        taken = binding.greedy_steps(state.tokens, state.positions, self._scores, self.eos_id, out, out_scores,
                                     state.hole if state.holes else None, stop, stop_at)
        return out[:taken], None if out_scores is None else out_scores[:taken]

    def _step(self, state: BatchState, k: int, whole: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """candidate ids and their scores (B, k) on the host, scored as `_with_scores` says (and the `whole`
        rows' log-probs over the vocabulary in `_whole`). Every cache is bound as both the input and the
        `present` output of its layer, so the step writes the new K/V into `state`'s own buffers, wherever
        they live (`_binding_for`)."""
        binding = self._binding_for(state, k, whole=whole)
        run_bound(self.decoder, binding)
        return self._ids.copy(), self._scores.copy()

    def _binding_for(self, state: BatchState, k: int, greedy: bool = False, whole: np.ndarray | None = None) \
            -> ort.IOBinding | NativeBinding:
        """The decoder's binding for a step of `state` asking for k candidates. A binding holds addresses,
        so it is kept from step to step and a group is bound again only when its objects change (`_bound`
        holds weak references to them): the caches (each layer as input and `present` output, with their
        slot counts; with shared_cross the cross K/V as inputs only), the per-row arrays (tokens, positions,
        cross_slot: BatchState changes them in place), and the outputs (candidates into buffers of (B, k),
        with the `candidates` and `with_scores` inputs: the callers set the flag; greedy: k = 1 and each
        row's best token straight into `state.tokens`, `_greedy_binding`; the `whole` rows, none by default,
        and their log-probs over the vocabulary into `_whole`). Host inputs of
        a session on a device are copied to it when bound, so there the per-row arrays (and host caches)
        are bound every step (a translator serves one thread at a time)."""
        binding, bound, shared = self._binding, self._bound, self.shared_cross
        caches = (state.k, state.v, state.cross_k, state.cross_v, state.cross_eos) \
            + (() if state.origin is None else (state.origin,))
        where = state.ops.device  # host arrays are host memory to every session (io_binding off on CUDA too)
        copied_when_bound = where != self.device
        if copied_when_bound or not _same(bound.get("caches"), caches):
            for name, x in zip(("k", "v", "cross_k", "cross_v"), caches):
                shape = state.ops.shape(x)[1:]
                for layer, address in enumerate(self._layer_addresses(x)):
                    inputs = f"past_{name}_{layer}" if name in ("k", "v") else f"{name}_{layer}"
                    bind_address(binding, inputs, where, self.kv_dtype, shape, address)
                    if not (shared and name.startswith("cross")):
                        bind_address(binding, f"present_{name}_{layer}", where, self.kv_dtype, shape, address, output=True)
            if not shared:
                for layer, address in enumerate(self._layer_addresses(state.cross_eos)):
                    bind_address(binding, f"cross_eos_{layer}", where, self.kv_dtype, (state.size, self.eos_width),
                                 address)
            self._slot_counts = np.array([state.capacity, state.ops.shape(state.cross_k)[3]], np.int32)
            for i, name in enumerate(("cache_slots", "source_slots")):  # the attention kernel's total_sequence_length
                bind_address(binding, name, "cpu", np.int32, (1,), self._slot_counts.ctypes.data + 4 * i)  # host memory
            if self.cache_origin:
                bind_address(binding, "cache_origin", "cpu", np.int32, state.origin.shape, state.origin.ctypes.data)
            if shared:  # each source's rows, for the cross-attention's queries
                self._query_shape = np.array([-1, state.width, self.d_model], np.int64)
                bind_address(binding, "query_shape", "cpu", np.int64, (3,), self._query_shape.ctypes.data)
            bound["caches"] = _refs(caches)
        rows, rebound = (state.tokens, state.positions, state.cross_slot), True
        if self.io_binding or copied_when_bound:
            for name, x in zip(ROW_INPUTS, rows):
                binding.bind_cpu_input(name, np.ascontiguousarray(x))
        elif not _same(bound.get("rows"), rows):
            for name, x in zip(ROW_INPUTS, rows):
                assert x.flags.c_contiguous, name
                bind_address(binding, name, "cpu", x.dtype, x.shape, x.ctypes.data)
            bound["rows"] = _refs(rows)
        else:
            rebound = False
        wholes, new_outputs = 0 if whole is None else len(whole), False
        if bound.get("outputs") != (state.size, k, greedy, wholes) or greedy and rebound:  # greedy: into state.tokens
            self._ids, self._scores = np.empty((state.size, k), np.int64), np.empty((state.size, k), np.float32)
            self._k = np.array([k], np.int64)
            self._whole_rows, self._whole = np.zeros(wholes, np.int64), np.empty((wholes, self.vocab_size), np.float32)
            bind_address(binding, "candidates", "cpu", np.int64, (1,), self._k.ctypes.data)
            bind_address(binding, "with_scores", "cpu", np.bool_, (), self._with_scores.ctypes.data)  # host memory
            for name, x in (("candidate_ids", state.tokens.reshape(-1, 1) if greedy else self._ids),
                            ("candidate_scores", self._scores), ("whole_log_probs", self._whole)):
                bind_address(binding, name, "cpu", x.dtype, x.shape, x.ctypes.data, output=True)
            bound["outputs"], new_outputs = (state.size, k, greedy, wholes), True
        if wholes:
            self._whole_rows[:] = whole  # in place: on the host the binding reads it there
        if new_outputs or wholes and self.device != "cpu":  # a device's session copies it when bound
            bind_address(binding, "whole_rows", "cpu", np.int64, (wholes,), self._whole_rows.ctypes.data)
        return binding

    def _layer_addresses(self, stacked) -> list[int]:
        """The address of each layer of a stacked (L, …) tensor (host numpy or device OrtValue): bound
        by address, nothing is copied. A host tensor may be the first rows of a larger one (`BatchState.compact`):
        each layer is still one contiguous block."""
        if isinstance(stacked, np.ndarray):
            assert stacked[0].flags.c_contiguous and stacked.dtype == self.kv_dtype
            base, stride = stacked.ctypes.data, stacked.strides[0]
        else:
            base, stride = stacked.data_ptr(), stacked.tensor_size_in_bytes() // self.n_layers
        return [base + layer * stride for layer in range(self.n_layers)]

    def empty_cache(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A zero-length cache (k, v, valid), for callers that concatenate."""
        shape = (self.n_layers, batch, self.n_heads, 0, self.head_dim)
        return np.zeros(shape, self.kv_dtype), np.zeros(shape, self.kv_dtype), np.zeros((batch, 0), bool)

    # -- search
    def pad(self, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Token-id sources -> ids (B, S) int64 padded, and their mask. An id outside the vocabulary is a
        ValueError naming it: ONNX Runtime's CPU Gather refuses it, but CUDA's would read out of bounds."""
        ids = np.full((len(seqs), max(len(s) for s in seqs)), self.pad_id, dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        outside = ids[(ids < 0) | (ids >= self.vocab_size)]
        if outside.size:
            raise ValueError(f"source token id {int(outside[0])} is out of the vocabulary (0 to {self.vocab_size - 1})")
        return ids, ids != self.pad_id

    def greedy(self, state: BatchState, sources: list[list[int]], max_decoding_length: int = 256,
               length_rule: str = "nmtserve", scores: bool = True) -> list[list[Hypothesis]]:
        """Greedy search for one batch of token-id sources, encoded in `state` (`prefill`). A finished row
        stays in the batch, decoding on with its output ignored, until such rows are a quarter of the
        batch; then they leave together (`BatchState.compact`: the last rows move into their places, once
        instead of at every step where a row finishes).
        Each step's best token is written straight into the step's `tokens` input (`_greedy_binding`), so
        between two steps our Python only records it, advances the positions and looks for eos. With
        native_steps the library does all of that, the compaction included, and Python comes back only to
        double a full cache (`_native_greedy`); a batch of one there: `_greedy_one`. The Python loop (ONNX
        Runtime's own attention: no kernels, or CUDA) keeps every row at one position, which that attention
        steps faster than rows at mixed ones. Without scores the steps skip the log-softmax
        (`with_search_head`) and each score is nan."""
        if len(sources) == 1 and self.native_steps:
            return [[self._greedy_one(state, sources[0], max_decoding_length, length_rule, scores)]]
        budget = np.array([self.limits.output_budget(len(s), max_decoding_length, length_rule) for s in sources])
        if self.native_steps:
            return self._native_greedy(state, budget, scores)
        rows = np.arange(len(sources))  # the source of each row of `state` (budget: each one's)
        steps = [], [], []  # per step: each row's source, token and (when scored) log-prob
        finished, end = np.zeros(len(sources), bool), np.zeros(len(sources), np.int64)  # end: its last step
        done = np.zeros(len(rows), bool)  # the rows of `state` whose source has finished (they leave together)
        binding, rebind = None, self.io_binding or state.ops.device != self.device  # rows bound by value: every step
        self._with_scores[...] = scores
        while state is not None:
            if binding is None or rebind or len(steps[0]) == state.capacity:  # a new state, or its cache full
                state.open_slot()
                binding = self._greedy_binding(state)
            run_bound(self.decoder, binding)
            state.positions += 1  # every row: offline batches have no holes
            tokens = state.tokens.copy()
            steps[0].append(rows)
            steps[1].append(tokens)
            if scores:  # unscored steps' values are not kept: each score is nan
                steps[2].append(self._scores.copy())
            said_eos, at = (tokens == self.eos_id) & ~done, len(steps[0]) - 1
            done |= said_eos
            over = (state.positions >= budget) & ~done  # live rows at their budget (after the run's last step)
            if not (said_eos.any() or over.any()):
                continue  # most Python steps: a few ufuncs (Python here runs on caches the step has flushed)
            finished[rows[said_eos]], end[rows[said_eos]] = True, at
            finished[rows[over]], end[rows[over]] = True, len(steps[0]) - 1
            done |= over
            if done.sum() * 4 >= len(rows):  # compact: the last rows move into the finished ones' places
                state, order = state.compact(~done)
                rows, budget, done = rows[order], budget[order], np.zeros(len(order), bool)
                binding = None
        return self._collect(len(sources), steps[0], steps[1], [s.ravel() for s in steps[2]], end)

    def _native_greedy(self, state: BatchState, budget: np.ndarray, scores: bool) -> list[list[Hypothesis]]:
        """`greedy` on the library: its steps, and the finished rows leaving the batch, all there
        (`NativeBinding.greedy_run`); Python comes back only when the cache is full, to double it. Each step's
        tokens (and log-probs) land in their source's column, and a source's hypothesis is its tokens up to the
        step at which it finished, eos excluded, its score their sum (as `_collect`'s)."""
        assert not state.holes and state.origin is not None
        n = state.size
        source, budget = np.arange(n, dtype=np.int64), budget.astype(np.int64)  # moved with the rows by the library
        end, by_eos = np.full(n, -1, np.int64), np.zeros(n, np.uint8)
        tokens, values, stepped = [], [], 0
        self._with_scores[...] = scores
        while state is not None:
            state.open_slot()
            binding = self._greedy_binding(state)
            room = state.capacity - stepped  # the live rows are all at `stepped`: open_slot made room for one
            out = (np.zeros((room, n), np.int64), np.zeros((room, n), np.float32) if scores else None, end, by_eos)
            before = source[:state.size].copy()
            taken, rows = binding.greedy_run(state.size, state.tokens, state.positions, self._scores, source, budget,
                                             self.eos_id, self._row_names, stepped, out)
            tokens.append(out[0][:taken])
            if scores:
                values.append(out[1][:taken])
            stepped += taken
            if rows < state.size:  # the library bound the fewer rows itself: what _bound holds is stale
                self._bound.clear()
            if 0 < rows < state.size:  # the library moved the rows left into the first places (greedy_run)
                index = np.empty(n, np.int64)
                index[before] = np.arange(len(before))
                state = state.moved_in_place(index[source[:rows]], cross_eos_moved=not self.shared_cross)
            elif rows == 0:
                state = None
        tokens = np.concatenate(tokens).T.tolist()  # per source
        values = np.concatenate(values).T.tolist() if scores else None
        return [[Hypothesis(t[:e] if eos else t[:e + 1], sum(values[s][:e + 1]) if scores else math.nan,
                            "eos" if eos else "length")]
                for s, (t, e, eos) in enumerate(zip(tokens, end.tolist(), by_eos.tolist()))]

    def _greedy_one(self, state: BatchState, source: list[int], max_decoding_length: int, length_rule: str,
                    scores: bool) -> Hypothesis:
        """`greedy` of a batch of one on the library, without the bookkeeping of rows that finish apart: runs
        until its eos or its budget, the cache doubling (and bound again) when full. Its score is the sum of its
        steps' log-probs, eos included, in step order (as `_collect`'s)."""
        budget = self.limits.output_budget(len(source), max_decoding_length, length_rule)
        tokens, values = [], []
        self._with_scores[...] = scores
        while not tokens or tokens[-1] != self.eos_id and len(tokens) < budget:
            state.open_slot()
            binding = self._greedy_binding(state)
            out, out_scores = self._native_greedy_steps(state, binding, min(state.capacity, budget) - len(tokens), scores)
            tokens += out[:, 0].tolist()
            values += out_scores[:, 0].tolist() if scores else []
        eos = tokens[-1] == self.eos_id
        return Hypothesis(tokens[:-1] if eos else tokens, sum(values) if scores else math.nan, "eos" if eos else "length")

    def _greedy_binding(self, state: BatchState) -> ort.IOBinding | NativeBinding:
        """The step's binding for greedy search, with its candidate_ids output bound to the `tokens` input's
        own buffer: the step's search head, its last node, writes each row's best token where the next step
        reads it (the embedding's Gather, the first node and only reader of `tokens`, is done by then)."""
        return self._binding_for(state, 1, greedy=True)

    def _collect(self, n: int, rows: list, tokens: list, scores: list, end: np.ndarray) -> list[list[Hypothesis]]:
        """Greedy's hypotheses from what each step chose: source s's tokens are those of its rows up to
        its last step end[s], eos excluded; its score is their sum (nan when the steps kept no scores:
        `scores` empty)."""
        step = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
        rows, tokens = np.concatenate(rows), np.concatenate(tokens)
        kept = step <= end[rows]
        rows, tokens = rows[kept], tokens[kept]
        total = np.bincount(rows, weights=np.concatenate(scores)[kept], minlength=n) if scores else np.full(n, np.nan)
        eos = np.zeros(n, bool)
        eos[rows[tokens == self.eos_id]] = True
        order = np.argsort(rows, kind="stable")  # by source, then step
        rows, tokens = rows[order], tokens[order]
        text = [t[t != self.eos_id].tolist() for t in np.split(tokens, np.searchsorted(rows, np.arange(1, n)))]
        return [[Hypothesis(o, s, "eos" if e else "length")] for o, s, e in zip(text, total.tolist(), eos)]

    def search(self, state: BatchState, sources: list[list[int]], options: DecodingOptions) -> list[list[Hypothesis]]:
        """Beam search or sampling for one batch of token-id sources, encoded in `state` (`prefill`;
        nmtserve/search.py: one search per source, over its own rows). A finished source's rows decode
        on, ignored, until finished sources are a quarter of the batch; then their rows leave together
        (as greedy's). With native_steps beam search runs in the library after its first step, the finished
        sources leaving there too (`_native_beam_run`)."""
        searches = [make_search(options, self.limits.output_budget(len(s), options.max_decoding_length,
                                                                   options.length_rule), self.eos_id)
                    for s in sources]
        width, k = searches[0].rows, searches[0].candidates
        beams = isinstance(searches[0], BeamSearch)
        # beam steps in the library, after the first (on the step that shares each source's cross K/V)
        native = beams and self.native_steps and self.cache_origin and self.shared_cross
        slots = list(range(len(sources)))  # the source each `width` rows search for, in row order
        while state is not None:
            if native and state.size == width * len(slots):  # after the first step
                state, slots, pending = self._native_beam_run(state, searches, slots, width)
                if state is None:
                    break
                ids, scores = self._ids[:state.size], self._scores[:state.size]  # a pending step's candidates
            else:
                (ids, scores), pending = self.decode_candidates(state, k), True
            live = [None if searches[r].done else searches[r] for r in slots]  # each slot's search, None once done
            if pending:  # a step for Python to choose
                if state.size < width * len(slots):  # the first step, one row per source (a beam's rows all
                    # start alike and its search reads row 0 only): then each row becomes its beam's rows
                    ids, scores = np.repeat(ids, width, axis=0), np.repeat(scores, width, axis=0)
                    # with shared_cross the rows share their source's cross K/V; else each gets a copy
                    state = state.widen(width) if self.shared_cross \
                        else state.gather(np.repeat(np.arange(len(sources)), width))
                if beams:  # ranked once for all sources (nmtserve/search.py: beam_steps)
                    parents, tokens = beam_steps(live, ids, scores)
                else:
                    # a finished source's rows decode on (on eos when the step ranked nothing: k = 0)
                    tokens = np.full(state.size, self.eos_id) if ids is None else ids[:, 0].copy()
                    parents = np.arange(state.size)
                    for j, search in enumerate(live):
                        if search is not None:
                            rows = slice(j * width, (j + 1) * width)
                            chosen_parents, tokens[rows] = search.step(None if ids is None else ids[rows], scores[rows])
                            parents[rows] = chosen_parents + j * width
                state.choose(tokens, parents)
            done = np.array([searches[r].done for r in slots])
            if done.sum() * 4 >= len(slots):  # compact, as greedy does
                state, order = state.compact(np.repeat(~done, width))
                slots = [slots[j] for j in order[::width] // width]
        return [search.results() for search in searches]

    def _native_beam_run(self, state: BatchState, searches: list[BeamSearch], slots: list[int], k: int) \
            -> tuple[BatchState | None, list[int], bool]:
        """Beam search in the library (NativeBinding.beam_run) until every search is over, the cache's end, or a
        step it leaves to Python, whose candidates it leaves in the step's outputs; the searches that are over
        leave the batch there. Each search then takes the steps the library chose for it, from the library's
        candidates: an ordinary step (`BeamSearch.ordinary`) by `BeamSearch.advance`, any other by
        `BeamSearch.select`; its choices, finished hypotheses and stop must be the library's, or this is a
        RuntimeError -> the state of the searches left (None: none), the source of each, in row order, and
        whether a step awaits Python (`beam_steps`, `state.choose`)."""
        state.open_slot()
        self._with_scores[...] = True
        binding = self._binding_for(state, 2 * k)
        steps, n = state.capacity - state.length, len(searches)
        lines = np.array([s.native_line() for s in searches], np.int64)
        finished_best = np.array([s.best_finished() for s in searches])
        beam = np.concatenate([np.zeros(k) if searches[r].done else searches[r].scores for r in slots])
        search_of = np.array(slots, np.int64)
        # zeros: the candidates of a search the library stopped are not written (the checks below catch a replay of them)
        out = (np.zeros((steps, n, 2 * k), np.int64), np.zeros((steps, n, 2 * k), np.int64),
               np.zeros((steps, n, 2 * k)), np.zeros((steps, n, k), np.int64), np.zeros((steps, n, k), np.int64))
        taken, groups, pending = binding.beam_run(len(slots), self._ids, self._scores, state.tokens, state.positions,
                                                  state.origin, beam, search_of, lines, finished_best,
                                                  searches[0].options.length_penalty, k, self.eos_id, self._row_names,
                                                  out)
        cand_rows, cand_ids, cand_scores, parents, tokens = (x[:taken] for x in out)
        finishing = (cand_ids[:, :, :k] == self.eos_id).any(axis=2).T.tolist()  # (n, steps)
        best_rows, best_ids = (x[:, :, :k].transpose(1, 0, 2).tolist() for x in (cand_rows, cand_ids))  # (n, steps, k)
        for j, search in enumerate(searches):
            for step in range(taken):
                if search.done:  # stopped at an earlier step (or before the run)
                    break
                if search.ordinary(finishing[j][step]):
                    search.advance(best_rows[j][step], best_ids[j][step], cand_scores[step, j, :k])
                    continue
                chosen, fed = search.select(cand_rows[step, j], cand_ids[step, j], cand_scores[step, j])
                if not (np.array_equal(chosen, parents[step, j]) and np.array_equal(fed, tokens[step, j])):
                    raise RuntimeError(f"beam search in the library chose rows {parents[step, j]} and tokens "
                                       f"{tokens[step, j]}, its rules in Python {chosen} and {fed}")
            if search.done != (lines[j, 0] < 0) or len(search.finished) != lines[j, 2]:
                raise RuntimeError(f"beam search in the library has {lines[j, 2]} hypotheses finished and "
                                   f"{'stopped' if lines[j, 0] < 0 else 'goes on'}; its rules in Python "
                                   f"{len(search.finished)}, and {'stopped' if search.done else 'go on'}")
        left = search_of[:groups].tolist()
        if groups == len(slots):
            return state, left, pending
        self._bound.clear()  # the library bound the fewer rows itself: what _bound holds is stale
        if groups == 0:
            return None, [], False
        place = {source: j for j, source in enumerate(slots)}  # the library moved the searches left into the first places
        return state.moved_in_place(np.array([place[r] for r in left]), cross_eos_moved=False), left, pending

    def search_ids(self, sources: list[list[int]], options: DecodingOptions = DecodingOptions(), *,
                   max_batch_size: int = 32, scores: bool = True) -> list[list[Hypothesis]]:
        """The n-best hypotheses of each token-id source, best first; sources are batched by sorted length,
        at most max_batch_size sources (each with its beam's rows) per batch. scores=False: greedy search
        skips the log-softmax and scores nothing (each score nan); beam search and sampling always score."""
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size {max_batch_size}: must be at least 1")
        options.check(self.vocab_size)
        results: list = [None] * len(sources)
        batches = list(sorted_batches([len(s) for s in sources], max_batch_size, self.inter_threads))
        # a group encoded (in one call: _prefill_group), then decoded batch after batch: each graph's weights stay
        # in the CPU cache from one run to the next (both graphs' may not fit together: the default model's 25 MB
        # against a 2-core AVX2 host's 16 MB L3; +4-5% at batch 1, +1-3% at 8, none from 32 on); on threads, the
        # groups shrink towards the end so that the threads finish about together
        groups = guided_groups(batches, max(1, ENCODE_AHEAD // max_batch_size), self.inter_threads)
        if self.inter_threads == 1 or len(groups) == 1:
            for group in groups:
                self._decode_group(group, sources, options, results, scores)
            return results
        replicas = queue.SimpleQueue()  # one decoding context per thread; a thread takes the next group
        for _ in range(self.inter_threads):
            replicas.put(self.replica())

        def decode(group):
            replica = replicas.get()
            try:
                replica._decode_group(group, sources, options, results, scores)
            finally:
                replicas.put(replica)
        with ThreadPoolExecutor(min(self.inter_threads, len(groups)), thread_name_prefix="nmtserve-batch") as pool:
            list(pool.map(decode, groups))  # raises the first error of any group
        return results

    def _decode_group(self, group: list[list[int]], sources: list[list[int]], options: DecodingOptions,
                      results: list, scores: bool) -> None:
        """Encode a group of batches (each a list of source indices), then decode them one after another into
        results."""
        group_sources = [[sources[i] for i in rows] for rows in group]
        states = self._prefill_group(group_sources)
        for rows, batch in zip(group, group_sources):
            state = states.pop(0)  # the list lets go of it: its caches are freed once decoded
            for i, hypotheses in zip(rows, self.decode(state, batch, options, scores)):
                results[i] = hypotheses

    def _prefill_group(self, batches: list[list[list[int]]]) -> list[BatchState]:
        """Fresh states for several batches of token-id sources. On the host one encoder call for all of them
        (the graph runs on their real tokens only), each batch's cross K/V a view of its rows of the group's:
        a call's fixed cost (~0.12 ms on the default model in int8) is paid once rather than per batch, 7% of
        a sentence at batch 1. On a device (an OrtValue is not a view) one call per batch."""
        if len(batches) == 1 or not self.ops.views:
            return [self.prefill(batch) for batch in batches]
        whole = self.prefill([source for batch in batches for source in batch], caches=False)
        states, start = [], 0
        for batch in batches:
            rows = slice(start, start + len(batch))
            start = rows.stop
            states.append(BatchState.from_encoded(whole.cross_k[:, rows], whole.cross_v[:, rows],
                                                  whole.cross_eos[:, rows], whole.src_mask[rows], self.bos_id,
                                                  origin=self.cache_origin))
        return states

    def decode(self, state: BatchState, sources: list[list[int]], options: DecodingOptions,
               scores: bool = True) -> list[list[Hypothesis]]:
        """One batch of token-id sources, encoded in `state` (`prefill`), decoded as options say: `greedy`,
        or `search` (beam search, sampling)."""
        if options.greedy:
            return self.greedy(state, sources, options.max_decoding_length, options.length_rule, scores)
        return self.search(state, sources, options)

    def replica(self) -> OnnxTranslator:
        """This translator with a decoding context of its own (decoder binding and bound buffers) over the
        same sessions, tokenizer and bundle: one per thread decoding at once (inter_threads here, the
        server's --inter-threads). Not on CUDA (CUDA_INTER_THREADS)."""
        if self.device == "cuda":
            raise ConfigError(CUDA_INTER_THREADS.format(n=2))
        replica = copy.copy(self)
        replica._binding, replica._bound = self.decoder.io_binding(), {}
        replica._with_scores = np.array(True)
        return replica

    def translate_ids(self, sources: list[list[int]], *, max_batch_size: int = 32,
                      max_decoding_length: int = 256) -> list[tuple[list[int], float]]:
        """Greedy (tokens, score) for token-id sources, batched by sorted length."""
        found = self.search_ids(sources, DecodingOptions(max_decoding_length=max_decoding_length),
                                max_batch_size=max_batch_size)
        return [(best.tokens, best.score) for best, in found]

    def translate_batch(self, texts: list[str], *, max_batch_size: int = 32, beam_size: int = 1,
                        num_hypotheses: int = 1, length_penalty: float = 0.0, patience: float = 1.0,
                        sampling_topk: int = 1, sampling_topp: float = 1.0, sampling_temperature: float = 1.0,
                        seed: int = 0, max_decoding_length: int = 256, beam_stopping: str = "ctranslate2",
                        length_rule: str = "nmtserve", return_scores: bool = False) -> list[Translation]:
        """Translate texts, with CTranslate2's decoding options (nmtserve/search.py says what each does):
        greedy by default, beam search with beam_size > 1, random sampling with sampling_topk != 1. Each
        Translation is the best hypothesis, with the rest of the n-best list in `alternatives`. Inputs are
        sorted by length so that each batch has little padding."""
        options = DecodingOptions(beam_size, num_hypotheses, length_penalty, patience, sampling_topk, sampling_topp,
                                  sampling_temperature, seed, max_decoding_length, beam_stopping, length_rule)
        ids = [self.tokenizer.encode(t, self.limits.max_source_tokens) or [self.eos_id] for t in texts]
        found = self.search_ids(ids, options, max_batch_size=max_batch_size, scores=return_scores)
        return [self._translation(hypotheses, return_scores) for hypotheses in found]

    def _translation(self, hypotheses: list[Hypothesis], return_scores: bool) -> Translation:
        best, *rest = [Translation(self.tokenizer.decode(h.tokens), h.tokens, h.score if return_scores else None)
                       for h in hypotheses]
        best.alternatives = rest
        return best


def _same(bound: tuple | None, objects: tuple) -> bool:
    """Whether `bound` (weak references) refers to exactly these objects, all alive: the same objects are
    the same buffers, and a dead one's address may have been reused."""
    if bound is None:
        return False
    for ref, x in zip(bound, objects):  # a plain loop: asked at every step
        if ref() is not x:
            return False
    return True


def _refs(objects: tuple) -> tuple:
    """Weak references to a bound group: the binding does not keep a finished batch's tensors alive."""
    return tuple(weakref.ref(x) for x in objects)
