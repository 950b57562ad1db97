"""Decoding rules shared by every decoder (PyTorch reference, ONNX Runtime, the server), so that
they batch alike, stop at the same step and give the same tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

LENGTH_RULES = ("nmtserve", "transformers", "ctranslate2")


def output_budget(src_len: int, max_decoding_length: int, max_len: int, length_rule: str = "nmtserve") -> int:
    """Most target tokens a row may produce, eos aside. "nmtserve": the caller's limit, 2×source+10 (a
    guard against a decoder that never stops) and the model's position table; the last one is a real
    token (finish "length"). "transformers", the rule of transformers' generate with forced_eos_token_id:
    the caller's limit and the position table only, and the limit's last token is a forced eos with
    log-prob 0, so one real token fewer (BeamSearch finishes every live beam there). "ctranslate2",
    CTranslate2's max_decoding_length: the caller's limit and the position table only, the last one a real
    token (what the offline benchmark gives every engine: the same work for the same sentence)."""
    if length_rule == "transformers":
        return max(1, min(max_decoding_length, max_len) - 1)
    if length_rule == "ctranslate2":
        return max(1, min(max_decoding_length, max_len))
    return max(1, min(max_decoding_length, 2 * src_len + 10, max_len))


@dataclass(frozen=True)
class Limits:
    """Every limit a row can run into, from the bundle's manifest (`limits`), in one place. A source
    longer than max_source_tokens is refused by the server (OnnxTranslator truncates it) before it is
    encoded; a row's budget never takes it past the decoder's position table, so a row that reaches
    max_target_tokens finishes with LENGTH before a step could index past the table (a hole never
    advances: export/runtime/batch.py)."""

    max_source_tokens: int  # the encoder's position table
    max_target_tokens: int  # the decoder's position table: positions 0 .. max_target_tokens - 1

    def output_budget(self, src_len: int, max_decoding_length: int, length_rule: str = "nmtserve") -> int:
        return output_budget(src_len, max_decoding_length, self.max_target_tokens, length_rule)


def by_length(prefixes: list[list[int]]) -> list[list[int]]:
    """The indices of the prefixes of each length, shortest first: rows that start at one position together."""
    lengths = sorted({len(p) for p in prefixes})
    return [[i for i, p in enumerate(prefixes) if len(p) == n] for n in lengths]


def sorted_batches(lengths: list[int], max_batch_size: int, at_once: int = 1) -> Iterator[list[int]]:
    """Indices sorted by length, longest first, cut into as few batches of at most max_batch_size as
    possible, of sizes that differ by one at most (200 sources at 64: four of 50, not 64, 64, 64 and 8):
    little padding per batch, no small batch left at the end. With `at_once` batches decoded at once (each
    thread taking the next), their count is rounded up to a multiple of at_once where there are sources
    enough (200 at 32 on 2 threads: eight of 25, not seven of 28–29, the last of which would run alone), so
    that the threads finish about together."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    count = -(-len(order) // max_batch_size)
    count = min(len(order), -(-count // at_once) * at_once)
    bounds = [i * len(order) // count for i in range(count + 1)]
    for start, stop in zip(bounds, bounds[1:]):
        yield order[start:stop]


def guided_groups(batches: list, most: int, at_once: int = 1) -> list[list]:
    """Consecutive batches cut into groups of at most `most` (encoded in one call, then decoded one after
    another), with `at_once` threads each taking the next group: a group is at most a (2 × at_once)th of the
    batches left (OpenMP's guided schedule), so the groups shrink to single batches at the end and the threads
    finish about together. Batches longest first (sorted_batches), the last ones are also the shortest. 26 batches
    on 2 threads: 6, 5, 3, 3, 2, then single batches (fixed groups left one thread idle at the end:
    docs/performance-journal.md, "The threads' tail, and what two threads cost each other")."""
    groups, start = [], 0
    while start < len(batches):
        size = most if at_once == 1 else max(1, min(most, (len(batches) - start) // (2 * at_once)))
        groups.append(batches[start:start + size])
        start += size
    return groups
