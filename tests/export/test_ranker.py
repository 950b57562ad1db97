"""The ranker graph (export/build/ranker.py), beam search's one ranking, against a reference written here in numpy."""

import numpy as np
import pytest

from tests.helpers import rank


def reference(beam: np.ndarray, ids: np.ndarray, scores: np.ndarray):
    """Each search's w best extensions by beam + score in float64, best first, ties by the lower (row, place):
    numpy's stable sort of the negated totals, row by row."""
    n, k, w = ids.shape
    total = (beam[:, :, None] + scores.astype(np.float64)).reshape(n, k * w)
    best = np.argsort(-total, axis=1, kind="stable")[:, :w]
    return best // w, np.take_along_axis(ids.reshape(n, k * w), best, axis=1), np.take_along_axis(total, best, axis=1)


@pytest.mark.parametrize("n,k", [(1, 1), (1, 4), (3, 2), (7, 5), (32, 4)])
def test_the_ranker_graph_ranks_as_the_reference_with_ties_and_rows_not_started(n, k):
    rng = np.random.default_rng(n * 10 + k)
    w = 2 * k
    for trial in range(20):
        # few distinct values, so that totals tie often, within a row and across rows
        scores = -rng.choice([0.5, 1.0, 1.5, 2.0, np.inf], size=(n, k, w)).astype(np.float32)
        scores.sort(axis=2)
        scores = scores[:, :, ::-1].copy()  # each row's candidates best first, as the decoder's head gives them
        ids = rng.integers(0, 50, size=(n, k, w))
        beam = -rng.choice([0.0, 0.5, 1.0], size=(n, k))
        if trial % 3 == 0:  # a search's first step: only its row 0 has started
            beam[:, 1:] = -np.inf
        got, expected = rank()(beam, ids, scores), reference(beam, ids, scores)
        for g, e, name in zip(got, expected, ("rows", "tokens", "totals")):
            assert g.shape == (n, w) and g.dtype == e.dtype, name
            np.testing.assert_array_equal(g, e, err_msg=name)
