"""Beam search, n-best lists and sampling with ONNX Runtime against the PyTorch reference and CTranslate2."""

from pathlib import Path

import numpy as np
import pytest

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError
from nmtserve.export.build.to_ctranslate2 import convert
from nmtserve.export.runtime.batch import BatchState
from nmtserve.export.runtime.tensors import HostTensors
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.logits import log_softmax
from nmtserve.training.checkpoint import load_model
from nmtserve.training.data import pad, read_tsv
from nmtserve.training.decode import beam_search, sample
from tests.helpers import TEST_DEVICE, TEST_SCORE_TOLERANCE, TEST_VARIANT, top_candidates

BEAMS = [dict(beam_size=4, num_hypotheses=2), dict(beam_size=5, num_hypotheses=3, length_penalty=0.6, patience=2.0),
         dict(beam_size=2, length_penalty=1.0)]
SAMPLING = [dict(sampling_topk=0, seed=5), dict(sampling_topk=10, sampling_topp=0.9, sampling_temperature=0.7, seed=3)]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def sources(loaded, tiny_corpus) -> list[list[int]]:
    return [loaded.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]


def _reference(decode, model, sources, **options) -> list:
    out = []
    for start in range(0, len(sources), 16):
        src, mask = pad(sources[start:start + 16], 0)
        out += decode(model, src, mask, **options)
    return out


@pytest.mark.parametrize("options", BEAMS, ids=str)
def test_beam_n_best_lists_equal_the_pytorch_reference(tiny_bundle, loaded, sources, options):
    got = OnnxTranslator(tiny_bundle).search_ids(sources, DecodingOptions(**options), max_batch_size=16)
    expected = _reference(beam_search, loaded.model.eval(), sources, **options)
    same = [[h.tokens for h in g] == [tokens for tokens, _ in e] for g, e in zip(got, expected)]
    # measured 40/40 for each option set; float noise between the two may flip a near-tie on another CPU
    assert sum(same) >= 0.95 * len(sources), sum(same)
    assert all(len(g) == options.get("num_hypotheses", 1) for g in got)
    for g, e, s in zip(got, expected, same):
        if s:
            assert np.allclose([h.score for h in g], [score for _, score in e], atol=1e-3)
            assert [h.score for h in g] == sorted([h.score for h in g], reverse=True)


@pytest.mark.parametrize("options", SAMPLING, ids=str)
def test_sampling_with_a_seed_draws_the_pytorch_references_tokens(tiny_bundle, loaded, sources, options):
    got = OnnxTranslator(tiny_bundle).search_ids(sources, DecodingOptions(**options), max_batch_size=16)
    expected = _reference(sample, loaded.model.eval(), sources, **options)
    assert sum(g[0].tokens == tokens for g, (tokens, _) in zip(got, expected)) >= 0.95 * len(sources)
    # and the draws are not greedy's
    greedy = OnnxTranslator(tiny_bundle).search_ids(sources, max_batch_size=16)
    assert sum(g[0].tokens != r[0].tokens for g, r in zip(got, greedy)) >= len(sources) // 4


def _first_token_distribution(loaded, source: list[int], topk: int, temperature: float, topp: float) -> np.ndarray:
    """The first target token's sampling distribution (V,) from PyTorch's log-probabilities, worked out here with
    numpy (not nmtserve.search): the topk best, divided by the temperature, softmax, then top-p (a token is kept
    while the mass of the better ones is below topp), renormalised."""
    import torch

    model = loaded.model.eval()
    src_ids, src_mask = torch.tensor([source]), torch.ones(1, len(source), dtype=torch.bool)
    prefix = torch.tensor([[model.config.bos_id]])
    with torch.no_grad():
        log_probs = model.decode(prefix, model.encode(src_ids, src_mask), src_mask,
                                 torch.ones_like(prefix).bool())[0, -1].double().numpy()
    best = np.argsort(-log_probs, kind="stable")[:topk]
    weights = np.exp((log_probs[best] - log_probs[best].max()) / temperature)
    weights /= weights.sum()
    kept = np.concatenate([[0.0], np.cumsum(weights)[:-1]]) < topp
    distribution = np.zeros(len(log_probs))
    distribution[best[kept]] = weights[kept] / weights[kept].sum()
    return distribution


def test_sampled_first_tokens_follow_the_distribution_worked_out_independently(tiny_bundle, loaded, sources):
    """3,000 draws of one source's first token (each sentence its own random seed) against the distribution computed
    from PyTorch's log-probabilities with numpy: every token's share within 4.5 standard errors of its probability.
    The same draws are refused by the distributions of a sampler that ignored the temperature or top-p: the check
    can fail."""
    options = dict(sampling_topk=10, sampling_temperature=2.0, sampling_topp=0.9)
    source, n = sources[0], 3000
    found = OnnxTranslator(tiny_bundle).search_ids([source] * n, DecodingOptions(**options, seed=0, max_decoding_length=1),
                                                   max_batch_size=500)
    first = np.array([h[0].tokens[0] if h[0].tokens else loaded.tokenizer.eos_id for h in found])
    shares = np.bincount(first, minlength=loaded.model.config.vocab_size) / n

    def fits(distribution: np.ndarray) -> bool:
        error = np.sqrt(distribution * (1 - distribution) / n) + 1e-3
        return bool((np.abs(shares - distribution) <= 4.5 * error).all())

    expected = _first_token_distribution(loaded, source, 10, 2.0, 0.9)
    assert (expected > 0.05).sum() >= 3, expected[expected > 0]  # a real draw, not one near-certain token
    assert fits(expected)
    assert not fits(_first_token_distribution(loaded, source, 10, 1.0, 0.9))  # temperature ignored
    assert not fits(_first_token_distribution(loaded, source, 10, 2.0, 1.0))  # top-p ignored


def test_beam_n_best_lists_equal_ctranslate2s_on_the_same_weights(tiny_bundle, loaded, sources, tmp_path):
    """CTranslate2 is told min_decoding_length=0 (its translate_batch forbids eos at the first step by
    default; nmtserve allows an empty translation) and each sentence's budget as max_decoding_length."""
    import ctranslate2  # here: a GPU run of this file's IOBinding tests (NMTSERVE_TEST_DEVICE) needs no CTranslate2

    tr = OnnxTranslator(tiny_bundle)
    ct = ctranslate2.Translator(str(convert(loaded, Path(tmp_path) / "ct2")), device="cpu")
    sp = loaded.tokenizer.sp
    for options in BEAMS:
        got = tr.search_ids(sources, DecodingOptions(**options), max_batch_size=16)
        same = 0
        for source, hypotheses in zip(sources, got):
            result = ct.translate_batch([[sp.id_to_piece(i) for i in source]], min_decoding_length=0,
                                        max_decoding_length=tr.limits.output_budget(len(source), 256),
                                        **{"length_penalty": 0.0, **options})[0]
            same += [[sp.piece_to_id(p) for p in h] for h in result.hypotheses] == [h.tokens for h in hypotheses]
        assert same >= 0.95 * len(sources), (options, same)  # measured 40/40 for each


def test_a_sentences_beam_and_samples_do_not_depend_on_its_batch(tiny_bundle, sources):
    tr = OnnxTranslator(tiny_bundle)
    for options in [BEAMS[0], SAMPLING[1]]:
        alone = tr.search_ids(sources[:12], DecodingOptions(**options), max_batch_size=1)
        together = tr.search_ids(sources, DecodingOptions(**options), max_batch_size=40)[:12]
        assert [[h.tokens for h in a] for a in alone] == [[h.tokens for h in t] for t in together]


def test_beam_rows_sharing_their_sources_cross_kv_step_as_rows_with_copies(tiny_bundle, sources):
    """Offline, a beam's rows share one copy of their source's cross K/V (a widened state, the step of
    with_shared_cross); in the server's engine (shared_cross=False) each row holds a copy (gather), and
    the step is the bundle's as exported. Same candidates, also after a source leaves."""
    shared_tr, rows_tr, width = OnnxTranslator(tiny_bundle), OnnxTranslator(tiny_bundle, shared_cross=False), 3
    first = sources[:6]  # of different lengths: each source's keys end at its own eos
    assert len({len(s) for s in first}) > 1
    shared, copies = shared_tr.prefill(first), rows_tr.prefill(first)
    for tr, state in ((shared_tr, shared), (rows_tr, copies)):
        tr.decode_candidates(state, 2 * width)  # a beam's first step: one row per source
    shared, copies = shared.widen(width), copies.gather(np.repeat(np.arange(6), width))
    assert shared.cross_k.shape[1] == 6 and copies.cross_k.shape[1] == shared.size == 6 * width
    rng = np.random.default_rng(0)
    for step in range(4):
        if step == 2:  # a source finishes: its rows leave both states
            keep = np.repeat(np.arange(6) != 1, width)
            shared, copies = shared.filter(keep), copies.filter(keep)
            assert shared.cross_k.shape[1] == 5 and copies.cross_k.shape[1] == 5 * width
        got, got_scores = shared_tr.decode_candidates(shared, 2 * width)
        expected, expected_scores = rows_tr.decode_candidates(copies, 2 * width)
        assert (got == expected).all()
        assert np.allclose(got_scores, expected_scores, atol=1e-4)
        # each row continues one of its own source's rows, as a beam does
        parents = np.arange(shared.size) // width * width + rng.integers(0, width, shared.size)
        for state in (shared, copies):
            state.choose(expected[:, 1], parents)


@pytest.mark.parametrize("options", [{}, {"io_binding": True, "device": TEST_DEVICE}, {"attention_kernel": False}],
                         ids=["kernels", "io-binding", "onnx-runtime-nodes"])
def test_whole_vocabulary_rows_come_unranked_beside_the_k_best_of_every_row(tiny_bundle, sources, options):
    """A step with `whole` rows (a sampler without top-k in the server's batch): every row gets its k best
    from the search head (nmtserve.SearchHead, or ONNX Runtime's If of TopK and Gather), and only the whole
    rows' logits over the vocabulary come back: the values that a step of k = 0 gives those rows (every
    row's logits, by token id), whose log-softmax ranks as the head does."""
    tr = OnnxTranslator(tiny_bundle, shared_cross=False, **options)
    atol = TEST_SCORE_TOLERANCE if tr.variant == "fp16" else 1e-5  # fp16 on CUDA: the head's sums in fp16
    states = [tr.prefill(sources[:5]) for _ in range(2)]
    whole = np.array([3, 1])
    for _ in range(3):
        none, every = tr.decode_candidates(states[0], 0)  # (5, V) by token id
        ids, scores, vocabulary = tr.decode_candidates(states[1], 4, whole=whole)
        assert none is None and every.shape == (5, tr.vocab_size)
        assert ids.shape == scores.shape == (5, 4) and vocabulary.shape == (2, tr.vocab_size)
        ranked, ranked_scores = top_candidates(log_softmax(every), 4)
        assert (ids == ranked).all() and np.allclose(scores, ranked_scores, atol=atol)
        assert np.allclose(vocabulary, every[whole], atol=atol)
        for state in states:
            state.choose(ranked[:, 0])
    with pytest.raises(ValueError, match=r"k 1, whole rows \[3, 1\]: a step without scores"):
        tr.decode_candidates(states[1], 1, scores=False, whole=whole)


@pytest.mark.parametrize("shared_cross", [True, False], ids=["shared cross", "cross per row"])
def test_compact_moves_the_last_sources_into_the_holes_and_steps_as_filter(tiny_bundle, sources, shared_cross):
    """Offline search drops finished sources with `compact`: the last kept sources move into the places
    of the dropped ones, the state is the first rows of the same buffers, and its rows step exactly as
    `filter`'s copies of the same rows, in the order compact reports."""
    tr, width = OnnxTranslator(tiny_bundle, shared_cross=shared_cross), 2
    first = sources[:7]

    def started():
        state = tr.prefill(first)
        tr.decode_candidates(state, 2 * width)
        state = state.widen(width) if shared_cross else state.gather(np.repeat(np.arange(7), width))
        for _ in range(3):
            ids, _ = tr.decode_candidates(state, 2 * width)
            state.choose(ids[:, 1], np.arange(state.size) // width * width + (np.arange(state.size) + 1) % width)
        return state

    kept_sources = np.array([True, False, True, True, False, True, True])  # two holes, two sources move into them
    keep = np.repeat(kept_sources, width)
    state = started()
    buffer = state.k
    compacted, order = state.compact(keep)
    assert order.tolist() == [0, 1, 10, 11, 4, 5, 6, 7, 12, 13]  # sources 0, 5, 2, 3, 6: 5 and 6 fill 1 and 4
    assert compacted.k.base is buffer and np.shares_memory(compacted.v, state.v)  # a view: nothing copied wholesale
    filtered = started().filter(keep)
    rows_of = np.flatnonzero(keep)  # filter's rows, in order
    where = [int(np.flatnonzero(rows_of == row)[0]) for row in order]  # each compacted row's place in filter's
    for _ in range(3):
        got, got_scores = tr.decode_candidates(compacted, 2 * width)
        expected, expected_scores = tr.decode_candidates(filtered, 2 * width)
        assert (got == expected[where]).all() and np.allclose(got_scores, expected_scores[where], atol=1e-5)
        compacted.choose(got[:, 0])
        filtered.choose(expected[:, 0])
    assert state.compact(np.zeros(state.size, bool))[0] is None


def test_a_cache_grows_only_into_the_room_of_its_own_buffer():
    """HostTensors.grow_rows extends a view of a buffer's first rows and nothing else: a view of other rows
    or of fewer slots, or a whole array, has no room, so BatchState.append never writes over rows it does not
    hold. with_rows copies a cache's filled slots to the head of a buffer with room."""
    buffer = np.zeros((2, 8, 3, 4, 5), np.float32)
    grown = HostTensors.grow_rows(HostTensors.head(buffer, 5), 7)
    assert grown.shape == (2, 7, 3, 4, 5) and grown.ctypes.data == buffer.ctypes.data
    assert HostTensors.grow_rows(HostTensors.head(buffer, 5), 9) is None  # past the buffer's rows
    assert HostTensors.grow_rows(buffer[:, 1:5], 6) is None  # not its first rows
    assert HostTensors.grow_rows(buffer[:, :5, :, :2], 6) is None  # fewer slots
    assert HostTensors.grow_rows(buffer, 8) is None  # nothing behind it
    cache = np.arange(2 * 3 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 3, 4, 5)
    roomy = HostTensors.with_rows(cache, 6, 2)
    assert roomy.shape == cache.shape and (roomy[:, :, :, :2] == cache[:, :, :, :2]).all()
    assert HostTensors.grow_rows(roomy, 6).shape[1] == 6 and HostTensors.grow_rows(roomy, 7) is None


def test_newcomers_are_placed_from_their_own_rows_with_zeros_past_their_sources():
    """BatchState.insert (holes) and append (the rest) take a fresh state's rows from `start` on, with no
    caches of their own (`prefill(caches=False)`): each hole gets its newcomer's cross K/V, zero past its
    source's slots, mask, eos slot and token; the rows around them keep theirs."""
    layers, heads, dim = 1, 2, 3

    def encoded(rows: int, slots: int, value: float, caches: int) -> BatchState:
        mask = np.ones((rows, slots), bool)
        mask[0, slots - 1] = False  # the first row's source is one slot shorter
        cross = np.full((layers, rows, heads, slots, dim), value, np.float32) + np.arange(rows)[None, :, None, None, None]
        return BatchState.from_encoded(cross, cross + 0.5, np.zeros((layers, rows, 2, heads, dim), np.float32), mask,
                                       bos_id=1, capacity=caches)

    running = encoded(4, 6, 100.0, 4)
    running.free([1, 3])
    fresh = encoded(3, 4, 10.0, 0)
    assert fresh.k.shape[3] == 0
    running.insert([3, 1], fresh)  # fresh rows 0 and 1
    assert (running.cross_k[:, 3, :, :4] == 10.0).all() and (running.cross_k[:, 1, :, :4] == 11.0).all()
    assert (running.cross_k[:, [1, 3], :, 4:] == 0).all() and (running.cross_v[:, 1, :, :4] == 11.5).all()
    assert (running.cross_k[:, 0] == 100.0).all() and (running.cross_k[:, 2] == 102.0).all()
    assert running.src_mask.tolist()[3] == [True, True, True, False, False, False]
    assert running.cross_slot.tolist() == [4, 3, 5, 2] and not running.holes  # each source's last slot
    running = running.append(fresh, room=8, start=2)  # fresh row 2 after the four
    assert running.size == 5 and (running.cross_k[:, 4, :, :4] == 12.0).all() and (running.cross_k[:, 4, :, 4:] == 0).all()
    assert (running.cross_k[:, 1, :, :4] == 11.0).all() and running.cross_slot.tolist() == [4, 3, 5, 2, 3]


@pytest.mark.parametrize("origin", [False, True], ids=["copies", "origins"])
def test_a_beam_row_takes_its_parents_filled_slots_only_beside_longer_rows(origin):
    """In the server's batch a beam's rows share a batch with longer rows: a row that continues its
    parent's hypothesis takes the parent's slots up to their own position, and the slots past it keep
    what they held (the cache: the next step writes there; the origin: each row's own)."""
    layers, heads, dim, capacity = 1, 1, 2, 8
    cross = np.zeros((layers, 3, heads, 4, dim), np.float32)
    state = BatchState.from_encoded(cross, cross.copy(), np.zeros((layers, 3, 2, heads, dim), np.float32),
                                    np.ones((3, 4), bool), bos_id=1, capacity=capacity, origin=origin)
    state.k[...] = (100 * np.arange(3)[:, None] + np.arange(capacity))[None, :, None, :, None]  # 100 · row + slot
    k = state.k.copy()
    state.positions[:] = [6, 2, 2]  # a greedy row six slots in, a beam of two rows two slots in
    state.choose(np.zeros(3, np.int64), np.array([0, 2, 2]))  # row 1 continues row 2
    if origin:
        assert np.array_equal(state.k, k) and state.origin[1].tolist() == [2, 2] + [1] * 6
    else:
        assert state.k[0, 1, 0, :, 0].tolist() == [200, 201] + list(range(102, 108))
        assert np.array_equal(np.delete(state.k, 1, axis=1), np.delete(k, 1, axis=1))


def test_beams_of_different_lengths_moving_in_one_step_keep_their_next_slots_their_own():
    """With origins in the server's batch, two beams moving at once (rows 0-1 six slots in, rows 2-3 two):
    each moved row points at its parent's filled slots only; from its own position on (where its next step
    writes) its slots stay its own."""
    cross = np.zeros((1, 4, 1, 4, 2), np.float32)
    state = BatchState.from_encoded(cross, cross.copy(), np.zeros((1, 4, 2, 1, 2), np.float32), np.ones((4, 4), bool),
                                    bos_id=1, capacity=8, origin=True)
    state.positions[:] = [6, 6, 2, 2]
    state.choose(np.zeros(4, np.int64), np.array([1, 1, 3, 3]))  # rows 0 and 2 continue rows 1 and 3
    assert state.origin.tolist() == [[1] * 6 + [0] * 2, [1] * 8, [3] * 2 + [2] * 6, [3] * 8]


def test_rows_that_join_or_leave_the_servers_batch_hold_their_own_slots():
    """The engine's operations on a state with origins: a freed row (a hole, whose step writes and reads its
    slot 0), a newcomer in a hole, rows appended into new room and a trimmed cache each hold their own slots;
    a running beam keeps pointing at its parent's. A cache whose slots shrink or grow keeps its buffers' room
    for rows, which the next newcomers take without a copy."""
    def fresh(rows, capacity):
        cross = np.zeros((1, rows, 1, 4, 2), np.float32)
        return BatchState.from_encoded(cross, cross.copy(), np.zeros((1, rows, 2, 1, 2), np.float32),
                                       np.ones((rows, 4), bool), bos_id=1, capacity=capacity, origin=True)

    state = fresh(4, 128)
    state.positions[:] = 3
    state.choose(np.zeros(4, np.int64), np.array([0, 0, 2, 2]))  # rows 1 and 3 continue rows 0 and 2
    state.free([2, 3])
    assert state.origin[2:].tolist() == [[2] * 128, [3] * 128] and state.origin[1, :4].tolist() == [0, 0, 0, 1]
    state.insert([3], fresh(1, 0))
    assert state.origin[3].tolist() == [3] * 128
    state = state.append(fresh(3, 0), room=8)  # no room in the buffers: copied into buffers of 8 rows
    assert state.size == 7 and state.origin[4:].tolist() == [[r] * 128 for r in (4, 5, 6)]
    state.trim()  # 128 slots to 32, in buffers that keep the room for 8 rows
    assert state.origin.shape == (7, 32) and state.origin[1, :4].tolist() == [0, 0, 0, 1]
    buffer = state.k.base
    state.positions[:] = 32
    state.open_slot()  # 64 slots, the room for rows kept
    assert state.capacity == 64 and state.k.base.shape[1] == 8 and state.k.base is not buffer
    buffer, filled = state.k.base, state.k[:, :, :, :32].copy()
    state = state.append(fresh(1, 0), room=8)  # into the room: no row copied
    # the same bytes: slots past the rows' positions hold whatever the new buffer held (NaN patterns among them)
    assert state.size == 8 and state.k.base is buffer and state.k[:, :7, :, :32].tobytes() == filled.tobytes()
    assert state.origin[7].tolist() == [7] * 64


def test_a_beam_row_that_continues_another_copies_its_origin_not_its_cache():
    """BatchState.origin (the offline step on nmtserve's kernels): choosing a parent copies the parent's
    row of origin over the filled slots; the caches stay as the steps wrote them; compaction, filtering
    and a larger cache keep each origin pointing at the same source's rows, by their new indices."""
    layers, heads, dim, width = 1, 1, 2, 2
    cross = np.zeros((layers, 3, heads, 4, dim), np.float32)
    state = BatchState.from_encoded(cross, cross.copy(), np.zeros((layers, 3, 2, heads, dim), np.float32),
                                    np.ones((3, 4), bool), bos_id=1, capacity=4, origin=True)
    assert state.origin.tolist() == [[0] * 4, [1] * 4, [2] * 4]
    state.advance()  # the first step wrote slot 0 of each row
    state = state.widen(width)  # 3 sources of 2 rows
    assert state.origin.tolist() == [[r] * 4 for r in range(6)]
    state.k[...] = np.arange(6)[None, :, None, None, None]  # each row's cache holds its index
    k = state.k.copy()
    for _ in range(2):
        state.advance()
    state.choose(np.zeros(6, np.int64), np.array([1, 1, 2, 2, 4, 5]))  # rows 0 and 3 continue 1 and 2
    assert np.array_equal(state.k, k)  # nothing copied
    assert state.origin[:, :3].tolist() == [[1] * 3, [1] * 3, [2] * 3, [2] * 3, [4] * 3, [5] * 3]
    assert state.origin[:, 3].tolist() == list(range(6))  # the next slot: each row's own
    state.advance()
    state.open_slot()  # the cache doubles: the new slots each row's own
    assert state.capacity == 8 and state.origin[:, 4:].tolist() == [[r] * 4 for r in range(6)]
    filtered = state.filter(np.repeat([False, True, True], width))  # sources 1 and 2 as rows 0-3
    assert filtered.origin[:, :3].tolist() == [[0] * 3, [0] * 3, [2] * 3, [3] * 3]
    compacted, order = state.compact(np.repeat([False, True, True], width))  # source 2 moves to source 0's rows
    assert order.tolist() == [4, 5, 2, 3]
    assert compacted.origin[:, :3].tolist() == [[0] * 3, [1] * 3, [2] * 3, [2] * 3]
    assert compacted.origin[:, 4:].tolist() == [[r] * 4 for r in range(4)]


def test_io_binding_gives_the_host_paths_n_best_lists(tiny_bundle, tiny_corpus):
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:12]]
    host = OnnxTranslator(tiny_bundle, device=TEST_DEVICE, variant=TEST_VARIANT, io_binding=False)
    bound = OnnxTranslator(tiny_bundle, device=TEST_DEVICE, variant=TEST_VARIANT, io_binding=True)
    expected = host.translate_batch(texts, beam_size=4, num_hypotheses=2, max_batch_size=8, return_scores=True)
    got = bound.translate_batch(texts, beam_size=4, num_hypotheses=2, max_batch_size=8, return_scores=True)
    assert [[h.tokens for h in t.hypotheses] for t in got] == [[h.tokens for h in t.hypotheses] for t in expected]
    assert all(len(t.hypotheses) == 2 and t.alternatives[0].score <= t.score for t in got)
    assert np.allclose([t.score for t in got], [t.score for t in expected], atol=TEST_SCORE_TOLERANCE)


def test_translate_batch_refuses_an_out_of_range_option_naming_it(tiny_bundle):
    tr = OnnxTranslator(tiny_bundle)
    with pytest.raises(ConfigError, match=r"num_hypotheses 3: must be between 1 and beam_size \(2\)"):
        tr.translate_batch(["a"], beam_size=2, num_hypotheses=3)
    with pytest.raises(ConfigError, match=r"sampling_topp 0.0: must be in \(0, 1\]"):
        tr.translate_batch(["a"], sampling_topk=0, sampling_topp=0.0)
