"""glibc's malloc, tuned for decoding: freed memory kept for the next batch, and handed back on request.

With ONNX Runtime's arena off (so that resident memory follows the load), every tensor of a step, the
encoder's outputs, the batch's caches and their copies come from malloc, in blocks of hundreds of kB to
tens of MB that are freed and asked for again batch after batch. No-ops off glibc (LIBC is None there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform == "linux" else None
# mallopt's parameters (malloc.h) and the values keep_freed_memory sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this size come from the heap, not from mmap
HEAP_TRIM_THRESHOLD = 256 << 20  # free() gives the heap's top back only above this (release_free_memory: all)


def keep_freed_memory() -> bool:
    """Let malloc reuse freed memory rather than hand it back at once (process-wide; OnnxTranslator sets it
    unless told not to) -> whether it was set. By default a block above a threshold (128 kB, raised as such
    blocks are freed) is mmap'd and munmap'd at free, and free trims the heap's top, so the next batch's
    caches (a beam's widened rows), cross K/V and ONNX Runtime's outputs are faulted in
    page by page again (docs/performance-journal.md, "Freed memory kept for the next batch")."""
    mallopt = getattr(LIBC, "mallopt", None)
    if mallopt is None:
        return False
    # both or neither: a trim threshold alone also fixes the mmap threshold at its 128 kB start
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD))


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (malloc_trim): resident memory otherwise stays at the
    level the largest batches needed (the server's engine calls it every few seconds)."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
