"""Parallel corpora: reading TSV and Moses files, and token-count batches with length bucketing.

Accepted inputs:
- a TSV file: source<TAB>target[<TAB>extra columns, ignored] (the Tatoeba/ManyThings layout);
- a Moses pair: two files with one sentence per line, aligned by line number;
- a directory written by `nmtserve data` (train.tsv, valid.tsv, test.tsv, novel.tsv).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nmtserve.errors import CorpusError

MAX_CHARS = 1000  # longer lines are skipped and counted, never truncated silently


@dataclass
class ReadStats:
    read: int = 0
    kept: int = 0
    skipped_empty: int = 0
    skipped_too_long: int = 0

    def add(self, other: ReadStats) -> None:
        for k, v in other.__dict__.items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class ParallelCorpus:
    pairs: list[tuple[str, str]] = field(default_factory=list)
    stats: ReadStats = field(default_factory=ReadStats)
    source: str = ""  # where it was read from, for messages and checkpoints


def _open_lines(path: Path):
    if not path.is_file():
        raise CorpusError(f"{path}: no such corpus file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().split("\n")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _keep(src: str, tgt: str, stats: ReadStats, max_chars: int) -> bool:
    stats.read += 1
    if not src.strip() or not tgt.strip():
        stats.skipped_empty += 1
        return False
    if len(src) > max_chars or len(tgt) > max_chars:
        stats.skipped_too_long += 1
        return False
    stats.kept += 1
    return True


def read_tsv(path: Path, max_chars: int = MAX_CHARS) -> ParallelCorpus:
    """Read source<TAB>target lines; a line without a tab is an error naming file and line."""
    path = Path(path)
    lines = _open_lines(path)
    if lines and lines[-1] == "":
        lines.pop()
    corpus = ParallelCorpus(source=str(path))
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line.strip():
            corpus.stats.read += 1
            corpus.stats.skipped_empty += 1
            continue
        cols = line.split("\t")
        if len(cols) < 2:
            raise CorpusError(f"{path}:{number}: missing column: expected source<TAB>target, found 1 column")
        src, tgt = cols[0].strip(), cols[1].strip()
        if _keep(src, tgt, corpus.stats, max_chars):
            corpus.pairs.append((src, tgt))
    return corpus


def read_moses(src_path: Path, tgt_path: Path, max_chars: int = MAX_CHARS) -> ParallelCorpus:
    """Read two line-aligned files; unequal line counts is an error naming both files."""
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    src_lines, tgt_lines = _open_lines(src_path), _open_lines(tgt_path)
    for lines in (src_lines, tgt_lines):
        if lines and lines[-1] == "":
            lines.pop()
    if len(src_lines) != len(tgt_lines):
        raise CorpusError(f"{src_path} has {len(src_lines)} lines but {tgt_path} has {len(tgt_lines)}: "
                          f"unequal line counts, the files are not aligned")
    corpus = ParallelCorpus(source=f"{src_path}+{tgt_path}")
    for src, tgt in zip(src_lines, tgt_lines):
        src, tgt = src.strip(), tgt.strip()
        if _keep(src, tgt, corpus.stats, max_chars):
            corpus.pairs.append((src, tgt))
    return corpus


def read_corpus(paths: list[str | Path], max_chars: int = MAX_CHARS) -> ParallelCorpus:
    """One TSV file, or a Moses pair of files."""
    if len(paths) == 1:
        return read_tsv(Path(paths[0]), max_chars)
    if len(paths) == 2:
        return read_moses(Path(paths[0]), Path(paths[1]), max_chars)
    raise CorpusError(f"expected a TSV file or a source and a target file, got {len(paths)} paths")


def split_file(data_dir: str | Path, split: str) -> Path:
    """The TSV file of a split in a directory written by `nmtserve data`."""
    path = Path(data_dir) / f"{split}.tsv"
    if not path.is_file():
        raise CorpusError(f"{path}: no {split!r} split in {data_dir}")
    return path


# ---------------------------------------------------------------- batching
@dataclass
class Example:
    src: list[int]
    tgt: list[int]  # without bos/eos


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) ids, padded
    src_mask: torch.Tensor  # (B, S) True at real tokens
    tgt_in: torch.Tensor  # (B, T) bos + target
    tgt_out: torch.Tensor  # (B, T) target + eos, pad elsewhere
    tgt_mask: torch.Tensor  # (B, T)
    n_tokens: int  # target tokens that count in the loss

    def to(self, device) -> Batch:
        return Batch(self.src.to(device), self.src_mask.to(device), self.tgt_in.to(device),
                     self.tgt_out.to(device), self.tgt_mask.to(device), self.n_tokens)


def pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: (B, T) ids and (B, T) mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, ids != pad_id


def collate(examples: list[Example], pad_id: int, bos_id: int, eos_id: int) -> Batch:
    src, src_mask = pad([e.src for e in examples], pad_id)
    tgt_in, tgt_mask = pad([[bos_id] + e.tgt for e in examples], pad_id)
    tgt_out, _ = pad([e.tgt + [eos_id] for e in examples], pad_id)
    return Batch(src, src_mask, tgt_in, tgt_out, tgt_mask, int(tgt_mask.sum()))


def token_batches(lengths: list[int], max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices grouped into batches of at most max_tokens (padded size), in a shuffled order.

    Examples are shuffled, sorted by length within buckets of 100 batches' worth, cut into
    batches, and the batches shuffled: little padding, yet a different mix every epoch.
    The result depends only on (lengths, max_tokens, seed, epoch), which makes resume exact.
    """
    rng = random.Random(f"{seed}-{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mean = max(1, sum(lengths) // max(1, len(lengths)))
    bucket = max(1, 100 * max_tokens // mean)
    batches = []
    for start in range(0, len(order), bucket):
        chunk = sorted(order[start:start + bucket], key=lambda i: lengths[i])
        current, longest = [], 0
        for i in chunk:
            longest_if = max(longest, lengths[i])
            if current and longest_if * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, longest_if = [], lengths[i]
            current.append(i)
            longest = longest_if
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches
