"""The decoder batch's tensors: per-row state that rows bring when they join and take when they leave.

Used by OnnxTranslator (rows only leave) and by the server's RunningBatch (rows join and leave),
which leaves a finished row in place as a hole (`free`) and puts the next newcomer into it
(`insert`), so under steady load no step copies the cache; `relocate` compacts when holes pile up,
moving only the rows past the kept count, in place (a view of the same buffers, whose room past the
rows `append` fills with newcomers), and `trim` drops cache slots that no row reaches any more (a copy,
amortised).

Each row's cache is its own from slot 0: k, v (L, B, H, capacity, Dh) hold row b's keys and values
in slots 0..positions[b]-1, and a step writes its new ones at slot positions[b] (the decoder step's
attention kernel does, in place, and attends to exactly those slots: export/build/graphs.py), so a
row that joins later needs no alignment and attends over its own length only. cross_k, cross_v
(L, B, H, S, Dh) with src_mask (B, S), padded to the longest source of the batch, and cross_eos
(L, B, 2, H, Dh): each row's key and value at its last source slot (the decoder step's cross-attention
writes them back there: export/build/graphs.py), cross_slot (B,) int32 that slot; positions (B,)
each row's own step; tokens (B,) the token each row feeds next; hole (B,) rows freed and not yet
refilled: a hole stays at position 0 (its step writes and reads its own slot 0, ignored), so one
that stays in the batch for longer than the position table is still a valid input. A widened state
(`widen`, OnnxTranslator's offline beams) has `width` rows per source that share its one copy of the
source's tensors (cross_k, cross_v, cross_eos, src_mask, cross_slot: B / width rows); the engine's
states have width 1 (a beam's rows each hold a copy: `gather`).

A state with `origin` (B, capacity) int32 (OnnxTranslator's offline states, on the kernels'
DecodeBeamSelfAttention) keeps slot t of row b's history in row origin[b, t]'s cache: a beam row that
continues another row's hypothesis (`choose`) copies that row's origin, not its cache. Every slot is
written once, by the row that owns it (origin[b, t] = b for every slot b has not filled yet), and a
source's rows point only at each other, so a source's rows move together (`compact`, `relocate`) with their
origins shifted alike. The engine's states have it too on the kernels (a beam's rows, each with its own copy
of the source's cross K/V, point at each other's slots; a row that joins, leaves or grows holds its own slots:
`insert`, `free`, `append`). States without it (ONNX Runtime's attention, a device's) copy the cache rows.

k, v, cross_k, cross_v and cross_eos live where `ops` keeps them (export/runtime/tensors.py): numpy
arrays on the host, or OrtValues on the GPU; the small per-row arrays are always numpy on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nmtserve.export.runtime.tensors import HostTensors

FRESH_SLOTS = 32  # the cache slots of a state fresh from the encoder (open_slot doubles them when full)
SLOT_GRAIN = 8  # a cache that grows to its rows' budget (open_slot) grows to a multiple of this


@dataclass
class BatchState:
    k: object  # (L, B, H, capacity, Dh), numpy or OrtValue (see ops)
    v: object
    cross_k: object  # (L, B, H, S, Dh), numpy or OrtValue
    cross_v: object
    cross_eos: object  # (L, B, 2, H, Dh), numpy or OrtValue
    src_mask: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray
    hole: np.ndarray
    ops: object = field(default=HostTensors)  # HostTensors or a DeviceTensors
    width: int = 1  # rows per source: cross_k, cross_v, cross_eos, src_mask and cross_slot hold one row per
    # `width` rows (a widened beam's, OnnxTranslator's offline search); 1 for every state the engine holds
    origin: np.ndarray | None = None  # (B, capacity) int32: the row holding each slot of each row (above)
    cross_slot: np.ndarray = field(init=False)  # (B / width,) int32, each source's last slot: from src_mask

    def __post_init__(self):
        self.holes = bool(self.hole.any())  # kept by free and insert: a step without holes skips the mask
        self.cross_slot = eos_slot(self.src_mask)

    @classmethod
    def from_encoded(cls, cross_k, cross_v, cross_eos, src_mask: np.ndarray, bos_id: int, capacity: int = FRESH_SLOTS,
                     ops=HostTensors, origin: bool = False) -> BatchState:
        """Fresh rows (no step taken yet) from the encoder's outputs; origin: with `origin` (above)."""
        n_layers, batch, heads, _, head_dim = ops.shape(cross_k)
        shape, dtype = (n_layers, batch, heads, capacity, head_dim), ops.dtype(cross_k)
        return cls(ops.zeros(shape, dtype), ops.zeros(shape, dtype), cross_k, cross_v, cross_eos, src_mask,
                   np.zeros(batch, np.int64), np.full(batch, bos_id, np.int64), np.zeros(batch, bool), ops,
                   origin=own_slots(batch, capacity) if origin else None)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def capacity(self) -> int:
        return self.ops.shape(self.k)[3]

    @property
    def length(self) -> int:
        """Slots the longest row has filled."""
        return int(self.positions.max()) if self.size else 0

    @property
    def valid(self) -> np.ndarray:
        """(B, capacity): the slots each row has filled."""
        return np.arange(self.capacity)[None, :] < self.positions[:, None]

    def concatenate(self, other: BatchState) -> BatchState:
        """Rows of self, then rows of other, each with its own slots (and origins, renumbered)."""
        assert (self.origin is None) == (other.origin is None)
        ops = self.ops
        capacity = max(self.capacity, other.capacity)
        origin = None
        if self.origin is not None:  # slots past a state's capacity each row's own
            origin = own_slots(self.size + other.size, capacity)
            origin[:self.size, :self.capacity] = self.origin
            origin[self.size:, :other.capacity] = other.origin + self.size
        src_len = max(self.src_mask.shape[1], other.src_mask.shape[1])

        def widen(state: BatchState):
            return ops.pad(state.cross_k, 3, src_len), ops.pad(state.cross_v, 3, src_len)

        stops = [self.length, other.length]  # only filled slots are copied: no row reads past its own
        (cka, cva), (ckb, cvb) = widen(self), widen(other)
        return BatchState(
            ops.concat_slots([self.k, other.k], stops, capacity), ops.concat_slots([self.v, other.v], stops, capacity),
            ops.concat([cka, ckb], 1), ops.concat([cva, cvb], 1),
            ops.concat([self.cross_eos, other.cross_eos], 1),
            np.concatenate([HostTensors.pad(self.src_mask, 1, src_len), HostTensors.pad(other.src_mask, 1, src_len)]),
            np.concatenate([self.positions, other.positions]), np.concatenate([self.tokens, other.tokens]),
            np.concatenate([self.hole, other.hole]), ops, origin=origin)

    def append(self, fresh: BatchState, room: int = 0, start: int = 0) -> BatchState:
        """Fresh rows (no step taken yet but their forced prefix's: `Decoder.prefill`), fresh's rows from `start`
        on, after this state's -> the state of both.
        On the host they are written into the room past this state's rows when its buffers have enough (a state
        from `relocate` or an earlier append: no running row is copied); else this state's rows are copied once,
        into buffers with room for `room` rows (the rows' cap: no later newcomer copies them again; the room is
        address space only until rows are written there, the pages the kernel's until touched). On a device (an
        OrtValue is not a view) as `concatenate`."""
        assert self.width == fresh.width == 1
        if not self.ops.views:
            return self.concatenate(fresh.take(np.arange(start, fresh.size)) if start else fresh)
        first, size, state = self.size, self.size + fresh.size - start, self
        if not state._grown(size):  # no room: this state's rows are copied once, into buffers that have it
            try:
                state = self._with_room(max(size, room))
            except MemoryError:  # the room is address space, which a host may refuse (ulimit -v, strict overcommit)
                state = self._with_room(size)
            state._grown(size)
        state.insert(list(range(first, size)), fresh, start)
        return state

    def _grown(self, size: int) -> bool:
        """This state extended in place to `size` rows when the buffers behind its tensors have them: the new
        rows are holes, their tensors holding whatever the buffers held (insert fills them) -> whether they had."""
        grown = [self.ops.grow_rows(x, size) for x in (self.k, self.v, self.cross_k, self.cross_v, self.cross_eos)]
        if any(x is None for x in grown):
            return False
        self.k, self.v, self.cross_k, self.cross_v, self.cross_eos = grown
        extra = size - self.size
        self.src_mask = np.concatenate([self.src_mask, np.zeros((extra, self.src_mask.shape[1]), bool)])
        self.positions, self.tokens = (np.concatenate([x, np.zeros(extra, x.dtype)]) for x in (self.positions, self.tokens))
        self.cross_slot = np.concatenate([self.cross_slot, np.zeros(extra, np.int32)])
        self.hole = np.concatenate([self.hole, np.ones(extra, bool)])
        self.holes = True
        if self.origin is not None:  # the new rows' slots their own (insert writes them again)
            self.origin = np.concatenate([self.origin, own_slots(size, self.capacity)[size - extra:]])
        return True

    def _with_room(self, rows: int) -> BatchState:
        """A copy of this (host) state whose tensors are the first rows of buffers of `rows` rows (caches: the
        filled slots only)."""
        ops = self.ops
        k, v = (ops.with_rows(x, rows, self.length) for x in (self.k, self.v))
        cross_k, cross_v, eos = (ops.with_rows(x, rows, None) for x in (self.cross_k, self.cross_v, self.cross_eos))
        return BatchState(k, v, cross_k, cross_v, eos, self.src_mask, self.positions, self.tokens, self.hole, ops,
                          origin=None if self.origin is None else self.origin.copy())

    def open_slot(self, most: int | None = None) -> None:
        """Before a step: room for every row's next slot. A full cache doubles, or grows to `most` slots (rounded
        up to a multiple of SLOT_GRAIN) where that is less: the most any row can fill (their budgets)."""
        if self.length >= self.capacity:
            slots = 2 * self.capacity
            if most is not None:
                slots = max(self.capacity + 1, min(slots, -(-most // SLOT_GRAIN) * SLOT_GRAIN))
            self._resize(slots)

    def reserve(self, slots: int) -> None:
        """Room for `slots` slots a row at once (rounded up to a multiple of a fresh state's), so that rows that
        will fill them need not copy the cache as it doubles (`open_slot`): the server's batch, whose requests'
        budgets are known and bound its growth (a power of two would hold up to twice the slots they need)."""
        if slots > self.capacity:
            self._resize(-(-slots // FRESH_SLOTS) * FRESH_SLOTS)

    def _resize(self, slots: int) -> None:
        """The caches with `slots` slots a row, the filled ones kept (a copy), in buffers with the room for rows
        that theirs had (`append` still writes newcomers there); the new slots of an origin each row's own."""
        had = self.capacity
        self.k, self.v = (self.ops.with_slots(x, slots, self.length) for x in (self.k, self.v))
        if self.origin is not None:
            self.origin = np.concatenate([self.origin, own_slots(self.size, slots - had)], axis=1) if slots > had \
                else np.ascontiguousarray(self.origin[:, :slots])

    def advance(self) -> None:
        """After a step: every row but the holes has its K/V in its next slot and moves on.
        The rows' next tokens are the caller's to choose (`choose`)."""
        if self.holes:
            self.positions += ~self.hole
        else:  # one ufunc instead of two: Python between steps runs on caches the step has just flushed
            self.positions += 1

    def choose(self, tokens: np.ndarray, parents: np.ndarray | None = None) -> None:
        """The token each row feeds next; with `parents`, row i continues the hypothesis of row
        parents[i] (beam search): its self-attention cache is copied from there. Only rows of one
        request may be parents of each other (they share source, position and cache slots, so nothing
        else moves), and only the rows whose parent is another row are written (with `origin`, their origins),
        over the slots they have filled: in the server's batch other rows may have filled many more (a row's
        origin past its own filled slots stays its own: its next step writes its slot there)."""
        if parents is not None and len(moved := np.nonzero(parents != np.arange(self.size))[0]):
            filled = int(self.positions[moved].max())
            if self.origin is not None:  # beams of different lengths may move in one step
                own = np.arange(filled)[None, :] >= self.positions[moved][:, None]
                self.origin[moved, :filled] = np.where(own, moved[:, None], self.origin[parents[moved], :filled])
            else:
                self.k = self.ops.copy_rows(self.k, moved, parents[moved], filled)
                self.v = self.ops.copy_rows(self.v, moved, parents[moved], filled)
        self.tokens[:] = tokens  # in place: the decoder's binding holds this array's address

    def filter(self, keep: np.ndarray) -> BatchState | None:
        """Only the rows where keep is True (all of a source's rows or none when they share it), their
        caches cut to the longest of them. None if empty."""
        if not keep.any():
            return None
        ops, rows, kept = self.ops, np.nonzero(keep)[0], self._kept_sources(keep)
        sources = np.nonzero(kept)[0]
        length = int(self.positions[keep].max())
        src_len = int(self.src_mask[kept].any(axis=0).nonzero()[0].max()) + 1

        def cache(x):  # the slots in use, and room up to the capacity
            return ops.take_slots(x, rows, length)

        def cross(x):  # sources cut to the longest one kept
            x = ops.take(x, sources, 1) if len(sources) < len(kept) else x
            return ops.slice(x, 3, 0, src_len) if src_len < self.src_mask.shape[1] else x

        eos = ops.take(self.cross_eos, sources, 1) if len(sources) < len(kept) else self.cross_eos
        return BatchState(cache(self.k), cache(self.v), cross(self.cross_k), cross(self.cross_v), eos,
                          np.ascontiguousarray(self.src_mask[kept, :src_len]), self.positions[keep], self.tokens[keep],
                          self.hole[keep], ops, self.width, self._origin_of(rows))

    def _kept_sources(self, keep: np.ndarray) -> np.ndarray:
        """Which sources a row mask keeps (a widened state's rows of one source go together)."""
        kept = keep[::self.width]
        assert self.width == 1 or (keep.reshape(-1, self.width) == kept[:, None]).all(), "a source's rows go together"
        return kept

    def compact(self, keep: np.ndarray) -> tuple[BatchState | None, np.ndarray]:
        """Only the rows where keep is True, as `filter`, but out of order and copying only a few rows:
        the last kept sources move into the places of the dropped ones before them, and the state is the
        first rows of the same buffers (a view: each layer's rows stay one block, as the decoder's binding
        takes them). `filter` copies every kept row into new buffers -> (the state, None if no row is kept;
        the old index of each of its rows)."""
        if not keep.any():
            return None, np.zeros(0, np.int64)
        kept = self._kept_sources(keep)
        n = int(kept.sum())
        holes, movers = np.flatnonzero(~kept[:n]), np.flatnonzero(kept[n:]) + n  # as many of each
        sources = np.arange(n)
        sources[holes] = movers
        return self.relocate(sources), source_rows(sources, self.width)

    def relocate(self, sources: np.ndarray) -> BatchState:
        """The given sources (the old index of each new one; a source is `width` rows) as the first places of
        the same buffers, in that order, copying only the sources whose place changes (sources[i] != i), in
        place: the state is a view of those buffers (each layer's rows stay one block, as the decoder's
        binding takes them), and the places past it are room for `append`."""
        width, ops, n = self.width, self.ops, len(sources)
        order = source_rows(sources, width)
        k, v, cross_k, cross_v, eos = self.k, self.v, self.cross_k, self.cross_v, self.cross_eos
        moved = np.flatnonzero(sources != np.arange(n))
        if len(moved):  # copy_rows reads the moving rows before it writes any: a place may be both
            dst, src = moved, sources[moved]
            k, v = (ops.copy_rows(x, source_rows(dst, width), source_rows(src, width), self.length) for x in (k, v))
            cross_k, cross_v, eos = (ops.copy_rows(x, dst, src, None) for x in (cross_k, cross_v, eos))
        return BatchState(ops.head(k, n * width), ops.head(v, n * width), ops.head(cross_k, n), ops.head(cross_v, n),
                          ops.head(eos, n), self.src_mask[sources], self.positions[order], self.tokens[order],
                          self.hole[order], ops, width, self._origin_of(order))

    def moved_in_place(self, sources: np.ndarray, cross_eos_moved: bool) -> BatchState:
        """The state of the given sources (the old index of each new one; a source is `width` rows) once something
        else has moved them into the first places of the same buffers, as `relocate` would (nmtserve's library
        compacting an offline batch: kernels.cc, compact_groups): every bound tensor is already there, origins
        renumbered, so the state is views of those buffers; src_mask, and cross_eos unless the library moved it too
        (a shared-cross step does not bind it), are taken by `sources`."""
        n, rows, ops = len(sources), len(sources) * self.width, self.ops
        eos = ops.head(self.cross_eos, n) if cross_eos_moved else ops.take(self.cross_eos, sources, 1)
        return BatchState(ops.head(self.k, rows), ops.head(self.v, rows), ops.head(self.cross_k, n),
                          ops.head(self.cross_v, n), eos, self.src_mask[sources], self.positions[:rows],
                          self.tokens[:rows], self.hole[:rows], ops, self.width,
                          None if self.origin is None else self.origin[:rows])

    def _origin_of(self, rows: np.ndarray) -> np.ndarray | None:
        """The origin of a state of the given rows (the old index of each new row, whole sources: a source's
        rows point only at each other), renumbered to the new indices; None without one."""
        if self.origin is None:
            return None
        new_index = np.zeros(self.size, np.int32)
        new_index[rows] = np.arange(len(rows), dtype=np.int32)
        return new_index[self.origin[rows]]

    def gather(self, rows: np.ndarray) -> BatchState:
        """A new state of the given rows (indices, repeats allowed) in that order, with every slot, each
        with its own copy of its source's cross K/V: how a request with a beam of k rows joins the
        engine's batch from its one encoded row. The cache slots are copied, so each new row holds its own
        (a state with origins: only from rows that hold their own filled slots)."""
        assert self.width == 1 and (self.origin is None or self._own_filled_slots())
        ops, length = self.ops, self.length
        return BatchState(ops.take_slots(self.k, rows, length), ops.take_slots(self.v, rows, length),
                          ops.take(self.cross_k, rows, 1),
                          ops.take(self.cross_v, rows, 1), ops.take(self.cross_eos, rows, 1), self.src_mask[rows],
                          self.positions[rows], self.tokens[rows], self.hole[rows], ops,
                          origin=None if self.origin is None else own_slots(len(rows), self.capacity))

    def _own_filled_slots(self) -> bool:
        """Every row's filled slots are its own (`origin`)."""
        return bool((self.origin[self.valid] == np.nonzero(self.valid)[0]).all())

    def widen(self, width: int) -> BatchState:
        """Each row becomes `width` rows (a beam's, from its one encoded row) that share the row's source:
        its cross K/V stay one copy (the bundle's `decoder_shared` step reads them so)."""
        assert self.width == 1
        ops, rows, length = self.ops, np.repeat(np.arange(self.size), width), self.length
        return BatchState(ops.take_slots(self.k, rows, length), ops.take_slots(self.v, rows, length), self.cross_k,
                          self.cross_v,
                          self.cross_eos, self.src_mask, self.positions[rows], self.tokens[rows], self.hole[rows], ops,
                          width, None if self.origin is None else own_slots(len(rows), self.capacity))

    def take(self, rows: np.ndarray) -> BatchState:
        """A new state of the given rows (indices), in that order."""
        keep = np.zeros(self.size, bool)
        keep[rows] = True
        assert (np.asarray(rows) == np.nonzero(keep)[0]).all(), "rows must be increasing"
        return self.filter(keep)

    def free(self, rows: list[int]) -> None:
        """Rows become holes: they stop advancing and their slots stop counting (a hole's output is ignored);
        with origins, each holds its own slots again (a hole's step writes and reads its slot 0)."""
        if self.origin is not None:
            self.origin[rows] = np.asarray(rows, np.int32)[:, None]
        self.hole[rows] = True
        self.holes = True
        self.positions[rows] = 0

    def insert(self, rows: list[int], fresh: BatchState, start: int = 0) -> None:
        """Fresh rows, fresh's rows start.. one for each, into holes. Rows that took no step yet write their first
        K/V at their slot 0 (fresh's own caches are not read: `prefill` may make them without slots); the slots of
        a forced prefix (`Decoder.prefill`) are copied."""
        part = slice(start, start + len(rows))
        assert part.stop <= fresh.size
        ops = self.ops
        src_len = int(fresh.cross_slot[part].max()) + 1  # the longest of these newcomers' sources
        if src_len > self.src_mask.shape[1]:  # a longer source than any so far: widen (a copy, rare; zeros past the
            # rows' sources, and the buffers' room for rows kept, as `append` needs it)
            had, grow = self.src_mask.shape[1], max(src_len, self.src_mask.shape[1] * 3 // 2)
            self.cross_k, self.cross_v = (ops.with_slots(x, grow, had, zeros=True) for x in (self.cross_k, self.cross_v))
            self.src_mask = HostTensors.pad(self.src_mask, 1, grow)
        # the newcomers' cross K/V, zero past their own sources
        self.cross_k = ops.place_rows(self.cross_k, rows, fresh.cross_k, start, src_len)
        self.cross_v = ops.place_rows(self.cross_v, rows, fresh.cross_v, start, src_len)
        self.cross_eos = ops.place_rows(self.cross_eos, rows, fresh.cross_eos, start)
        self.src_mask[rows] = HostTensors.pad(fresh.src_mask[part, :src_len], 1, self.src_mask.shape[1])
        self.cross_slot[rows] = fresh.cross_slot[part]  # in place, as the other per-row arrays: the binding holds them
        if filled := int(fresh.positions[part].max()):  # a forced prefix's slots
            self.k, self.v = (ops.place_rows(x, rows, y, start, filled) for x, y in ((self.k, fresh.k), (self.v, fresh.v)))
        if self.origin is not None:  # each its own slots
            self.origin[rows] = np.asarray(rows, np.int32)[:, None]
        self.hole[rows] = False
        self.holes = bool(self.hole.any())
        self.positions[rows] = fresh.positions[part]
        self.tokens[rows] = fresh.tokens[part]

    def trim(self, min_slots: int = 0) -> None:
        """Drop the cache slots no row reaches once that halves the cache at least, keeping `min_slots` (the
        server's: what its running requests' budgets may fill), a fresh state's slots at least, and room for twice
        the longest row (amortised copy: the cache must shrink to a quarter of its rows' reach, or grow twofold,
        before it is copied again)."""
        min_slots = max(FRESH_SLOTS, min_slots)
        if self.capacity < 2 * min_slots:
            return  # nothing to drop (and the longest row is not looked up: asked at every step)
        keep = max(min_slots, 2 * (self.length + 1))
        if self.capacity >= 2 * keep:
            self._resize(keep)


def source_rows(sources: np.ndarray, width: int) -> np.ndarray:
    """The rows of the given sources, `width` each, in order."""
    return (sources[:, None] * width + np.arange(width)).ravel()


def own_slots(rows: int, capacity: int) -> np.ndarray:
    """An origin (B, capacity) int32 in which every row holds its own slots."""
    return np.repeat(np.arange(rows, dtype=np.int32)[:, None], capacity, axis=1)


def eos_of(cross_k: np.ndarray, cross_v: np.ndarray, src_mask: np.ndarray) -> np.ndarray:
    """cross_eos (L, B, 2, H, Dh) of host cross K/V (L, B, H, S, Dh): each row's key and value at its
    last source slot, as the encoder graph gives them."""
    rows, slot = np.arange(src_mask.shape[0]), eos_slot(src_mask)
    eos = np.stack([x[:, rows, :, slot] for x in (cross_k, cross_v)], axis=2)  # (B, L, 2, H, Dh)
    return np.ascontiguousarray(eos.swapaxes(0, 1))


def eos_slot(src_mask: np.ndarray) -> np.ndarray:
    """(B,) int32: each row's last source slot (its eos), as export/build/graphs.py's eos_slot."""
    return (np.maximum(src_mask.sum(1), 1) - 1).astype(np.int32)
