"""Decoding rules shared by every decoder (PyTorch reference, ONNX Runtime, the server), so that
they batch alike, stop at the same step and give the same tokens."""

from __future__ import annotations

from collections.abc import Iterator


def output_budget(src_len: int, max_decoding_length: int, max_len: int) -> int:
    """Most target tokens a row may produce: the caller's limit, 2×source+10, the model's position table."""
    return max(1, min(max_decoding_length, 2 * src_len + 10, max_len))


def sorted_batches(lengths: list[int], max_batch_size: int) -> Iterator[list[int]]:
    """Indices sorted by length, cut into batches of at most max_batch_size: little padding per batch."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for start in range(0, len(order), max_batch_size):
        yield order[start:start + max_batch_size]
