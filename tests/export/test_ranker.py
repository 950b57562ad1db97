"""The ranker graph (export/build/ranker.py), beam search's one ranking, against a reference written here in numpy."""

import numpy as np
import pytest

from tests.helpers import rank


def reference(beam: np.ndarray, ids: np.ndarray, scores: np.ndarray, eos_id: int):
    """Each search's w best extensions by beam + score in float64, best first, ties by the lower (row, place):
    numpy's stable sort of the negated totals, row by row; and whether eos_id is among each search's k best."""
    n, k, w = ids.shape
    total = (beam[:, :, None] + scores.astype(np.float64)).reshape(n, k * w)
    best = np.argsort(-total, axis=1, kind="stable")[:, :w]
    tokens = np.take_along_axis(ids.reshape(n, k * w), best, axis=1)
    return best // w, tokens, np.take_along_axis(total, best, axis=1), (tokens[:, :k] == eos_id).any(axis=1)


@pytest.mark.parametrize("n,k", [(1, 1), (1, 4), (3, 2), (7, 5), (32, 4)])
def test_the_ranker_graph_ranks_as_the_reference_with_ties_and_rows_not_started(n, k):
    rng = np.random.default_rng(n * 10 + k)
    w, seen = 2 * k, set()
    for trial in range(20):
        # few distinct values, so that totals tie often, within a row and across rows
        scores = -rng.choice([0.5, 1.0, 1.5, 2.0, np.inf], size=(n, k, w)).astype(np.float32)
        scores.sort(axis=2)
        scores = scores[:, :, ::-1].copy()  # each row's candidates best first, as the decoder's head gives them
        ids = rng.integers(0, 12, size=(n, k, w))  # eos (3) among some searches' k best, not others
        beam = -rng.choice([0.0, 0.5, 1.0], size=(n, k))
        if trial % 3 == 0:  # a search's first step: only its row 0 has started
            beam[:, 1:] = -np.inf
        got, expected = rank(3)(beam, ids, scores), reference(beam, ids, scores, 3)
        for g, e, name in zip(got, expected, ("rows", "tokens", "totals", "ended")):
            assert g.shape == ((n, w) if name != "ended" else (n,)) and g.dtype == e.dtype, name
            np.testing.assert_array_equal(g, e, err_msg=name)
        seen.update(got[3].tolist())
    assert seen == {True, False}  # both answers met
