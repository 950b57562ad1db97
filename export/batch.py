"""The running decoder batch: per-row state that requests bring when they join and take when they leave.

Used by OnnxTranslator (rows only leave) and by the server's engine (rows join and leave). The
engine leaves a finished row in place as a hole (`free`) and puts the next newcomer into it
(`insert`), so under steady load no step copies the cache; `filter` compacts when holes pile up
and `trim` drops cache slots that no row uses any more — both copy, and both are amortised.

k, v: (L, B, H, capacity, Dh) self-attention cache; valid: (B, capacity) which slots each row
filled (a row that joined later has invalid slots before its first step); cross_k, cross_v:
(L, B, H, S, Dh) with src_mask (B, S), padded to the longest source of the batch; positions
(B,) each row's own step; tokens (B,) the token each row feeds next.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _pad_axis(a: np.ndarray, axis: int, size: int) -> np.ndarray:
    if a.shape[axis] >= size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return np.pad(a, widths)


@dataclass
class BatchState:
    k: np.ndarray
    v: np.ndarray
    valid: np.ndarray
    length: int  # slots in use (the same for every row; invalid ones are masked)
    cross_k: np.ndarray
    cross_v: np.ndarray
    src_mask: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray

    @classmethod
    def from_encoded(cls, cross_k: np.ndarray, cross_v: np.ndarray, src_mask: np.ndarray, bos_id: int,
                     capacity: int = 32) -> "BatchState":
        """Fresh rows (no step taken yet) from the encoder's outputs."""
        n_layers, batch, heads, _, head_dim = cross_k.shape
        k = np.zeros((n_layers, batch, heads, capacity, head_dim), cross_k.dtype)
        return cls(k, np.zeros_like(k), np.zeros((batch, capacity), bool), 0, cross_k, cross_v, src_mask,
                   np.zeros(batch, np.int64), np.full(batch, bos_id, np.int64))

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def concatenate(self, other: "BatchState") -> "BatchState":
        """Rows of self, then rows of other; other's rows see only the slots they fill from now on."""
        capacity = max(self.k.shape[3], other.k.shape[3], max(self.length, other.length) + 1)
        src_len = max(self.src_mask.shape[1], other.src_mask.shape[1])
        length = max(self.length, other.length)

        def align(state: "BatchState"):
            # right-align the used slots so that every row writes its next K/V at slot `length`
            shift = length - state.length
            k, v, valid = (np.roll(_pad_axis(a, ax, capacity), shift, axis=ax)
                           for a, ax in ((state.k, 3), (state.v, 3), (state.valid, 1)))
            return k, v, valid

        (ka, va, ma), (kb, vb, mb) = align(self), align(other)
        return BatchState(
            np.concatenate([ka, kb], axis=1), np.concatenate([va, vb], axis=1), np.concatenate([ma, mb]), length,
            np.concatenate([_pad_axis(self.cross_k, 3, src_len), _pad_axis(other.cross_k, 3, src_len)], axis=1),
            np.concatenate([_pad_axis(self.cross_v, 3, src_len), _pad_axis(other.cross_v, 3, src_len)], axis=1),
            np.concatenate([_pad_axis(self.src_mask, 1, src_len), _pad_axis(other.src_mask, 1, src_len)]),
            np.concatenate([self.positions, other.positions]), np.concatenate([self.tokens, other.tokens]))

    def append(self, new_k: np.ndarray, new_v: np.ndarray, tokens: np.ndarray) -> None:
        """Write the step's K/V (L, B, H, 1, Dh) at slot `length`; advance every row."""
        if self.length == self.k.shape[3]:
            grow = self.k.shape[3]
            self.k, self.v = _pad_axis(self.k, 3, 2 * grow), _pad_axis(self.v, 3, 2 * grow)
            self.valid = _pad_axis(self.valid, 1, 2 * grow)
        self.k[:, :, :, self.length] = new_k[:, :, :, 0]
        self.v[:, :, :, self.length] = new_v[:, :, :, 0]
        self.valid[:, self.length] = True
        self.length += 1
        self.positions += 1
        self.tokens = tokens

    def filter(self, keep: np.ndarray) -> "BatchState | None":
        """Only the rows where keep is True; slots no remaining row uses are dropped. None if empty."""
        if not keep.any():
            return None
        valid = self.valid[keep]
        used = valid[:, : self.length].any(axis=0)
        first = int(used.argmax()) if used.any() else self.length
        src_len = int(self.src_mask[keep].any(axis=0).nonzero()[0].max()) + 1
        c = np.ascontiguousarray  # ONNX Runtime would copy a non-contiguous input on every step
        return BatchState(c(self.k[:, keep, :, first:]), c(self.v[:, keep, :, first:]), c(valid[:, first:]),
                          self.length - first, c(self.cross_k[:, keep, :, :src_len]), c(self.cross_v[:, keep, :, :src_len]),
                          c(self.src_mask[keep, :src_len]), self.positions[keep], self.tokens[keep])

    def take(self, rows: np.ndarray) -> "BatchState":
        """A new state of the given rows (indices), in that order."""
        keep = np.zeros(self.size, bool)
        keep[rows] = True
        assert (np.asarray(rows) == np.nonzero(keep)[0]).all(), "rows must be increasing"
        return self.filter(keep)

    def free(self, rows: list[int]) -> None:
        """Rows become holes: their cache slots stop counting (a hole's output is ignored)."""
        self.valid[rows] = False

    def insert(self, rows: list[int], fresh: "BatchState") -> None:
        """Fresh rows (no step taken yet) into holes; they write their first K/V at slot `length`."""
        assert fresh.length == 0 and len(rows) == fresh.size
        src_len = fresh.src_mask.shape[1]
        if src_len > self.src_mask.shape[1]:  # a longer source than any so far: widen (a copy, rare)
            grow = max(src_len, self.src_mask.shape[1] * 3 // 2)
            self.cross_k, self.cross_v = _pad_axis(self.cross_k, 3, grow), _pad_axis(self.cross_v, 3, grow)
            self.src_mask = _pad_axis(self.src_mask, 1, grow)
        self.cross_k[:, rows, :, :src_len], self.cross_k[:, rows, :, src_len:] = fresh.cross_k, 0
        self.cross_v[:, rows, :, :src_len], self.cross_v[:, rows, :, src_len:] = fresh.cross_v, 0
        self.src_mask[rows, :src_len], self.src_mask[rows, src_len:] = fresh.src_mask, False
        self.valid[rows] = False
        self.positions[rows] = fresh.positions
        self.tokens[rows] = fresh.tokens

    def trim(self, min_slots: int = 16) -> None:
        """Drop the leading cache slots no row uses once they are half the cache (amortised copy)."""
        used = self.valid[:, : self.length].any(axis=0)
        first = int(used.argmax()) if used.any() else self.length
        if first >= max(min_slots, self.length // 2):
            c = np.ascontiguousarray
            self.k, self.v, self.valid = c(self.k[:, :, :, first:]), c(self.v[:, :, :, first:]), c(self.valid[:, first:])
            self.length -= first
