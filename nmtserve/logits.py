"""What a search does to a row's logits over the whole vocabulary before it ranks them: CTranslate2's logits
processors (`TokenMasks`), the log-softmax, and the k best of each row as the decoder's search head ranks them.
Numpy only."""

from __future__ import annotations

import numpy as np

from nmtserve.decoding import DecodingOptions


class TokenMasks:
    """CTranslate2's logits processors, in its order, on a search's rows' logits over the whole vocabulary, then the
    log-softmax: repetition_penalty on every token of the row's sequence (a forced prefix's included, the start
    token not: CTranslate2's alive sequence), then the disabled tokens: eos before min_decoding_length tokens, unk
    with disable_unk, each of suppress_sequences' last token where the sequence ends with the rest of it (a single
    token: always), and with no_repeat_ngram_size n every token that would repeat an n-gram of the sequence."""

    def __init__(self, options: DecodingOptions, eos_id: int, unk_id: int, start: list[int]):
        self.options, self.eos_id, self.unk_id, self.start = options, eos_id, unk_id, list(start)
        self.always = [s[0] for s in options.suppress_sequences if len(s) == 1] + ([unk_id] if options.disable_unk else [])
        self.sequences = [list(s) for s in options.suppress_sequences if len(s) > 1]

    def apply(self, logits: np.ndarray, histories: list[list[int]], step: int) -> np.ndarray:
        """logits (R, V) of rows whose tokens after the start and prefix are histories[r], at the search's step
        `step` (0: its first) -> their log-probs, penalised and masked (a copy)."""
        out = np.array(logits, np.float32)
        penalty = self.options.repetition_penalty
        if penalty != 1:
            for r, history in enumerate(histories):
                seen = list(set(self.start + history))
                logits = out[r, seen]
                out[r, seen] = np.where(logits < 0, logits * penalty, logits / penalty)
        if step < self.options.min_decoding_length:
            out[:, self.eos_id] = -np.inf
        if self.always:
            out[:, self.always] = -np.inf
        n = self.options.no_repeat_ngram_size
        for r, history in enumerate(histories):
            sequence = self.start + history
            for suppressed in self.sequences:
                if sequence[len(sequence) - len(suppressed) + 1:] == suppressed[:-1]:
                    out[r, suppressed[-1]] = -np.inf
            if n and len(sequence) >= n:
                tail = sequence[len(sequence) - n + 1:]
                banned = [sequence[i + n - 1] for i in range(len(sequence) - n + 1) if sequence[i:i + n - 1] == tail]
                out[r, banned] = -np.inf
        return log_softmax(out)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's log-probabilities (float32) from its logits; a row of -inf stays -inf."""
    out = np.array(logits, np.float32)
    live = np.isfinite(out).any(axis=1)
    top = out[live].max(axis=1, keepdims=True)
    out[live] -= top + np.log(np.exp(out[live] - top).sum(axis=1, keepdims=True))
    return out


def best_candidates(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k best tokens and their log-probs (R, k) from its log-probs over the vocabulary (R, V), best
    first, ties by lower id (as the decoder's TopK head ranks them)."""
    part = np.argpartition(-log_probs, k - 1, axis=1)[:, :k]
    cut = np.take_along_axis(log_probs, part, axis=1).min(axis=1, keepdims=True)
    ids = np.zeros((len(log_probs), k), np.int64)
    for r, row in enumerate(log_probs):
        tied = np.flatnonzero(row >= cut[r, 0])  # every token at least as good as the k-th: ties included, by id
        ids[r] = tied[np.argsort(-row[tied], kind="stable")][:k]
    return ids, np.take_along_axis(log_probs, ids, axis=1)
