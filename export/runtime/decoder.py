"""The decoder of one bundle variant: its encoder and decoder-step sessions, and the steps over a batch's state
(prefill, decode candidates, greedy steps, a batch's whole greedy run or whole searches), which the engine
drives, served and offline. Never edits a graph and never chooses a search (it runs the searches it is given).

The graphs are the bundle's, loaded as export wrote them (export/build/step_graphs.py). The decoder step's
search head returns each row's k best tokens and their log-probabilities (k = 1 greedy, 2 × beam for beam
search), never the whole distribution unless a search ranks it itself, and then only its rows' logits
(`whole_rows`: a sampler without top-k, disabled tokens, a repetition penalty). Every cache is bound by
address, one layer at a time, as both the step's input and its `present` output, so the attention writes the
new K/V into the cache in place. On a CPU with nmtserve's kernel library (kernels.py) the variant's `*_kernels` graphs run, and the step's session is the library's,
whose loops run greedy and beam steps with no Python between them (native.py); elsewhere the portable graphs,
and the log says which and why. With io_binding (the default on CUDA) the caches and cross K/V are OrtValues
on the device, so a step sends the device only the small per-row arrays and brings back only the candidates;
without it they are numpy arrays.

shared_cross (offline) loads the `decoder_shared` step, which reads each source's one copy of its cross K/V for
all its rows (after a beam's first step the state is widened: BatchState.widen); the server's engine, whose
steps mix rows of different widths, loads the `decoder` step (shared_cross=False), each row with its own copy
(BatchState.gather).
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from nmtserve.decoding import by_length
from nmtserve.errors import ConfigError
from nmtserve.export.runtime import kernels, memory
from nmtserve.export.runtime.aligner import Aligner, padded
from nmtserve.export.runtime.batch import FRESH_SLOTS, BatchState, eos_of, own_slots
from nmtserve.export.runtime.bundle import Bundle, default_variant, load_bundle
from nmtserve.export.runtime.native import Continuing, NativeBinding, NativeError, NativeSession
from nmtserve.export.runtime.ranker import Ranker
from nmtserve.export.runtime.sessions import (
    CPU_DISABLED_OPTIMIZERS,
    EXTERNAL_DATA_FOLDER,
    PROVIDERS,
    SPINNING,
    bind_address,
    cannot_load,
    make_session,
    run_bound,
    same_objects,
    session_options,
    weak_refs,
)
from nmtserve.export.runtime.tensors import DeviceTensors, HostTensors
from nmtserve.sampling import Sampling
from nmtserve.search import BeamSearch, beam_steps
from nmtserve.tokenizer import word_continuations

# two decoding contexts over one CUDA device gave wrong tokens there (GroupQueryAttention errors), and one running
# batch fills a GPU anyway (docs/performance-journal.md, "GPU runs"): on CUDA a model has one
CUDA_INTER_THREADS = ("inter_threads {n} on cuda: one decoding context per model on a GPU (two at once gave wrong "
                      "tokens there; one running batch fills the GPU): use inter_threads 1")
FALLBACK = "ONNX Runtime's own nodes"  # how the log and GetModelInfo name the portable graphs' kernels
# source slots (rows × padded length) per encoder call at most: the activations of a call beside its outputs
ENCODER_TOKENS = 1024
# the decoder step's per-row inputs (export/build/graphs.py; last_position: step_graphs.with_stop_rule)
ROW_INPUTS = ("tokens", "positions", "cross_slot", "last_position")
NO_BUDGET = np.iinfo(np.int64).max  # the last position of a row no length stops (a search's: its rules stop it)
log = logging.getLogger("nmtserve.runtime")


class Decoder:
    """Encoder and decoder-step sessions of one bundle variant, and the steps over a batch's state."""

    def __init__(self, bundle: str | Path | Bundle, device: str = "cpu", variant: str | None = None,
                 intra_op_threads: int = 0, io_binding: bool | None = None, shared_cross: bool = True,
                 attention_kernel: bool | None = None, native_steps: bool | None = None, keep_freed_memory: bool = True):
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
        custom_ops = kernels.LIBRARY if self.attention_kernel else None
        encoder_path, decoder_path = (self.bundle.graph_path(variant, name) for name in self.graphs)
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
                self.decoder = NativeSession(decoder_path.read_bytes(), intra_op_threads, {
                    **SPINNING, "optimization.disable_specified_optimizers": ",".join(CPU_DISABLED_OPTIMIZERS),
                    EXTERNAL_DATA_FOLDER: str(decoder_path.parent)})
            except NativeError as e:
                raise cannot_load(decoder_path, e) from None
        else:
            self.decoder = make_session(decoder_path, device, intra_op_threads, custom_ops=custom_ops)
        # the encoder after the decoder: a session holds its largest weight twice while it packs it (read, packed),
        # and the decoder's output projection is the model's largest, so the peak while loading is lower this way
        self.encoder = make_session(encoder_path, device, intra_op_threads, custom_ops=custom_ops)
        self._binding, self._bound = self.decoder.io_binding(), {}  # see _binding_for
        self._with_scores = np.array(True)  # the step's with_scores input, bound by address
        self._unlimited = np.empty(0, np.int64)  # the last_position input of steps no length stops, bound by address
        self._last = np.empty(0, np.int64)  # the last_position input of the others (_last_positions)
        self.kv_dtype = np.float16 if self.bundle.variant(variant).get("kv_dtype") == "float16" else np.float32
        self.ops = DeviceTensors(device, PROVIDERS[device], session_options(1), self.bundle.tensor_ops(variant)) \
            if self.io_binding else HostTensors
        # read at first use and shared by replicas: a caller that translates ids never holds the tokenizer, one that
        # asks for no attention never loads the aligner
        self._tokenizer = functools.cache(self.bundle.tokenizer)
        self._aligner = functools.cache(lambda: Aligner(self.bundle.aligner_path, device, intra_op_threads))
        m = self.bundle.model
        self.n_layers, self.n_heads, self.head_dim = m["n_decoder_layers"], m["n_heads"], m["d_model"] // m["n_heads"]
        self.d_model = m["d_model"]
        # the decoder step's buffers with a row each, bound by _binding_for (kinds for the library's compaction,
        # NativeBinding.greedy_run and beam_steps: 0 rows, 1 a self-attention cache, 2 its origins, 3 a source's)
        layers = range(self.n_layers)
        self._row_names = tuple((f"{io}_{x}_{layer}", 1) for io in ("past", "present") for x in "kv" for layer in layers) \
            + tuple((f"{io}{x}_{layer}", 3) for io in ("", "present_") for x in ("cross_k", "cross_v", "cross_eos")
                    for layer in layers) \
            + (("cache_origin", 2), ("cross_slot", 3)) \
            + tuple((name, 0) for name in ("tokens", "positions", "last_position", "candidate_ids", "candidate_scores",
                                           "eos_candidates", "at_budget"))
        self.eos_width = 2 * self.d_model  # a layer's cross_eos per row: the eos key, then its value
        self.vocab_size = m["vocab_size"]
        self.source_vocab_size = m.get("source_vocab_size") or self.vocab_size
        self.limits = self.bundle.limits
        ids = self.bundle.special_ids
        self.pad_id, self.bos_id, self.eos_id = ids["pad"], ids["bos"], ids["eos"]
        # beam search's ranking (search.Rank)
        self.ranker = Ranker(self.bundle.ranker_path, self.eos_id, native=self.native_steps)
        self.unk_id = ids.get("unk", -1)  # what disable_unk disables

    @property
    def tokenizer(self):
        """The bundle's tokenizer (nmtserve/tokenizer.py)."""
        return self._tokenizer()

    def attention(self, sources: list[list[int]], targets: list[list[int]]) -> list[np.ndarray]:
        """Each source's attention over its target (the tokens decoded for it, a forced prefix's first): (T, S)
        float32 (Aligner.attention). ConfigError where the bundle has no aligner."""
        self.require_aligner()
        return self._aligner().attention(sources, targets, self.bos_id)

    def require_aligner(self) -> None:
        """ConfigError naming return_attention where the bundle has no aligner graph (one exported before it)."""
        if self.bundle.aligner_path is None:
            raise ConfigError(f"return_attention: the bundle {self.bundle.path} has no aligner graph "
                              "(export it again with `nmtserve export`)")

    @property
    def word_continuations(self) -> np.ndarray:
        """(vocab,) bool: the tokens that continue a word (tokenizer.word_continuations), for glossaries' searches."""
        return word_continuations(self.tokenizer, self.vocab_size)

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
        (L, B, 2, H, Dh): each row's key and value at its last source slot, in host memory."""
        return self._encode(src_ids, src_mask, np.empty)

    def _encode(self, src_ids: np.ndarray, src_mask: np.ndarray, empty) -> tuple:
        """`encode` into tensors made by `empty(shape, dtype)` (host arrays or device OrtValues): the encoder writes
        each layer's outputs into their rows of them, bound by address, so nothing is copied. Rows go through in
        calls of at most ENCODER_TOKENS source slots, so that a large batch's activations stay small beside the
        outputs it must hold anyway."""
        batch, src_len = src_ids.shape
        slot_bytes = np.dtype(self.kv_dtype).itemsize * self.n_heads * self.head_dim  # a row's keys at one slot
        cross = (self.n_layers, batch, self.n_heads, src_len, self.head_dim)
        stacked = {"cross_k": empty(cross, self.kv_dtype), "cross_v": empty(cross, self.kv_dtype),
                   "cross_eos": empty((self.n_layers, batch, 2, self.n_heads, self.head_dim), self.kv_dtype)}
        # each output's row: its shape as the graph gives it, and its bytes within a layer
        row = {"cross_k": (cross[2:], src_len * slot_bytes), "cross_v": (cross[2:], src_len * slot_bytes),
               "cross_eos": ((self.eos_width,), 2 * slot_bytes)}
        layers = {prefix: self._layer_addresses(x) for prefix, x in stacked.items()}
        where = "cpu" if isinstance(stacked["cross_k"], np.ndarray) else self.device  # host arrays: host memory
        rows_per_call = max(1, ENCODER_TOKENS // src_len)
        for first in range(0, batch, rows_per_call):
            rows = slice(first, min(batch, first + rows_per_call))
            binding = self.encoder.io_binding()
            binding.bind_cpu_input("src_ids", np.ascontiguousarray(src_ids[rows]))
            binding.bind_cpu_input("src_mask", np.ascontiguousarray(src_mask[rows]))
            for prefix, addresses in layers.items():
                for layer, address in enumerate(addresses):
                    shape, size = row[prefix]
                    bind_address(binding, f"{prefix}_{layer}", where, self.kv_dtype, (rows.stop - first, *shape),
                                 address + first * size, output=True)
            run_bound(self.encoder, binding)
        return stacked["cross_k"], stacked["cross_v"], stacked["cross_eos"]

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
    def prefill(self, sources: list[list[int]], caches: bool = True, prefixes: list[list[int]] | None = None) \
            -> BatchState:
        """Encode token-id sources once -> fresh rows for the decoder batch (on this translator's device).
        caches=False: their self-attention caches have no slots (rows that another state's `insert` or
        `append` takes, which read only their cross K/V). `prefixes`: each row's forced target tokens after the
        start token, fed in decoder steps here, so that the rows leave at the position after them with their last
        one as the token they feed next (rows of different lengths: a prefill per length, rows then at mixed
        positions)."""
        if prefixes and any(prefixes):
            groups = by_length(prefixes)
            if len(groups) > 1:  # a prefill per length, then the rows back in the sources' order
                parts = [self.prefill([sources[i] for i in rows], prefixes=[prefixes[i] for i in rows])
                         for rows in groups]
                return functools.reduce(BatchState.concatenate, parts).gather(np.argsort(np.concatenate(groups)))
            state = self.prefill(sources)
            for column in zip(*prefixes):
                self.decode_candidates(state, 1)  # the step's K/V kept, its output not: the token is forced
                state.choose(np.array(column, np.int64))
            return state
        src_ids, src_mask = self.pad(sources)
        cross_k, cross_v, eos = self._encode(src_ids, src_mask, self.ops.empty)
        return BatchState.from_encoded(cross_k, cross_v, eos, src_mask, self.bos_id, FRESH_SLOTS if caches else 0,
                                       ops=self.ops, origin=self.cache_origin)

    def decode_one_token(self, state: BatchState) -> tuple[np.ndarray, np.ndarray]:
        """One greedy step of every row -> tokens (B,) int64 and their log-probs (B,); the step's K/V
        are written into `state`, and every row but the holes advances (a hole's token is meaningless)."""
        ids, scores = self.decode_candidates(state, 1)
        state.choose(ids[:, 0])
        return ids[:, 0], scores[:, 0]

    def decode_candidates(self, state: BatchState, k: int, scores: bool = True, whole: np.ndarray | None = None,
                          budget: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """One step of every row -> its k best next tokens (B, k) int64 and their log-probs (B, k), best
        first (k = 0: None and every row's logits over the vocabulary (B, V), unranked); scores=False
        (k = 1 only): the best by the values before the log-softmax, which the step skips, and the scores are
        those values (`with_search_head`). With `whole` (R,) int64, rows that need the whole vocabulary among
        rows that need k (a sampler without top-k in the server's batch, say): those rows' logits over the
        vocabulary (R, V) as a third value, unranked. With `budget` (B,) int64, the position at which each row stops
        if no eos came, each row's finish code as the last value (B,) int64 (`_finish_codes`: 0 it runs on, 1 its
        best token is eos, 2 it reached its budget). The step's K/V are written into `state`; the caller
        then picks each row's next token, and for a beam its parent row, with `state.choose`."""
        if not scores and (k != 1 or whole is not None):
            raise ValueError(f"k {k}, whole rows {None if whole is None else whole.tolist()}: a step without scores "
                             "gives each row's one best token only (k = 1, no whole rows)")
        state.open_slot()
        self._with_scores[...] = scores
        last_position = None if budget is None else self._last_positions(budget)
        if k == 0:  # each row's search ranks them itself (a sampler without top-k: Sampling.step)
            self._step(state, 1, np.arange(state.size), last_position)
            out = (None, self._whole.copy())
        else:
            out = self._step(state, k, whole, last_position)
            out += () if whole is None else (self._whole.copy(),)
        state.advance()
        return out if budget is None else out + (self._finish_codes(),)

    def _last_positions(self, budget: np.ndarray) -> np.ndarray:
        """The stopping rule's input, the position of each row's last step (budget less one), in a buffer of the
        decoder's that stays the same object while the batch keeps its size, so that a binding holding it is not
        bound again at every call (the server's bursts and steps)."""
        if len(self._last) != len(budget):
            self._last = np.empty(len(budget), np.int64)
        np.subtract(budget, 1, out=self._last)
        return self._last

    def _finish_codes(self) -> np.ndarray:
        """Each row's finish after the last step, from its stopping rule's outputs (step_graphs.with_stop_rule): 0 it
        runs on, 1 its best candidate is eos, 2 it is at its budget."""
        return np.where(self._eos[:, 0], 1, 2 * self._at_budget)

    def decode_greedy_steps(self, state: BatchState, steps: int, budget: np.ndarray, scores: bool = True,
                            stop_at: float = 0.0, continuing: Continuing | None = None) \
            -> tuple[np.ndarray, ...]:
        """(native_steps, the server's bursts) Up to `steps` greedy steps of every row but the holes, each row fed its
        own best token, until the first step in which a row says eos or reaches its position in `budget` (int64, one
        per row), the cache's end or a step past `stop_at`; no row moves -> each step's tokens (n, B) int64, their
        log-probs (n, B) float32 (None without scores), the step at which each row finished (-1: it did not) and
        whether on eos (a hole's are meaningless). The K/V and positions advance as with `decode_one_token` n times.
        With `continuing` (native.Continuing) the run goes on through row ends until newcomers may join, its outputs
        in `continuing.out` from the start (another thread reads them as the run goes on)."""
        state.open_slot()
        n = state.size
        out = self._greedy_out(min(steps, state.capacity - state.length), n, scores)
        if continuing is not None:
            continuing.out = out
        *_, tokens, values, end, by_eos = self._greedy_loop(state, np.arange(n, dtype=np.int64), budget, out, stop_at,
                                                             continuing is None, continuing)
        return tokens, values, end, by_eos

    def decode_greedy_run(self, state: BatchState, budget: np.ndarray, scores: bool = True, stop_at: float = 0.0) \
            -> tuple[BatchState | None, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """(A state without holes) Greedy steps of every row, each row fed its own best token, until each row has
        said eos or reached its position in `budget` (int64, one per row, moved with them), the cache's end, or a
        step past `stop_at`: rows that finish leave the batch a quarter at a time, the last live rows moving into
        their places -> the state of the rows left (None: none), which row of `state` each of them was, each step's
        tokens (n, B) int64 and, with scores, log-probs (n, B) float32 at the row's column (None without), the step at
        which each row finished (-1: it did not), and whether on eos."""
        assert not state.holes
        n = state.size
        state.open_slot(int(budget.max()))
        out = self._greedy_out(state.capacity - state.length, n, scores)  # the rows furthest on have room for as many
        return self._greedy_loop(state, np.arange(n, dtype=np.int64), budget, out, stop_at)

    @staticmethod
    def _greedy_out(steps: int, rows: int, scores: bool) -> tuple:
        return (np.empty((steps, rows), np.int64), np.empty((steps, rows), np.float32) if scores else None,
                np.full(rows, -1, np.int64), np.zeros(rows, np.uint8))

    def _greedy_loop(self, state: BatchState, source: np.ndarray, budget: np.ndarray, out: tuple, stop_at: float,
                     until_a_row_ends: bool = False, continuing: Continuing | None = None) -> tuple:
        """The greedy loop of decode_greedy_steps and decode_greedy_run: with native_steps all in the library, with no
        Python between steps (`NativeBinding.greedy_run`); else the same loop here (`_greedy_run_here`)."""
        n, last_position = state.size, self._last_positions(budget)
        self._with_scores[...] = out[1] is not None
        if not self.native_steps:
            assert continuing is None, "a continuous burst runs in the library"
            return self._greedy_run_here(state, source, last_position, out, stop_at, until_a_row_ends)
        binding = self._greedy_binding(state, last_position)
        taken, rows = binding.greedy_run(n, state.tokens, state.positions, self._scores, self._eos, self._at_budget,
                                         source, self._row_names, 0, out, stop_at=stop_at,
                                         hole=state.hole if state.holes else None,
                                         until_a_row_ends=until_a_row_ends, continuing=continuing)
        if rows < n:  # the library bound the fewer rows itself: what _bound holds is stale
            self._bound.clear()
        if 0 < rows < n:  # the rows left are in the first places
            state = state.moved_in_place(source[:rows], cross_eos_moved=not self.shared_cross)
        elif rows == 0:
            state = None
        tokens, values, end, by_eos = out
        return state, source[:rows].copy(), tokens[:taken], None if values is None else values[:taken], end, \
            by_eos.astype(bool)

    def _greedy_run_here(self, state: BatchState, source: np.ndarray, last_position: np.ndarray, out: tuple,
                         stop_at: float, until_a_row_ends: bool) -> tuple:
        """_greedy_loop in Python, on ONNX Runtime's own session: every row but the holes decodes at every step (a
        finished one on, ignored, until it leaves), so the rows stay at one position, which that attention steps
        faster than rows at mixed ones."""
        tokens, values, end, by_eos = out
        hole = state.hole.copy() if state.holes else np.zeros(len(source), bool)
        done = hole.copy()  # the rows of `state` that have finished (a hole from the start)
        binding, rebind = None, self.io_binding or state.ops.device != self.device  # rows bound by value: every step
        taken = 0
        for step in range(len(tokens)):
            if binding is None or rebind:
                binding = self._greedy_binding(state, last_position)
            try:
                run_bound(self.decoder, binding)
            except Exception:
                if step == 0:
                    raise
                break  # the steps before stand; the next call meets the error
            taken = step + 1
            state.positions += ~hole
            live = source[~done]
            tokens[step, live] = state.tokens[~done]
            if values is not None:
                values[step, live] = self._scores[~done, 0]
            code = self._finish_codes()
            finished, said_eos = (code != 0) & ~done, (code == 1) & ~done
            end[source[finished]], by_eos[source[said_eos]] = step, 1
            done |= finished
            last = step + 1 == len(tokens) or 0 < stop_at <= time.monotonic()
            if last or done.all() or until_a_row_ends and finished.any():
                break
            if not until_a_row_ends and done.sum() * 4 >= len(done):  # the last rows move into the finished ones' places
                state, source, last_position, hole, done, binding = self._compacted(state, source, last_position, hole,
                                                                                    done)
        if not until_a_row_ends and done.all():
            state, source = None, source[:0]
        elif not until_a_row_ends and done.any():  # the rows left at return are all live
            state, source, *_ = self._compacted(state, source, last_position, hole, done)
        return state, source, tokens[:taken], None if values is None else values[:taken], end, by_eos.astype(bool)

    @staticmethod
    def _compacted(state: BatchState, source, last_position, hole, done) -> tuple:
        state, order = state.compact(~done)
        return state, source[order], last_position[order], hole[order], np.zeros(len(order), bool), None

    def decode_search_run(self, state: BatchState, searches: list[BeamSearch | Sampling]) -> None:
        """Beam searches or samplings of one kind (one beam size, one number of candidates), one per row of a fresh
        `state` (`prefill`), run until every search is done (nmtserve/search.py: each over its own rows; the
        results are the searches'). A finished search's rows decode on, ignored, until finished searches are a
        quarter of the batch; then their rows leave together. With native_steps the library takes beam search's
        ordinary steps after the first (`_native_beam_steps`), and every other step comes back here."""
        width, k = searches[0].rows, searches[0].candidates
        beams = isinstance(searches[0], BeamSearch)
        # ordinary beam steps in the library, after the first (on the step that shares each source's cross K/V)
        native = beams and k > 0 and self.native_steps and self.cache_origin and self.shared_cross
        slots = list(range(len(searches)))  # the search each `width` rows run for, in row order
        while state is not None:
            live = [None if searches[r].done else searches[r] for r in slots]  # each slot's search, None once done
            if native and state.size == width * len(slots):  # after the first step
                state, slots = self._native_beam_steps(state, searches, slots, width)
                continue
            ids, scores = self.decode_candidates(state, k)
            if state.size < width * len(slots):  # the first step, one row per source (a beam's rows all start
                # alike and its search reads row 0 only): then each row becomes its beam's rows
                ids = None if ids is None else np.repeat(ids, width, axis=0)
                scores = np.repeat(scores, width, axis=0)
                # with shared_cross the rows share their source's cross K/V; else each gets a copy
                state = state.widen(width) if self.shared_cross \
                    else state.gather(np.repeat(np.arange(len(searches)), width))
            if beams:  # ranked once for all searches (nmtserve/search.py: beam_steps)
                parents, tokens = beam_steps(live, ids, scores, self.ranker.rank)
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

    def _native_beam_steps(self, state: BatchState, searches: list[BeamSearch], slots: list[int], k: int) \
            -> tuple[BatchState | None, list[int]]:
        """Beam search's steps in the library (NativeBinding.beam_steps) until every search is over or the cache is
        full: it takes each search's ordinary steps (`BeamSearch.ordinary`: its k best extensions simply continue) and
        calls `rules` for any other, which brings the search up to date (`BeamSearch.advance`) and lets it take that
        step (`BeamSearch.select`, on the library's ranking); the searches that are over leave the batch there. At the
        end each search takes the ordinary steps it ran since -> the state of the searches left (None: none) and the
        search of each, in row order."""
        state.open_slot()
        self._with_scores[...] = True
        binding = self._binding_for(state, 2 * k)
        n, steps = len(searches), state.capacity - state.length
        ordinary = np.array([-1 if s.done else s.ordinary_steps() for s in searches], np.int64)
        beam = np.concatenate([searches[r].scores for r in slots])
        search_of = np.array(slots, np.int64)
        out = (np.empty((steps, n, k), np.int64), np.empty((steps, n, k), np.int64), np.empty(n, np.int64),
               np.empty((n, 2 * k), np.int64), np.empty((n, 2 * k), np.int64), np.empty((n, 2 * k)),
               np.empty((n, k), np.int64), np.empty((n, k), np.int64))
        out_parents, out_tokens, advanced, cand_rows, cand_ids, cand_scores, chosen_parents, chosen_tokens = out
        synced = np.zeros(n, np.int64)  # the ordinary steps each search has taken (advance)

        def catch_up(r: int, rows: slice) -> None:  # search r, in the group of `rows`
            if advanced[r] > synced[r]:
                taken = slice(synced[r], advanced[r])
                searches[r].advance(out_parents[taken, r].tolist(), out_tokens[taken, r].tolist(), beam[rows].copy())
                synced[r] = advanced[r]

        def rules(r: int, g: int) -> None:  # search r, now group g of the batch
            rows = slice(g * k, (g + 1) * k)
            catch_up(r, rows)
            search = searches[r]
            chosen_parents[r], chosen_tokens[r] = search.select(cand_rows[r], cand_ids[r], cand_scores[r])
            beam[rows] = search.scores
            ordinary[r] = -1 if search.done else search.ordinary_steps()
        _, groups = binding.beam_steps(len(slots), self._ids, self._scores, state.tokens, state.positions, state.origin,
                                       beam, search_of, ordinary, self.eos_id, self._row_names, out, rules,
                                       self.ranker.native)
        for g, r in enumerate(search_of[:groups].tolist()):  # the live ones
            catch_up(r, slice(g * k, (g + 1) * k))
        left = search_of[:groups].tolist()
        if groups == len(slots):
            return state, left
        self._bound.clear()  # the library bound the fewer rows itself: what _bound holds is stale
        if groups == 0:
            return None, []
        place = {r: j for j, r in enumerate(slots)}  # the library moved the searches left into the first places
        return state.moved_in_place(np.array([place[r] for r in left]), cross_eos_moved=False), left

    def _step(self, state: BatchState, k: int, whole: np.ndarray | None = None, last_position: np.ndarray | None = None) \
            -> tuple[np.ndarray, np.ndarray]:
        """candidate ids and their scores (B, k) on the host, scored as `_with_scores` says (and the `whole`
        rows' logits over the vocabulary in `_whole`). Every cache is bound as both the input and the
        `present` output of its layer, so the step writes the new K/V into `state`'s own buffers, wherever
        they live (`_binding_for`)."""
        binding = self._binding_for(state, k, whole=whole, last_position=last_position)
        run_bound(self.decoder, binding)
        return self._ids.copy(), self._scores.copy()

    def _binding_for(self, state: BatchState, k: int, greedy: bool = False, whole: np.ndarray | None = None,
                     last_position: np.ndarray | None = None) -> ort.IOBinding | NativeBinding:
        """The decoder's binding for a step of `state` asking for k candidates. A binding holds addresses,
        so it is kept from step to step and a group is bound again only when its objects change (`_bound`
        holds weak references to them): the caches (each layer as input and `present` output, with their
        slot counts; with shared_cross the cross K/V as inputs only), the per-row arrays (tokens, positions,
        cross_slot: BatchState changes them in place; each row's `last_position`, none by default), and the
        outputs (candidates into buffers of (B, k), with the `candidates` and `with_scores` inputs: the callers set
        the flag; greedy: k = 1 and each row's best token straight into `state.tokens`, `_greedy_binding`; the
        `whole` rows, none by default, and their logits over the vocabulary into `_whole`; the stopping rule's into
        `_eos` and `_at_budget`). Host inputs of a session on a device are copied to it when bound, so there the
        per-row arrays (and host caches) are bound every step (a translator serves one thread at a time)."""
        binding, bound, shared = self._binding, self._bound, self.shared_cross
        caches = (state.k, state.v, state.cross_k, state.cross_v, state.cross_eos) \
            + (() if state.origin is None else (state.origin,))
        where = state.ops.device  # host arrays are host memory to every session (io_binding off on CUDA too)
        copied_when_bound = where != self.device
        if copied_when_bound or not same_objects(bound.get("caches"), caches):
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
            bound["caches"] = weak_refs(caches)
        if last_position is None:
            if len(self._unlimited) != state.size:
                self._unlimited = np.full(state.size, NO_BUDGET, np.int64)
            last_position = self._unlimited
        rows, rebound = (state.tokens, state.positions, state.cross_slot, last_position), True
        if self.io_binding or copied_when_bound:
            for name, x in zip(ROW_INPUTS, rows):
                binding.bind_cpu_input(name, np.ascontiguousarray(x))
        elif not same_objects(bound.get("rows"), rows):
            for name, x in zip(ROW_INPUTS, rows):
                assert x.flags.c_contiguous, name
                bind_address(binding, name, "cpu", x.dtype, x.shape, x.ctypes.data)
            bound["rows"] = weak_refs(rows)
        else:
            rebound = False
        wholes, new_outputs = 0 if whole is None else len(whole), False
        if bound.get("outputs") != (state.size, k, greedy, wholes) or greedy and rebound:  # greedy: into state.tokens
            self._ids, self._scores = np.empty((state.size, k), np.int64), np.empty((state.size, k), np.float32)
            self._k = np.array([k], np.int64)
            self._whole_rows, self._whole = np.zeros(wholes, np.int64), np.empty((wholes, self.vocab_size), np.float32)
            self._eos, self._at_budget = np.empty((state.size, k), bool), np.empty(state.size, bool)
            bind_address(binding, "candidates", "cpu", np.int64, (1,), self._k.ctypes.data)
            bind_address(binding, "with_scores", "cpu", np.bool_, (), self._with_scores.ctypes.data)  # host memory
            for name, x in (("candidate_ids", state.tokens.reshape(-1, 1) if greedy else self._ids),
                            ("candidate_scores", self._scores), ("whole_logits", self._whole),
                            ("eos_candidates", self._eos), ("at_budget", self._at_budget)):
                bind_address(binding, name, "cpu", x.dtype, x.shape, x.ctypes.data, output=True)
            bound["outputs"], new_outputs = (state.size, k, greedy, wholes), True
        if wholes:
            self._whole_rows[:] = whole  # in place: on the host the binding reads it there
        if new_outputs or wholes and self.device != "cpu":  # a device's session copies it when bound
            bind_address(binding, "whole_rows", "cpu", np.int64, (wholes,), self._whole_rows.ctypes.data)
        return binding

    def _greedy_binding(self, state: BatchState, last_position: np.ndarray) -> ort.IOBinding | NativeBinding:
        """The step's binding for greedy search, with its candidate_ids output bound to the `tokens` input's
        own buffer: the step's search head writes each row's best token where the next step reads it (the
        embedding's Gather, the first node and only reader of `tokens`, is done by then), and `last_position`
        bound for the step's stopping rule."""
        return self._binding_for(state, 1, greedy=True, last_position=last_position)

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

    def pad(self, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Token-id sources -> ids (B, S) int64 padded, and their mask. An id outside the vocabulary is a
        ValueError naming it: ONNX Runtime's CPU Gather refuses it, but CUDA's would read out of bounds."""
        ids, mask = padded(seqs)  # past a source: masked, any id in the table
        outside = ids[mask & ((ids < 0) | (ids >= self.source_vocab_size))]
        if outside.size:
            raise ValueError(f"source token id {int(outside[0])} is out of the vocabulary "
                             f"(0 to {self.source_vocab_size - 1})")
        return ids, mask

    def replica(self) -> Decoder:
        """This translator with a decoding context of its own (decoder binding and bound buffers) over the
        same sessions, tokenizer and bundle: one per thread decoding at once (inter_threads here, the
        server's --inter-threads). Not on CUDA (CUDA_INTER_THREADS)."""
        if self.device == "cuda":
            raise ConfigError(CUDA_INTER_THREADS.format(n=2))
        replica = copy.copy(self)
        replica._binding, replica._bound = self.decoder.io_binding(), {}
        replica._with_scores, replica._unlimited, replica._last = np.array(True), np.empty(0, np.int64), \
            np.empty(0, np.int64)
        return replica
