"""The decoder batch's tensors: per-row state that rows bring when they join and take when they leave.

Used by OnnxTranslator (rows only leave) and by the server's RunningBatch (rows join and leave),
which leaves a finished row in place as a hole (`free`) and puts the next newcomer into it
(`insert`), so under steady load no step copies the cache; `filter` compacts when holes pile up
and `trim` drops cache slots that no row uses any more — both copy, and both are amortised.

k, v: (L, B, H, capacity, Dh) self-attention cache; valid: (B, capacity) which slots each row
filled (a row that joined later has invalid slots before its first step); cross_k, cross_v:
(L, B, H, W, Dh) with src_mask (B, W), padded to the longest source of the batch plus one scratch
slot, False in src_mask for every row (the decoder step writes there, export/build/graphs.py); positions
(B,) each row's own step; tokens (B,) the token each row feeds next; hole (B,) rows freed and not
yet refilled: a hole never advances (position 0, no cache slot), so one that stays in the batch
for longer than the position table is still a valid input.

k, v, cross_k and cross_v live where `ops` keeps them (export/runtime/tensors.py): numpy arrays on the
host, or OrtValues on the GPU; the small per-row arrays are always numpy on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nmtserve.export.runtime.tensors import HostTensors


@dataclass
class BatchState:
    k: object  # (L, B, H, capacity, Dh), numpy or OrtValue (see ops)
    v: object
    valid: np.ndarray
    length: int  # slots in use (the same for every row; invalid ones are masked)
    cross_k: object  # (L, B, H, S, Dh), numpy or OrtValue
    cross_v: object
    src_mask: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray
    hole: np.ndarray
    ops: object = field(default=HostTensors)  # HostTensors or a DeviceTensors

    @classmethod
    def from_encoded(cls, cross_k, cross_v, src_mask: np.ndarray, bos_id: int, capacity: int = 32,
                     ops=HostTensors) -> BatchState:
        """Fresh rows (no step taken yet) from the encoder's outputs."""
        n_layers, batch, heads, _, head_dim = ops.shape(cross_k)
        shape, dtype = (n_layers, batch, heads, capacity, head_dim), ops.dtype(cross_k)
        return cls(ops.zeros(shape, dtype), ops.zeros(shape, dtype), np.zeros((batch, capacity), bool), 0,
                   cross_k, cross_v, src_mask, np.zeros(batch, np.int64), np.full(batch, bos_id, np.int64),
                   np.zeros(batch, bool), ops)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def concatenate(self, other: BatchState) -> BatchState:
        """Rows of self, then rows of other; other's rows see only the slots they fill from now on."""
        ops = self.ops
        capacity = max(self.capacity, other.capacity, max(self.length, other.length) + 1)
        src_len = max(self.src_mask.shape[1], other.src_mask.shape[1])
        length = max(self.length, other.length)

        def align(state: BatchState):
            # right-align the used slots so that every row writes its next K/V at slot `length`;
            # slots from `state.length` on were never written (zeros, invalid) and are dropped
            shift, used = length - state.length, state.length

            def cache(x):
                return ops.pad(ops.slice(x, 3, 0, used) if state.capacity > used else x, 3, capacity, shift)

            return cache(state.k), cache(state.v), HostTensors.pad(state.valid[:, :used], 1, capacity, shift)

        def widen(state: BatchState):
            return ops.pad(state.cross_k, 3, src_len), ops.pad(state.cross_v, 3, src_len)

        (ka, va, ma), (kb, vb, mb) = align(self), align(other)
        (cka, cva), (ckb, cvb) = widen(self), widen(other)
        return BatchState(
            ops.concat([ka, kb], 1), ops.concat([va, vb], 1), np.concatenate([ma, mb]), length,
            ops.concat([cka, ckb], 1), ops.concat([cva, cvb], 1),
            np.concatenate([HostTensors.pad(self.src_mask, 1, src_len), HostTensors.pad(other.src_mask, 1, src_len)]),
            np.concatenate([self.positions, other.positions]), np.concatenate([self.tokens, other.tokens]),
            np.concatenate([self.hole, other.hole]), ops)

    def open_slot(self) -> None:
        """Before a step: room for slot `length` (the cache doubles when full), valid for every row, so
        that each attends to its own new key and value, which the step writes there."""
        if self.length == self.capacity:
            grow = 2 * self.capacity
            self.k, self.v = self.ops.pad(self.k, 3, grow), self.ops.pad(self.v, 3, grow)
            self.valid = HostTensors.pad(self.valid, 1, grow)
        self.valid[:, self.length] = True

    def advance(self) -> None:
        """After a step: slot `length` holds every row's K/V; holes do not count it and do not advance.
        The rows' next tokens are the caller's to choose (`choose`)."""
        if self.hole.any():
            self.valid[self.hole, self.length] = False
            self.positions += ~self.hole
        else:
            self.positions += 1
        self.length += 1

    def choose(self, tokens: np.ndarray, parents: np.ndarray | None = None) -> None:
        """The token each row feeds next; with `parents`, row i continues the hypothesis of row
        parents[i] (beam search): its self-attention cache is copied from there. Only rows of one
        request may be parents of each other (they share source, position and cache slots, so nothing
        else moves), and only the rows whose parent is another row are written."""
        if parents is not None:
            moved = np.nonzero(parents != np.arange(self.size))[0]
            if len(moved):
                ops, origin = self.ops, parents[moved]
                self.k = ops.copy_rows(self.k, moved, origin, self.length)
                self.v = ops.copy_rows(self.v, moved, origin, self.length)
        self.tokens = np.asarray(tokens, np.int64)

    def filter(self, keep: np.ndarray) -> BatchState | None:
        """Only the rows where keep is True; slots no remaining row uses are dropped. None if empty."""
        if not keep.any():
            return None
        ops, rows = self.ops, np.nonzero(keep)[0]
        valid = self.valid[keep]
        used = valid[:, : self.length].any(axis=0)
        first = int(used.argmax()) if used.any() else self.length
        src_len = int(self.src_mask[keep].any(axis=0).nonzero()[0].max()) + 2  # and the scratch slot

        def cache(x):  # the slots in use, first..length, and room up to the capacity less `first`
            return ops.take_slots(x, rows, first, self.length, self.capacity - first)

        def cross(x):  # sources cut to the longest one kept, and its scratch slot
            x = ops.take(x, rows, 1) if len(rows) < self.size else x
            return ops.slice(x, 3, 0, src_len) if src_len < self.src_mask.shape[1] else x

        return BatchState(cache(self.k), cache(self.v),
                          np.ascontiguousarray(valid[:, first:]), self.length - first,
                          cross(self.cross_k), cross(self.cross_v),
                          np.ascontiguousarray(self.src_mask[keep, :src_len]), self.positions[keep], self.tokens[keep], self.hole[keep], ops)

    def gather(self, rows: np.ndarray) -> BatchState:
        """A new state of the given rows (indices, repeats allowed) in that order, with every slot:
        how a request with a beam of k rows starts from its one encoded row."""
        ops = self.ops
        return BatchState(ops.take(self.k, rows, 1), ops.take(self.v, rows, 1), self.valid[rows], self.length,
                          ops.take(self.cross_k, rows, 1), ops.take(self.cross_v, rows, 1), self.src_mask[rows],
                          self.positions[rows], self.tokens[rows], self.hole[rows], ops)

    def take(self, rows: np.ndarray) -> BatchState:
        """A new state of the given rows (indices), in that order."""
        keep = np.zeros(self.size, bool)
        keep[rows] = True
        assert (np.asarray(rows) == np.nonzero(keep)[0]).all(), "rows must be increasing"
        return self.filter(keep)

    def free(self, rows: list[int]) -> None:
        """Rows become holes: their cache slots stop counting and they stop advancing (a hole's output is ignored)."""
        self.valid[rows] = False
        self.hole[rows] = True
        self.positions[rows] = 0

    def insert(self, rows: list[int], fresh: BatchState) -> None:
        """Fresh rows (no step taken yet) into holes; they write their first K/V at slot `length`."""
        assert fresh.length == 0 and len(rows) == fresh.size
        ops = self.ops
        src_len = fresh.src_mask.shape[1]
        if src_len > self.src_mask.shape[1]:  # a longer source than any so far: widen (a copy, rare)
            grow = max(src_len, self.src_mask.shape[1] * 3 // 2)
            self.cross_k, self.cross_v = ops.pad(self.cross_k, 3, grow), ops.pad(self.cross_v, 3, grow)
            self.src_mask = HostTensors.pad(self.src_mask, 1, grow)
        width = self.src_mask.shape[1]  # the newcomers' cross K/V, zero past their own source
        self.cross_k = ops.scatter_rows(self.cross_k, rows, ops.pad(fresh.cross_k, 3, width))
        self.cross_v = ops.scatter_rows(self.cross_v, rows, ops.pad(fresh.cross_v, 3, width))
        self.src_mask[rows] = HostTensors.pad(fresh.src_mask, 1, width)
        self.valid[rows] = False
        self.hole[rows] = False
        self.positions[rows] = fresh.positions
        self.tokens[rows] = fresh.tokens

    def trim(self, min_slots: int = 16) -> None:
        """Drop the leading cache slots no row uses once they are half the cache (amortised copy)."""
        used = self.valid[:, : self.length].any(axis=0)
        first = int(used.argmax()) if used.any() else self.length
        if first >= max(min_slots, self.length // 2):
            self.k, self.v = self.ops.slice(self.k, 3, first), self.ops.slice(self.v, 3, first)
            self.valid = np.ascontiguousarray(self.valid[:, first:])
            self.length -= first
