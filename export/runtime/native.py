"""The decoder step's session held by nmtserve's native library (kernels.cc), and decoder steps run in a loop
there: no Python, and no wait for the GIL, between two steps.

Greedy search runs in the library (`greedy_run`): a static batch's whole search, its finished rows leaving the
batch there too (Python comes back only to double a full cache), and the server's bursts, which end at the first
row that finishes; offline beam search runs its steps there (`beam_steps`: where a search's k best extensions
simply continue; the library calls BeamSearch back for every step where one of its rules applies, and the
searches that are over leave the batch there). Each is one call, the GIL released throughout (cffi releases it
for every call into the library). Every other search binds and runs one step at a time through the same session,
as with ONNX Runtime's own Python session. The library's functions and the structs of its loops' arguments are
declared once, in kernels.h, which cffi reads here (typed: a wrong argument is a TypeError, not a crash).

The session is made by the ONNX Runtime that Python uses: the library learns its API when a session option
registers it (`register_custom_ops_library` calls the library's RegisterCustomOps), so the library is
registered once before the first session is made here. The environment is the process's one; the session
options are sessions.session_options's (the caller passes its config entries), with nmtserve's custom ops. A
binding holds addresses of host memory, bound by `bind` (as `sessions.bind_address` does for ONNX Runtime's own
bindings) and sent with the next run; the library keeps what each name is bound to, so that `greedy_run` and
`beam_steps` can bind the fewer rows again themselves. CPU only."""

from __future__ import annotations

import dataclasses
import threading

import cffi
import numpy as np

from nmtserve.export.runtime import kernels

_ERROR_SIZE = 2000
_MAX_DIMS = 8  # of a bound tensor (nmt_bind)
_TABLES = 64  # the kinds of send a binding keeps the C arrays of (_send)
_ffi = cffi.FFI()
# kernels.h, the library's interface, declared to cffi as the compiler reads it (its one preprocessor line dropped)
_ffi.cdef("\n".join(line for line in kernels.INTERFACE.read_text().splitlines() if not line.startswith("#")))
_loaded: list = []  # the library, once opened and registered
_lock = threading.Lock()


class NativeError(RuntimeError):
    """ONNX Runtime's error in the library's session: its message."""


def _library():
    """The kernel library, opened here and registered with ONNX Runtime once (it keeps ONNX Runtime's API)."""
    with _lock:
        if not _loaded:
            import onnxruntime as ort

            library = _ffi.dlopen(str(kernels.LIBRARY))  # held open: ONNX Runtime unloads its own handle
            ort.SessionOptions().register_custom_ops_library(str(kernels.LIBRARY))
            _loaded.append(library)
        return _loaded[0]


def _checked(returned: int, error) -> int:
    if returned < 0:
        raise NativeError(_ffi.string(error).decode(errors="replace"))
    return returned


def _pointer(kind: str, array: np.ndarray | None):
    """`array`'s memory as a C pointer of `kind` (NULL for None): the array must stay alive while it is used."""
    if array is None:
        return _ffi.NULL
    return _ffi.from_buffer(kind, array)  # a C-contiguous buffer, or an error


def _strings(values: list[bytes]) -> tuple:
    """A C array of strings, and the buffers it points into (kept alive with it)."""
    buffers = [_ffi.new("char[]", v) for v in values]
    return _ffi.new("char *[]", buffers), buffers


# numpy dtype -> ONNX element type (onnx.proto's TensorProto.DataType) of the tensors the library binds
_ELEMENT_TYPES = {np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3, np.dtype(np.int32): 6,
                  np.dtype(np.int64): 7, np.dtype(np.bool_): 9, np.dtype(np.float16): 10}


def _element_type(dtype) -> int:
    return _ELEMENT_TYPES[np.dtype(dtype)]


@dataclasses.dataclass
class Continuing:
    """A greedy run that goes on through row ends (kernels.h, nmt_greedy_run's keep_rows: the server's continuous
    bursts): finished rows stay in place and no row moves; the run ends once the requests `waiting` (one int32, set by
    another thread) may join (`free_rows` free besides the rows that finish, in groups of `gather` rows, or after
    `gather_steps` steps); after each step in which a row finishes, `progress` (one int64) is set to the steps run and
    a byte is written to the file descriptor `fd` (-1: none), for the thread that hands those rows' results back,
    which reads them in `out` (greedy_run's, set by the caller before the run starts)."""
    waiting: np.ndarray
    free_rows: int
    gather: int
    gather_steps: int
    progress: np.ndarray
    fd: int = -1
    out: tuple | None = None


class NativeSession:
    """The decoder step's session (`model`: the serialized graph) with `threads` intra-op threads and the session
    `config` entries (among them where the graph's weights file is: sessions.EXTERNAL_DATA_FOLDER)."""

    def __init__(self, model: bytes, threads: int, config: dict[str, str]):
        self._library = library = _library()
        error, handle = _ffi.new("char[]", _ERROR_SIZE), _ffi.new("void **")
        keys, key_buffers = _strings([x.encode() for x in config.keys()])
        values, value_buffers = _strings([x.encode() for x in config.values()])
        _checked(library.nmt_runner_create(model, len(model), threads, len(config), keys, values, handle, error,
                                           _ERROR_SIZE), error)
        self._handle = handle[0]
        self._free = library.nmt_runner_free  # still callable while the interpreter shuts down

    def io_binding(self) -> NativeBinding:
        return NativeBinding(self)

    def __del__(self):
        if getattr(self, "_handle", None):
            self._free(self._handle)


class NativeBinding:
    """A binding of the session's inputs and outputs to host memory (as ONNX Runtime's IOBinding), and the
    runs over it. Used by one thread at a time."""

    def __init__(self, session: NativeSession):
        self.session, self._library = session, session._library  # the session outlives its bindings
        self._error = _ffi.new("char[]", _ERROR_SIZE)
        handle = _ffi.new("void **")
        _checked(self._library.nmt_binding_create(session._handle, handle, self._error, _ERROR_SIZE), self._error)
        self._handle = handle[0]
        self._free = self._library.nmt_binding_free
        self._pending: list = []  # binds not yet sent (bind)
        self._tables: dict = {}  # (names, types, shapes, outputs) of a send -> their C arrays (_send)
        self._row_tables: dict = {}  # greedy_run's and beam_steps' row_names -> their C struct (_row_names)

    def bind(self, name: str, dtype, shape: tuple, address: int, output: bool = False) -> None:
        """Host memory at `address` of `shape` and `dtype` as the input (or the output, written there) `name`:
        sent to the library with the next run, all binds since the last one in one call."""
        self._pending.append((name.encode(), _element_type(dtype), shape, address, output))

    def _send(self) -> None:
        names, types, shapes, addresses, outputs = zip(*self._pending)
        self._pending, count = [], len(names)
        key = (names, types, shapes, outputs)
        table = self._tables.get(key)  # the same binds come again with each new state of a shape: their C arrays once
        if table is None:
            if len(self._tables) >= _TABLES:
                self._tables.clear()
            flat = [0] * (_MAX_DIMS * count)
            for i, shape in enumerate(shapes):
                flat[_MAX_DIMS * i:_MAX_DIMS * i + len(shape)] = shape
            table = self._tables[key] = (_strings(list(names)), _ffi.new("int[]", types), _ffi.new("int64_t[]", flat),
                                         _ffi.new("int[]", [len(x) for x in shapes]), _ffi.new("int[]", outputs))
        (c_names, _), c_types, c_shapes, c_ndims, c_outputs = table
        data = _ffi.new("void *[]", [_ffi.cast("void *", x) for x in addresses])
        _checked(self._library.nmt_bind(self._handle, count, c_names, c_types, c_shapes, c_ndims, data, c_outputs,
                                        self._error, _ERROR_SIZE), self._error)

    def run(self) -> None:
        """One run of the session over the bound memory."""
        if self._pending:
            self._send()
        _checked(self._library.nmt_run(self.session._handle, self._handle, self._error, _ERROR_SIZE), self._error)

    def greedy_run(self, rows: int, tokens: np.ndarray, positions: np.ndarray, scores: np.ndarray, eos: np.ndarray,
                   at_budget: np.ndarray, source: np.ndarray, row_names: tuple[tuple[str, int], ...], step0: int,
                   out: tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray], stop_at: float = 0.0,
                   hole: np.ndarray | None = None, until_a_row_ends: bool = False,
                   continuing: Continuing | None = None) -> tuple[int, int]:
        """Greedy steps of the first `rows` rows in the library (kernels.h, nmt_greedy_run: when a row finishes, and
        how the finished ones leave) until every row has finished or len(out_tokens) steps have run. `tokens`,
        `positions`, `scores`, `eos` and `at_budget` are the bound step's (tokens fed, written by the step; eos and
        at_budget (bool, a row each): its stopping rule's, step_graphs.with_stop_rule), `source` (int64, a row each)
        each row's source; the library moves it with the rows. `row_names`: (name, kind) of every bound buffer with a
        row per leading index (kinds: kernels.h, nmt_row_names). `out`: out_tokens (steps, sources) int64, out_scores
        (the same, float32, or None), end (sources,) int64 and by_eos (sources,) uint8, written at each source's
        column; end as step0 + the step. The run also ends after a step once time.monotonic() has reached `stop_at`
        (when above 0); with until_a_row_ends after the first step in which a row finishes, no row moving (a static
        batch with holes). `hole` (bool, a row each): rows that never advance nor finish. `continuing`: the server's
        continuous burst (`Continuing`) -> (the steps run, the rows left in the first places of the buffers)."""
        if self._pending:
            self._send()
        out_tokens, out_scores, end, by_eos = out
        assert tokens.dtype == positions.dtype == source.dtype == np.int64 and eos.dtype == at_budget.dtype == bool
        assert eos.size == at_budget.size  # one candidate a row
        assert scores.dtype == np.float32 and by_eos.dtype == np.uint8 and end.dtype == np.int64
        assert out_scores is None or out_scores.shape == out_tokens.shape
        assert hole is None or hole.dtype == bool
        run = _ffi.new("nmt_greedy_run_args *", {
            "rows": rows, "tokens": _pointer("int64_t[]", tokens), "positions": _pointer("int64_t[]", positions),
            "scores": _pointer("float[]", scores), "eos": _pointer("uint8_t[]", eos),
            "at_budget": _pointer("uint8_t[]", at_budget),
            "source": _pointer("int64_t[]", source), "hole": _pointer("uint8_t[]", hole),
            "until_a_row_ends": until_a_row_ends, "max_steps": len(out_tokens),
            "stop_at": stop_at, "row_names": self._row_names(row_names)[0],
            "sources": out_tokens.shape[1], "step0": step0, "out_tokens": _pointer("int64_t[]", out_tokens),
            "out_scores": _pointer("float[]", out_scores), "end": _pointer("int64_t[]", end),
            "by_eos": _pointer("uint8_t[]", by_eos)})
        if continuing is not None:
            c = continuing
            assert not until_a_row_ends and c.waiting.dtype == np.int32 and c.progress.dtype == np.int64
            run.keep_rows, run.waiting, run.progress = 1, _pointer("int32_t[]", c.waiting), _pointer("int64_t[]", c.progress)
            run.free_rows, run.gather, run.gather_steps, run.hand_back_fd = c.free_rows, c.gather, c.gather_steps, c.fd
        else:
            run.hand_back_fd = -1
        steps = _checked(self._library.nmt_greedy_run(self.session._handle, self._handle, run, self._error, _ERROR_SIZE),
                         self._error)
        return steps, run.rows

    def beam_steps(self, groups: int, ids: np.ndarray, scores: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
                   origin: np.ndarray, beam: np.ndarray, search_of: np.ndarray, ordinary: np.ndarray, eos_id: int,
                   row_names: tuple[tuple[str, int], ...], out: tuple[np.ndarray, ...], rules,
                   ranker: NativeSession) -> tuple[int, int]:
        """Offline beam search of the first `groups` searches' rows (k each) in the library (kernels.h,
        nmt_beam_steps): each step, the ranker graph's session (`ranker`) ranks every search's extensions, and every
        search whose k best extensions simply continue (BeamSearch.ordinary) takes it there; for any other,
        rules(search, group), a Python function, takes it (writing its choice into `out`, its scores
        into `beam` and its ordinary steps into `ordinary`); the searches that are over leave the batch there. Runs
        until every search is over or len(out_parents) steps. `ids` and `scores` (rows, 2k) are the step's bound
        candidate outputs, `tokens` and `positions` its bound inputs, `origin` (rows, capacity) int32 the state's cache
        origins, `beam` (rows,) float64 each row's cumulative log-prob and `search_of` (groups,) int64 each group's
        search (both move with the rows), `ordinary` (searches,) int64 the ordinary steps each may take (-1: it is
        over). `row_names` as greedy_run's. `out`, each by search: out_parents and out_tokens (steps, searches, k)
        int64, its ordinary steps' parents (local) and tokens; advanced (searches,) int64, how many it took; cand_rows
        (local), cand_ids (searches, 2k) int64 and cand_scores float64, the 2k best extensions of a step that rules
        takes; chosen_parents and chosen_tokens (searches, k) int64, where rules writes its choice -> (the steps run,
        the groups left in the first places of the buffers). An exception that rules raises ends the run and is
        raised here."""
        if self._pending:
            self._send()
        out_parents, out_tokens, advanced, cand_rows, cand_ids, cand_scores, chosen_parents, chosen_tokens = out
        searches, k = ordinary.shape[0], out_parents.shape[2]
        assert ids.dtype == np.int64 and scores.dtype == np.float32 and origin.dtype == np.int32
        assert beam.dtype == np.float64 and search_of.dtype == ordinary.dtype == np.int64
        assert out_parents.shape == out_tokens.shape and out_parents.shape[1] == searches
        assert cand_rows.shape == cand_ids.shape == cand_scores.shape == (searches, ids.shape[1])
        assert chosen_parents.shape == chosen_tokens.shape == (searches, k)
        assert all(x.dtype == np.int64 for x in out if x is not cand_scores) and cand_scores.dtype == np.float64
        raised = []

        @_ffi.callback("int(int64_t, int64_t)")
        def called(search: int, group: int) -> int:
            try:
                rules(search, group)
                return 0
            except BaseException as e:  # it cannot cross the library: raised below
                raised.append(e)
                return 1
        run = _ffi.new("nmt_beam_run_args *", {
            "groups": groups, "ids": _pointer("int64_t[]", ids), "scores": _pointer("float[]", scores), "width": ids.shape[1],
            "tokens": _pointer("int64_t[]", tokens), "positions": _pointer("int64_t[]", positions),
            "origin": _pointer("int32_t[]", origin), "capacity": origin.shape[1], "beam": _pointer("double[]", beam),
            "search_of": _pointer("int64_t[]", search_of), "ordinary": _pointer("int64_t[]", ordinary), "searches": searches, "k": k,
            "eos": eos_id, "max_steps": len(out_parents), "row_names": self._row_names(row_names)[0],
            "out_parents": _pointer("int64_t[]", out_parents), "out_tokens": _pointer("int64_t[]", out_tokens),
            "advanced": _pointer("int64_t[]", advanced), "cand_rows": _pointer("int64_t[]", cand_rows),
            "cand_ids": _pointer("int64_t[]", cand_ids), "cand_scores": _pointer("double[]", cand_scores),
            "chosen_parents": _pointer("int64_t[]", chosen_parents), "chosen_tokens": _pointer("int64_t[]", chosen_tokens),
            "rules": called, "ranker": ranker._handle})
        steps = self._library.nmt_beam_steps(self.session._handle, self._handle, run, self._error, _ERROR_SIZE)
        if raised:
            raise raised[0]
        return _checked(steps, self._error), run.groups

    def _row_names(self, row_names: tuple[tuple[str, int], ...]) -> tuple:
        """greedy_run's and beam_steps' row_names as kernels.h's nmt_row_names, and the arrays it points into (made
        once, kept with it)."""
        table = self._row_tables.get(row_names)
        if table is None:
            (names, buffers), kinds = _strings([name.encode() for name, _ in row_names]), \
                _ffi.new("int[]", [kind for _, kind in row_names])
            struct = _ffi.new("nmt_row_names *", {"count": len(row_names), "names": names, "kinds": kinds})
            table = self._row_tables[row_names] = (struct[0], struct, names, buffers, kinds)
        return table

    def __del__(self):
        if getattr(self, "_handle", None):
            self._free(self._handle)
