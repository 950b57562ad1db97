"""Where the running batch's large tensors live: host numpy arrays, or ONNX Runtime OrtValues on a device.

BatchState keeps its self-attention caches and cross-attention K/V through one of these two; the
small per-row arrays (masks, positions, tokens) stay numpy on the host. HostTensors is numpy.
DeviceTensors does the same operations with the bundle's tiny one-node ONNX graphs (export/build/tensor_ops.py
writes them) that ONNX Runtime runs on the device (CUDA; the CPU provider in tests), so on a GPU the caches never
come back to the host: a decoder step returns only the chosen token ids and their log-probabilities.

    ops = DeviceTensors("cuda", ["CUDAExecutionProvider"], ort.SessionOptions(), bundle.tensor_ops("fp16"))
    k = ops.zeros((L, B, H, 32, Dh), np.float16)
    k = ops.pad(k, 3, 64)                   # room for 64 slots (the decoder step writes into them)

Every method returns its result; HostTensors writes in place where numpy can, DeviceTensors
returns a new OrtValue (ONNX Runtime has no in-place update), which costs one copy of the tensor
on the device per call.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort


class HostTensors:
    """numpy arrays in host memory (the CPU path: ONNX Runtime reads them without a copy)."""

    device = "cpu"
    views = True  # a tensor may be the first rows of a larger buffer (`head`, `with_rows`)

    @staticmethod
    def empty(shape: tuple, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(shape: tuple, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    @staticmethod
    def shape(x: np.ndarray) -> tuple:
        return x.shape

    @staticmethod
    def numpy(x: np.ndarray) -> np.ndarray:
        return x

    @staticmethod
    def dtype(x: np.ndarray):
        return x.dtype

    @staticmethod
    def pad(x: np.ndarray, axis: int, size: int, front: int = 0) -> np.ndarray:
        """`front` zeros, then x, then zeros up to `size` along axis (x unchanged if already that long)."""
        n = x.shape[axis]
        if front == 0 and n >= size:
            return x
        assert front + n <= size, (front, n, size)
        shape, index = list(x.shape), [slice(None)] * x.ndim
        shape[axis], index[axis] = size, slice(front, front + n)
        out = np.zeros(shape, x.dtype)  # np.pad's general form: 6–18× the time on the engine's small arrays
        out[tuple(index)] = x
        return out

    @staticmethod
    def concat(xs: list[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(xs, axis=axis)

    @staticmethod
    def take(x: np.ndarray, rows: np.ndarray, axis: int) -> np.ndarray:
        return np.take(x, rows, axis=axis)

    @staticmethod
    def slice(x: np.ndarray, axis: int, start: int, stop: int | None = None) -> np.ndarray:
        """x[start:stop] along axis, contiguous (ONNX Runtime would copy a strided input on every step)."""
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        return np.ascontiguousarray(x[tuple(index)])

    @staticmethod
    def place_rows(x: np.ndarray, rows: list[int], y: np.ndarray, start: int = 0, width: int | None = None) -> np.ndarray:
        """x[:, rows] = y's rows start.. (one each), in place: along axis 3 y's first `width` (None: all), zeros
        past them (a newcomer's cross K/V into a batch of longer sources): one copy, no padded temporary."""
        width = y.shape[3] if width is None else width
        x[:, rows, :, :width] = y[:, start:start + len(rows), :, :width]
        if width < x.shape[3]:
            x[:, rows, :, width:] = 0
        return x

    # Cache operations that touch only the slots in use (a cache's capacity runs ahead of its length)
    @staticmethod
    def copy_rows(x: np.ndarray, dst: np.ndarray, src: np.ndarray, stop: int | None) -> np.ndarray:
        """x[:, dst, :, :stop] = x[:, src, :, :stop], in place; slots from `stop` on keep what they had
        (None: every slot)."""
        x[:, dst, :, :stop] = x[:, src, :, :stop]
        return x

    @staticmethod
    def head(x: np.ndarray, n: int) -> np.ndarray:
        """x's first n rows (axis 1), a view: each layer's rows are still one contiguous block."""
        return x[:, :n]

    @staticmethod
    def grow_rows(x: np.ndarray, n: int) -> np.ndarray | None:
        """x and the rows after it up to n in all, a view, when x is the first rows of a buffer that has them
        (`head`, `with_rows`): rows past x's hold whatever the buffer held. None when it has not."""
        base = x.base
        if (isinstance(base, np.ndarray) and base.ndim == x.ndim and base.shape[1] >= n and base.shape[0] == x.shape[0]
                and base.shape[2:] == x.shape[2:] and base.flags.c_contiguous and base.ctypes.data == x.ctypes.data):
            return base[:, :n]
        return None

    @staticmethod
    def with_rows(x: np.ndarray, rows: int, stop: int | None) -> np.ndarray:
        """x's rows (a cache's slots 0..stop-1; None: all of them) as the first rows of a new buffer of `rows`
        rows, a view: the rest is room for grow_rows."""
        out = np.empty((x.shape[0], rows, *x.shape[2:]), x.dtype)
        out[:, :x.shape[1], :, :stop] = x[:, :, :, :stop]
        return out[:, :x.shape[1]]

    @staticmethod
    def with_slots(x: np.ndarray, size: int, stop: int, zeros: bool = False) -> np.ndarray:
        """x with `size` slots (axis 3) holding its slots 0..stop-1, the rest unset (zeros: zero), in a new buffer
        with as many rows as the one behind x (`head`, `with_rows`): a cache or a source axis that grows or shrinks
        keeps the room its buffers had for newcomers' rows (grow_rows), unless the host refuses its address space."""
        rows = x.base.shape[1] if HostTensors.grow_rows(x, x.shape[1]) is not None else x.shape[1]
        try:
            out = np.empty((x.shape[0], rows, x.shape[2], size, x.shape[4]), x.dtype)
        except MemoryError:  # x's own rows only (BatchState.append then makes room again)
            out = np.empty((x.shape[0], x.shape[1], x.shape[2], size, x.shape[4]), x.dtype)
        out[:, :x.shape[1], :, :stop] = x[:, :, :, :stop]
        if zeros:
            out[:, :x.shape[1], :, stop:] = 0
        return out[:, :x.shape[1]]

    @staticmethod
    def concat_slots(xs: list[np.ndarray], stops: list[int], capacity: int) -> np.ndarray:
        """The caches xs one after another along the rows, with `capacity` slots holding each x's slots
        0..stop-1, the rest unset (as take_slots): one copy of the filled slots only."""
        first = xs[0]
        out = np.empty((first.shape[0], sum(x.shape[1] for x in xs), first.shape[2], capacity, first.shape[4]),
                       first.dtype)
        row = 0
        for x, stop in zip(xs, stops):
            out[:, row:row + x.shape[1], :, :stop] = x[:, :, :, :stop]
            row += x.shape[1]
        return out

    @staticmethod
    def take_slots(x: np.ndarray, rows: np.ndarray, stop: int) -> np.ndarray:
        """The given rows of a cache x (indices, repeats allowed) with their slots 0..stop-1, the rest unset
        (x itself when the rows are all of x's, in order): no row reads past its own slots, and np.empty
        skips zeroing (and faulting in) the rest."""
        if _every_row(rows, x.shape[1]):
            return x
        out = np.empty((x.shape[0], len(rows), *x.shape[2:]), x.dtype)
        rows = np.asarray(rows)
        steps = np.diff(rows)
        if (steps == 0).any():  # repeats (a beam's rows from its one encoded row): one slot or a few
            out[:, :, :, :stop] = x[:, rows, :, :stop]
            return out
        # rows kept in order (compaction): each run of consecutive rows as one slice; numpy's fancy indexing with
        # the slots cut copies through a temporary, which is slower
        breaks = (np.flatnonzero(steps != 1) + 1).tolist()
        for start, end in zip([0, *breaks], [*breaks, len(rows)]):
            first = int(rows[start])
            out[:, start:end, :, :stop] = x[:, first:first + end - start, :, :stop]
        return out


def _every_row(rows: np.ndarray, size: int) -> bool:
    """Whether rows are 0..size-1 in order."""
    return len(rows) == size and bool((np.asarray(rows) == np.arange(size)).all())


class DeviceTensors:
    """OrtValues on `device` ("cuda", or "cpu" to run the same path without a GPU); the op graphs (`graphs`:
    {element type name: {op: file}}, the bundle's) run with the given providers and session options."""

    views = False  # an OrtValue is its own buffer: BatchState.append and the engine's compaction copy instead

    def __init__(self, device: str, providers: list[str], options: ort.SessionOptions,
                 graphs: dict[str, dict[str, Path]], device_id: int = 0):
        self.device, self.device_id = device, device_id
        self.providers, self.options, self.graphs = providers, options, graphs
        self.sessions: dict[tuple[str, str], ort.InferenceSession] = {}

    def _run(self, op: str, dtype, **inputs) -> ort.OrtValue:
        key = (op, np.dtype(dtype).name)
        session = self.sessions.get(key)
        if session is None:
            session = self.sessions[key] = ort.InferenceSession(str(self.graphs[key[1]][op]), self.options,
                                                                providers=self.providers)
        binding = session.io_binding()
        for name, value in inputs.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:  # a small host array (indices, pads, masks): ONNX Runtime copies it over
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        binding.bind_output("y", self.device, self.device_id)
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def empty(self, shape: tuple, dtype) -> ort.OrtValue:
        """Uninitialised device memory, for outputs that ONNX Runtime fills completely."""
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, self.device_id)

    def zeros(self, shape: tuple, dtype) -> ort.OrtValue:
        return self._run("zeros", dtype, i=np.array(shape, np.int64))

    @staticmethod
    def shape(x: ort.OrtValue) -> tuple:
        return tuple(x.shape())

    @staticmethod
    def numpy(x: ort.OrtValue) -> np.ndarray:
        return x.numpy()

    @staticmethod
    def dtype(x: ort.OrtValue):
        return {"tensor(float)": np.float32, "tensor(float16)": np.float16}[x.data_type()]

    def pad(self, x: ort.OrtValue, axis: int, size: int, front: int = 0) -> ort.OrtValue:
        shape = self.shape(x)
        if front == 0 and shape[axis] >= size:
            return x
        assert front + shape[axis] <= size, (front, shape, size)
        pads = np.zeros(2 * len(shape), np.int64)
        pads[axis], pads[len(shape) + axis] = front, size - front - shape[axis]
        return self._run("pad", self.dtype(x), x=x, i=pads)

    def concat(self, xs: list[ort.OrtValue], axis: int) -> ort.OrtValue:
        assert axis == 1 and len(xs) == 2, "the batch joins two states along the row axis"
        return self._run("concat", self.dtype(xs[0]), x=xs[0], x2=xs[1])

    def concat_slots(self, xs: list[ort.OrtValue], stops: list[int], capacity: int) -> ort.OrtValue:
        """As HostTensors.concat_slots, with every slot (the graphs copy whole tensors anyway)."""
        return self.concat([self.pad(x, 3, capacity) for x in xs], 1)

    def take(self, x: ort.OrtValue, rows: np.ndarray, axis: int) -> ort.OrtValue:
        assert axis == 1, "rows are axis 1 of every device tensor"
        return self._run("take", self.dtype(x), x=x, i=np.asarray(rows, np.int64))

    def with_slots(self, x: ort.OrtValue, size: int, stop: int, zeros: bool = False) -> ort.OrtValue:
        """x with `size` slots (axis 3), its slots 0..stop-1 kept, zeros past x's (a new OrtValue: no room for
        rows here)."""
        return self.pad(x, 3, size) if size >= self.shape(x)[3] else self.slice(x, 3, 0, size)

    def slice(self, x: ort.OrtValue, axis: int, start: int, stop: int | None = None) -> ort.OrtValue:
        stop = self.shape(x)[axis] if stop is None else stop
        return self._run("slice", self.dtype(x), x=x, start=np.array([start], np.int64),
                         stop=np.array([stop], np.int64), axis=np.array([axis], np.int64))

    def scatter_rows(self, x: ort.OrtValue, rows: list[int], updates: ort.OrtValue) -> ort.OrtValue:
        index = np.asarray(rows, np.int64).reshape(1, -1, 1, 1, 1)
        return self._run("scatter_rows", self.dtype(x), x=x, r=index, u=updates)

    def place_rows(self, x: ort.OrtValue, rows: list[int], y: ort.OrtValue, start: int = 0,
                   width: int | None = None) -> ort.OrtValue:
        """As HostTensors.place_rows (the rows and slots taken and padded, then scattered)."""
        if start or len(rows) < self.shape(y)[1]:
            y = self.slice(y, 1, start, start + len(rows))
        if width is not None and width < self.shape(y)[3]:
            y = self.slice(y, 3, 0, width)
        return self.scatter_rows(x, rows, self.pad(y, 3, self.shape(x)[3]))

    def copy_rows(self, x: ort.OrtValue, dst: np.ndarray, src: np.ndarray, stop: int | None) -> ort.OrtValue:
        """As HostTensors.copy_rows, over every slot (the graphs copy the whole tensor anyway)."""
        return self.scatter_rows(x, dst, self.take(x, src, 1))

    def head(self, x: ort.OrtValue, n: int) -> ort.OrtValue:
        """As HostTensors.head, a copy (an OrtValue is not a view)."""
        return x if n == self.shape(x)[1] else self.slice(x, 1, 0, n)

    def take_slots(self, x: ort.OrtValue, rows: np.ndarray, stop: int) -> ort.OrtValue:
        """As HostTensors.take_slots, with every slot (the graph copies the whole rows anyway)."""
        return x if _every_row(rows, self.shape(x)[1]) else self.take(x, rows, 1)
