"""Beam search's ranking: the bundle's ranker graph (export/build/ranker.py says what it computes) in a session of
its own, on the CPU whatever device decodes (a step's candidates are on the host by then). Every beam step of every
loop ranks through it: `Ranker.rank` here, the kernel library's loop through `native` (the same graph in a session
of the library's, made where the decoder's step runs in the library). Decides nothing else: what a step then does
is nmtserve/search.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nmtserve.export.runtime.native import NativeSession
from nmtserve.export.runtime.sessions import make_session


class Ranker:
    def __init__(self, path: Path, eos_id: int, native: bool = False):
        self.session = make_session(path, "cpu", intra_op_threads=1)
        self.eos = np.array(eos_id, np.int64)  # the graph's eos input (the library's loop binds its own)
        self._outputs = [o.name for o in self.session.get_outputs()]
        self.native = NativeSession(path.read_bytes(), 1, {}) if native else None

    def rank(self, beam: np.ndarray, ids: np.ndarray, scores: np.ndarray) \
            -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """beam (n, k), ids and scores (n, k, w): n searches' rows and their candidates -> rows, tokens (int64) and
        totals (float64), each (n, w): each search's w best extensions, best first; and ended (n,) bool: an eos
        among each search's k best."""
        feeds = {"beam": np.ascontiguousarray(beam, np.float64), "ids": np.ascontiguousarray(ids, np.int64),
                 "scores": np.ascontiguousarray(scores, np.float32), "eos": self.eos}
        return tuple(self.session._sess.run(self._outputs, feeds, None))  # the C object: the wrapper's checks cost more
