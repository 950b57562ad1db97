"""A translation's attention: the bundle's aligner graph (export/build/graphs.py) run over sources and the tokens
decoded for them, after decoding. Decides no token: a request that asks for no attention never runs it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nmtserve.export.runtime.sessions import make_session

ROWS_PER_CALL = 32  # (source, target) pairs an aligner call takes at most: its activations stay small


class Aligner:
    """The aligner graph's session: CTranslate2's return_attention, the last decoder layer's first head."""

    def __init__(self, path: Path, device: str = "cpu", intra_op_threads: int = 0):
        self.session = make_session(path, device, intra_op_threads)

    def attention(self, sources: list[list[int]], targets: list[list[int]], start_id: int) -> list[np.ndarray]:
        """For each source (token ids) and target (the ids decoded for it, a forced prefix's first) -> (T, S)
        float32: at each target token, the weights over the source tokens that the step deciding it attended with.
        Pairs go by length, in calls of at most ROWS_PER_CALL."""
        found: list = [None] * len(sources)
        order = sorted(range(len(sources)), key=lambda i: (len(sources[i]), len(targets[i])))
        for first in range(0, len(order), ROWS_PER_CALL):
            rows = order[first:first + ROWS_PER_CALL]
            fed = [[start_id, *targets[i][:-1]] for i in rows]  # what each step was fed: the token before its own
            src_ids, src_mask = padded([sources[i] for i in rows])
            target_ids, _ = padded(fed)
            (weights,) = self.session.run(None, {"src_ids": src_ids, "src_mask": src_mask, "target_ids": target_ids})
            for row, i in enumerate(rows):
                found[i] = weights[row, :len(targets[i]), :len(sources[i])].copy()
        return found


def padded(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token-id sequences -> ids (B, N) int64 padded with 0 (at least one column), and their mask (B, N) bool."""
    lengths = np.array([len(s) for s in seqs])
    ids = np.zeros((len(seqs), max(1, lengths.max())), np.int64)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    return ids, np.arange(ids.shape[1])[None, :] < lengths[:, None]
