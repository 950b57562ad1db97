"""The search rules of nmtserve/search.py on hand-made candidate tables (no model)."""

import numpy as np
import pytest

from nmtserve.decoding import DecodingOptions, guided_groups, sorted_batches
from nmtserve.errors import ConfigError
from nmtserve.sampling import Sampling, _first_past, sample_index, sample_whole
from nmtserve.search import BeamSearch, Progress, beam_steps, make_search
from tests.helpers import rank, top_candidates

EOS = 3
V = 10


def table(rows: list[dict[int, float]]) -> np.ndarray:
    """(rows, V) log-probs (float32, as a decoder's): the given tokens get the given log-probs, the rest share
    what is left."""
    out = np.full((len(rows), V), -20.0, np.float32)
    for r, probs in enumerate(rows):
        for token, lp in probs.items():
            out[r, token] = lp
    return out


def step(search, log_probs: np.ndarray):
    candidates = top_candidates(log_probs, search.candidates)
    return search.step(*candidates, rank(EOS)) if isinstance(search, BeamSearch) else search.step(*candidates)


def test_the_first_step_extends_beam_0_only_and_an_eos_candidate_finishes_and_is_replaced():
    search = BeamSearch(DecodingOptions(beam_size=2, num_hypotheses=2), budget=10, eos_id=EOS)
    # every row sees the same distribution at the first step; only row 0's extensions count
    parents, tokens = step(search, table([{5: -0.1, 6: -2.5, 7: -3.0}] * 2))
    assert parents.tolist() == [0, 0] and tokens.tolist() == [5, 6]
    # the best candidate is eos (row 0): it finishes, and the first non-eos candidate past the beam
    # (row 1's token 8, the 4th best) takes its place; the 2nd (row 0's token 9) stays
    parents, tokens = step(search, table([{EOS: -0.1, 9: -0.5}, {8: -0.3, EOS: -0.2}]))
    assert search.finished == [([5], pytest.approx(-0.2), True, "eos")]
    assert sorted(zip(parents.tolist(), tokens.tolist())) == [(0, 9), (1, 8)]
    assert not search.done  # 1 finished < num_hypotheses 2
    step(search, table([{EOS: -0.1}, {EOS: -0.1}]))
    assert search.done
    assert [(h.tokens, h.finish) for h in search.results()] == [([5], "eos"), ([5, 9], "eos")]


def test_eos_candidates_past_the_beam_are_dropped_not_finished():
    search = BeamSearch(DecodingOptions(beam_size=2), budget=10, eos_id=EOS)
    step(search, table([{5: -0.1, 6: -0.2}] * 2))
    # row 1's eos (-0.2 - 0.15) is the 3rd candidate: past the beam, it finishes nothing
    parents, tokens = step(search, table([{7: -0.1, 8: -0.2}, {EOS: -0.15, 9: -5.0}]))
    assert search.finished == [] and tokens.tolist() == [7, 8] and parents.tolist() == [0, 0]


def test_without_a_length_penalty_the_search_stops_once_the_best_candidate_has_finished():
    search = BeamSearch(DecodingOptions(beam_size=2, patience=5.0), budget=10, eos_id=EOS)
    step(search, table([{5: -0.1, 6: -0.2}] * 2))
    step(search, table([{7: -0.1, EOS: -0.2}, {8: -0.5}]))  # a finished candidate that is not the best
    assert len(search.finished) == 1 and not search.done
    step(search, table([{EOS: -0.05}, {9: -0.2}]))  # patience plays no part without a length penalty
    assert search.done and search.results()[0].tokens == [5, 7]


def test_with_a_length_penalty_patience_sets_how_many_hypotheses_finish_and_longer_ones_can_win():
    short_then_long = [table([{5: -0.1, 6: -0.5}] * 2), table([{EOS: -1.0, 7: -1.1}, {8: -3.0}]),
                       table([{EOS: -0.1, 9: -4.0}, {EOS: -0.2}])]
    plain, penalised = (BeamSearch(DecodingOptions(beam_size=2, length_penalty=lp, patience=1.0), 10, EOS)
                        for lp in (0.0, 1.0))
    for log_probs in short_then_long:
        step(plain, log_probs)
        step(penalised, log_probs)
    assert plain.results()[0].tokens == [5]  # -1.1 raw beats [5, 7]'s -1.4
    best = penalised.results()[0]  # -1.4 / 3 tokens (eos counted) beats -1.1 / 2
    assert best.tokens == [5, 7] and best.score == pytest.approx(-1.4 / 3)
    patient = BeamSearch(DecodingOptions(beam_size=2, length_penalty=1.0, patience=2.0), 10, EOS)
    for log_probs in short_then_long:
        step(patient, log_probs)
    assert len(patient.finished) == 3 and not patient.done  # round(2 × 2.0) = 4 must finish


def test_transformers_stopping_goes_on_while_a_live_beam_can_beat_the_worst_of_the_beam_best_finished():
    steps = [table([{5: -0.1, 6: -0.2}] * 2),
             table([{7: -0.1, EOS: -0.5}, {8: -0.5}]),  # [5] finishes at -0.6 / 2; live [5, 7], [6, 8]
             table([{9: -0.1, EOS: -0.3}, {4: -5.0}]),  # [5, 7] finishes at -0.5 / 3; live [5, 7, 9] at -0.3
             table([{EOS: -0.05, 1: -2.0}, {2: -5.0}])]  # [5, 7, 9] finishes at -0.35 / 4
    ct2, hf = (BeamSearch(DecodingOptions(beam_size=2, length_penalty=1.0, beam_stopping=rule), 10, EOS)
               for rule in ("ctranslate2", "transformers"))
    for search in (ct2, hf):
        for log_probs in steps[:3]:
            step(search, log_probs)
    # CTranslate2: round(2 × patience 1) hypotheses have finished: stop. transformers: the best live
    # beam, -0.3 / 3 steps, beats the worst finished (-0.6 / 2): go on
    assert ct2.done and not hf.done
    assert ct2.results()[0].tokens == [5, 7]
    step(hf, steps[3])  # now the best live beam (-2.3 / 4) cannot beat the worst of the best two
    assert hf.done and hf.results()[0].tokens == [5, 7, 9] and hf.results()[0].score == pytest.approx(-0.35 / 4)


def test_the_last_step_of_the_budget_finishes_every_beam_with_length():
    search = BeamSearch(DecodingOptions(beam_size=2, num_hypotheses=2), budget=2, eos_id=EOS)
    step(search, table([{5: -0.1, 6: -0.2}] * 2))
    assert search.settled() == []  # [5] and [6] share nothing yet
    step(search, table([{7: -0.1}, {7: -0.3}]))
    assert search.done
    assert [(h.tokens, h.finish) for h in search.results()] == [([5, 7], "length"), ([6, 7], "length")]


def test_settled_is_the_prefix_every_live_and_finished_hypothesis_shares():
    search = BeamSearch(DecodingOptions(beam_size=2, num_hypotheses=2), budget=10, eos_id=EOS)
    step(search, table([{5: -0.1, 6: -3.0}] * 2))
    step(search, table([{7: -0.1, 8: -0.2}, {9: -9.0}]))
    assert search.live == [[5, 7], [5, 8]] and search.settled() == [5]
    step(search, table([{EOS: -0.1, 4: -0.3}, {4: -0.2}]))
    assert search.settled() == [5]  # the finished [5, 7] keeps 7 and 8 apart


@pytest.mark.parametrize("options", [
    DecodingOptions(beam_size=3, num_hypotheses=2),
    DecodingOptions(beam_size=3, num_hypotheses=3, length_penalty=1.0, patience=2.0),
    DecodingOptions(beam_size=2, num_hypotheses=2, beam_stopping="transformers", length_rule="transformers"),
])
def test_beam_steps_of_many_searches_are_each_searchs_own_steps(options):
    """beam_steps ranks every search's candidates at once and takes ordinary steps itself: the parents,
    tokens and results must be those of each search stepped alone, on random tables where eos is often
    among the best, with budgets that run out, and with a search that is over (None) among them."""
    rng = np.random.default_rng(7)
    k, budgets = options.beam_size, [4, 9, 30, 12, 2]
    alone = [BeamSearch(options, b, EOS) for b in budgets]
    together = [BeamSearch(options, b, EOS) for b in budgets]
    slots = list(range(len(budgets)))
    while any(r is not None for r in slots):
        log_probs = np.log(rng.dirichlet(np.full(V, 0.3), size=len(slots) * k))
        ids, scores = top_candidates(log_probs, 2 * k)
        parents, tokens = beam_steps([None if r is None else together[r] for r in slots], ids, scores, rank(EOS))
        for j, r in enumerate(slots):
            own = slice(j * k, (j + 1) * k)
            if r is None:  # its rows decode on, ignored, each continuing itself
                assert parents[own].tolist() == list(range(j * k, (j + 1) * k))
                continue
            expected_parents, expected_tokens = alone[r].step(ids[own], scores[own], rank(EOS))
            assert parents[own].tolist() == (expected_parents + j * k).tolist()
            assert tokens[own].tolist() == expected_tokens.tolist()
            assert together[r].done == alone[r].done
            if alone[r].done:
                assert together[r].results() == alone[r].results()
                slots[j] = None
    assert sum(s.steps for s in alone) > 4 * len(budgets)  # some searches ran several steps


def test_sampling_follows_the_distribution_and_a_seed_repeats_it():
    log_probs = np.log(np.array([0.5, 0.3, 0.2]))
    draws = [sample_index(log_probs, 1.0, 1.0, np.random.Generator(np.random.PCG64(seed))) for seed in range(1, 20001)]
    assert np.allclose(np.bincount(draws, minlength=3) / len(draws), [0.5, 0.3, 0.2], atol=0.015)
    # top-p 0.7: 0.5 is below it so the next token is kept too; 0.8 reaches it, so the third is not
    draws = [sample_index(log_probs, 1.0, 0.7, np.random.Generator(np.random.PCG64(seed))) for seed in range(1, 5001)]
    assert set(draws) == {0, 1} and abs(draws.count(0) / len(draws) - 0.625) < 0.03
    # a low temperature sharpens towards the best
    cold = [sample_index(log_probs, 0.05, 1.0, np.random.Generator(np.random.PCG64(seed))) for seed in range(1, 501)]
    assert cold.count(0) >= 495

    def run(seed: int) -> list[int]:
        search = Sampling(DecodingOptions(sampling_topk=0, seed=seed), budget=8, eos_id=EOS)
        while not search.done:
            step(search, table([{5: -1.0, 6: -1.2, 7: -1.4, EOS: -2.5}]))
        return search.results()[0].tokens

    assert run(11) == run(11) and len({tuple(run(s)) for s in range(1, 30)}) > 5


@pytest.mark.parametrize("topp", [1.0, 0.9, 0.3])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 3.0])
def test_sampling_the_whole_vocabulary_unranked_draws_the_token_of_the_ranked_draw(temperature, topp):
    """sample_whole over a row's log-probs by id draws, seed for seed, the token that sample_index draws from
    the same row ranked best first with ties by lower id (top_candidates: what the TopK head gives):
    rows with ties (values rounded to a few levels) and without, a peaked one, and one whose tail's
    probabilities underflow to 0."""
    rng = np.random.default_rng(int(temperature * 10 + topp * 100))
    rows = [rng.standard_normal(500), np.round(rng.standard_normal(500), 1), np.r_[40.0, rng.standard_normal(499)],
            np.r_[0.0, rng.standard_normal(499) - 800], rng.standard_normal(3000)]  # 3,000: blocks of the mass
    for logits in rows:
        log_probs = (logits - np.log(np.exp(logits).sum())).astype(np.float32)
        ids, scores = top_candidates(log_probs[None], 0)
        for seed in range(1, 200):
            ranked = ids[0, sample_index(scores[0], temperature, topp, np.random.Generator(np.random.PCG64(seed)))]
            assert sample_whole(log_probs, temperature, topp, np.random.Generator(np.random.PCG64(seed))) == ranked


@pytest.mark.parametrize("n", [7, 1024, 1025, 5000])
def test_the_first_place_past_a_mass_found_by_blocks_is_the_cumulative_sums(n):
    """_first_past (sums of blocks, then one block's cumulative sum) gives what a search of the whole cumulative
    sum gives, for either side, at limits on a sum and between sums, and past the total. Whole numbers: the sums
    are exact in any order."""
    probs = np.random.default_rng(n).integers(0, 5, n).astype(np.float64)
    mass = np.cumsum(probs)
    limits = [0.0, 0.5, *mass[[0, n // 3, n // 2, n - 1]], mass[n // 2] + 0.5, mass[-1] + 1]
    for limit in limits:
        for side in ("left", "right"):
            assert _first_past(probs, limit, side) == min(int(np.searchsorted(mass, limit, side)), n), (limit, side)


def test_a_top_p_draw_never_lands_past_the_last_token_kept():
    """A draw at the very end of the sum, where rounding can put it, falls on the last candidate kept, not on
    the last candidate."""

    class End:  # a draw of the whole sum (rng.random() is below 1; u × sum can round up to the last cumsum)
        @staticmethod
        def random() -> float:
            return 1.0

    log_probs = np.log(np.array([0.6, 0.3, 0.1]))
    assert sample_index(log_probs, 1.0, 0.8, End()) == 1 and sample_index(log_probs, 1.0, 1.0, End()) == 2


@pytest.mark.parametrize("options, message", [
    (DecodingOptions(beam_size=0), "beam_size 0: must be at least 1"),
    (DecodingOptions(beam_size=6), "beam_size 6: must be at most 5 (half the vocabulary)"),
    (DecodingOptions(beam_size=2, num_hypotheses=3), "num_hypotheses 3: must be between 1 and beam_size (2)"),
    (DecodingOptions(beam_size=2, sampling_topk=0), "sampling_topk 0: must be 1 (no sampling) with beam_size above 1"),
    (DecodingOptions(sampling_topk=0, sampling_topp=1.5), "sampling_topp 1.5: must be in (0, 1]"),
    (DecodingOptions(sampling_topk=0, sampling_temperature=-1.0), "sampling_temperature -1.0: must be above 0"),
    (DecodingOptions(beam_size=4, num_hypotheses=4, patience=0.5, length_penalty=1.0),
     "patience 0.5: must be enough for num_hypotheses (4) finished hypotheses"),
    (DecodingOptions(beam_stopping="marian"), "beam_stopping marian: must be ctranslate2 or transformers"),
])
def test_an_out_of_range_option_is_refused_naming_it_its_value_and_the_limit(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        options.check(V)


def test_a_beam_over_the_servers_limit_is_refused():
    with pytest.raises(ConfigError, match=r"beam_size 5: must be at most 4 \(the server's --max-beam-size\)"):
        DecodingOptions(beam_size=5).check(1000, max_beam_size=4)


@pytest.mark.parametrize("n, most, at_once, sizes", [
    (200, 64, 1, [50, 50, 50, 50]), (200, 32, 1, [28, 29, 28, 29, 28, 29, 29]), (16, 8, 1, [8, 8]), (5, 8, 1, [5]),
    (3, 1, 1, [1, 1, 1]),
    # decoded two at a time: a count the threads share evenly, where there are sources enough
    (200, 32, 2, [25] * 8), (200, 64, 2, [50] * 4), (5, 8, 2, [2, 3]), (3, 1, 2, [1, 1, 1]), (9, 4, 4, [2, 2, 2, 3])])
def test_sorted_batches_are_as_few_as_the_limit_allows_and_even(n, most, at_once, sizes):
    lengths = [(7 * i) % 23 for i in range(n)]
    batches = list(sorted_batches(lengths, most, at_once))
    assert [len(b) for b in batches] == sizes
    order = [i for b in batches for i in b]
    assert sorted(order) == list(range(n)) and [lengths[i] for i in order] == sorted(lengths, reverse=True)


@pytest.mark.parametrize("n, most, at_once, sizes", [
    (26, 8, 1, [8, 8, 8, 2]), (26, 8, 2, [6, 5, 3, 3, 2] + [1] * 7), (26, 3, 2, [3] * 5 + [2, 2] + [1] * 7),
    (200, 64, 2, [50, 37, 28, 21, 16, 12, 9, 6, 5, 4, 3, 2] + [1] * 7), (4, 1, 2, [1] * 4), (3, 8, 4, [1] * 3), (0, 8, 2, [])])
def test_guided_groups_shrink_to_single_batches_at_the_end_on_threads(n, most, at_once, sizes):
    groups = guided_groups(list(range(n)), most, at_once)
    assert [len(g) for g in groups] == sizes
    assert [b for g in groups for b in g] == list(range(n))  # every batch once, in order


def test_a_term_that_runs_on_into_a_longer_word_is_not_met():
    """ConstrainedBeamSearch with the tokens that continue a word: the term [5] followed by 7 (a continuation) is
    unmet again, by [8] (a word start) or eos it stays met; the result is a hypothesis whose term ends a word, though
    the model prefers to run it on."""
    continues = np.zeros(V, bool)
    continues[7] = True
    options = DecodingOptions(beam_size=2, constraints=((5,),))
    search = make_search(options, budget=3, eos_id=EOS, continues=continues)
    after = search._after(search._after(Progress(), 5), 7)
    assert after.met == frozenset() and search._after(search._after(Progress(), 5), 8).met == {0}
    assert not search.contains_all([5, 7]) and search.contains_all([5, 8, 7]) and search.contains_all([1, 5])

    def logits(step: int) -> np.ndarray:  # 5 first, then the model would run it on with 7, then eos
        table = np.zeros((2, V))
        if step == 0:
            table[:, 5] = 6.0
        elif step == 1:
            table[:, 7], table[:, EOS], table[:, 8] = 6.0, 3.0, 1.0
        else:
            table[:, EOS] = 6.0
        return table

    for table, expected in ((continues, [5]), (None, [5, 7])):  # without the table, 5 then 7 counts as the term
        search = make_search(options, budget=4, eos_id=EOS, continues=table)
        while not search.done:
            search.step(None, logits(search.steps), rank(EOS))
        assert search.results()[0].tokens == expected
