"""The continuous-batching engine: same tokens as OnnxTranslator while requests join and leave,
KV shapes after join/leave, cancellation, deadlines and overload.

Every test runs twice: with the caches as host numpy arrays (the CPU default), and with them as
OrtValues bound by IOBinding (the CUDA path, here on ONNX Runtime's CPU provider)."""

import random
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError
from nmtserve.export.runtime.batch import BatchState
from nmtserve.export.runtime.engine import CONTINUE, Engine, EngineConfig, EngineOverloaded, EnginePool
from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.export.runtime.running_batch import RunningBatch
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.search import make_search
from nmtserve.training.data import read_tsv
from tests.helpers import TEST_DEVICE, TEST_SCORE_TOLERANCE, TEST_VARIANT


def _translator(bundle, io_binding: bool) -> OnnxTranslator:
    device, variant = (TEST_DEVICE, TEST_VARIANT) if io_binding else ("cpu", "fp32")
    return OnnxTranslator(bundle, device=device, variant=variant, intra_op_threads=1, io_binding=io_binding,
                          shared_cross=False)  # the engine's step


@pytest.fixture(scope="module", params=[False, True], ids=["host-arrays", "io-binding"])
def translator(tiny_bundle, request):
    return _translator(tiny_bundle, request.param)


def step(translator, state: BatchState) -> np.ndarray:
    return translator.decode_one_token(state)[0]


@pytest.fixture(scope="module")
def sources(translator, tiny_corpus):
    return [translator.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]


def test_staggered_requests_get_exactly_the_translator_tokens(translator, sources):
    expected = [tokens for tokens, _ in translator.translate_ids(sources, max_batch_size=1)]
    engine = Engine(translator, EngineConfig(max_running_rows=8)).start()
    try:
        requests = []
        for i, src in enumerate(sources):
            requests.append(engine.submit(Request(src)))
            if i % 5 == 0:
                time.sleep(0.01)  # let the running batch advance so that later rows join mid-flight
        for r in requests:
            assert r.done.wait(60)
        assert [r.tokens for r in requests] == expected
        assert all(r.finish in (FinishReason.EOS, FinishReason.LENGTH) for r in requests)
        assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
        assert engine.steps < sum(len(t) + 1 for t in expected)  # rows really shared steps
    finally:
        engine.stop()


def test_steps_of_greedy_rows_no_one_reads_a_score_of_skip_the_log_softmax(translator, sources, monkeypatch):
    """A greedy Request with scored=False (gRPC: return_scores off): a step whose rows are all such
    requests asks for no scores (the search head's ArgMax branch); one scored or searching row makes
    the step scored. Tokens and scores are the translator's either way."""
    unscored_expected = [found.tokens for found, in translator.search_ids(sources, max_batch_size=1, scores=False)]
    scored_expected = translator.translate_ids(sources, max_batch_size=1)
    flags, decode, steps = [], translator.decode_candidates, translator.decode_greedy_steps

    def recording(state, k, scores=True, whole=None, budget=None):
        flags.append(scores)
        return decode(state, k, scores, whole, budget)

    def recording_steps(state, n, budget, scores=True, *args):  # greedy batches' steps in the library (native_steps)
        flags.append(scores)
        return steps(state, n, budget, scores, *args)
    monkeypatch.setattr(translator, "decode_candidates", recording)
    monkeypatch.setattr(translator, "decode_greedy_steps", recording_steps)
    engine = Engine(translator, EngineConfig(max_running_rows=8)).start()
    try:
        unscored = [engine.submit(Request(src, scored=False)) for src in sources]
        assert all(r.done.wait(60) for r in unscored)
        assert flags and not any(flags)
        assert [r.tokens for r in unscored] == unscored_expected
        flags.clear()
        mixed = [engine.submit(Request(src, scored=i % 2 == 0)) for i, src in enumerate(sources)]
        assert all(r.done.wait(60) for r in mixed)
        assert any(flags)
        for r, (tokens, score) in list(zip(mixed, scored_expected))[::2]:
            assert r.tokens == tokens and abs(r.score - score) < TEST_SCORE_TOLERANCE
    finally:
        engine.stop()


def test_kv_shapes_after_join_and_leave(translator, sources):
    a = translator.prefill(sources[:2])
    for _ in range(3):
        step(translator, a)
    merged = a.concatenate(translator.prefill(sources[2:5]))
    shape = translator.ops.shape
    n_layers, _, heads, _, head_dim = shape(a.k)
    assert shape(merged.k)[:3] == (n_layers, 5, heads) and shape(merged.k)[4] == head_dim
    assert merged.length == 3 and merged.valid[:2, :3].all() and not merged.valid[2:].any()
    assert merged.positions.tolist() == [3, 3, 0, 0, 0]
    assert merged.src_mask.shape[1] == max(len(s) for s in sources[:5])
    step(translator, merged)  # each row writes its own next slot: the newcomers their slot 0
    assert merged.valid[:2, :4].all() and merged.valid[2:, :1].all() and not merged.valid[2:, 1:].any()
    assert merged.positions.tolist() == [4, 4, 1, 1, 1]
    left = merged.filter(np.array([False, False, True, False, True]))  # the two first rows leave
    assert shape(left.k)[1] == 2 and left.length == 1 and left.valid[:, :1].all()
    assert left.src_mask.shape[1] == max(len(sources[2]), len(sources[4]))


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_request_decoded_in_the_library_gets_its_first_token_at_the_first_step(tiny_bundle, tiny_corpus, batching):
    """A greedy request decoded in library runs (a continuous burst, a static whole run: host arrays, where the
    library steps) takes its first token in the run's first step: its time to first token is a step's, not the
    run's, whose end is when its tokens come back."""
    translator = _translator(tiny_bundle, io_binding=False)
    assert translator.native_steps
    source = translator.tokenizer.encode(read_tsv(tiny_corpus / "test.tsv").pairs[0][0])
    engine = Engine(translator, EngineConfig(max_running_rows=4, batching=batching)).start()
    try:
        request = engine.submit(Request(source * 5, max_decoding_length=200))
        assert request.done.wait(60) and request.finish in (FinishReason.EOS, FinishReason.LENGTH)
        assert len(request.tokens) >= 24, request.tokens  # many steps (the tiny model repeats itself)
        decoding = request.finished - request.encoded
        assert 0 < request.first_token - request.encoded < decoding / 4, (request.first_token, request.encoded,
                                                                          request.finished)
    finally:
        engine.stop()


def test_cancel_and_deadline_free_their_rows(translator, sources):
    def cancel_after_first_token(request, token):
        request.cancel()

    def expire_after_first_token(request, token):
        request.deadline = time.monotonic()

    engine = Engine(translator, EngineConfig(max_running_rows=4)).start()
    try:
        long = sources[0] * 5
        cancelled = engine.submit(Request(long, max_decoding_length=200, on_token=cancel_after_first_token))
        expired = engine.submit(Request(long, max_decoding_length=200, on_token=expire_after_first_token))
        late = engine.submit(Request(long, deadline=time.monotonic() - 1))  # expired while waiting
        assert cancelled.done.wait(10) and expired.done.wait(10) and late.done.wait(10)
        assert cancelled.finish is FinishReason.CANCELLED and len(cancelled.tokens) == 1
        assert expired.finish is FinishReason.DEADLINE and len(expired.tokens) == 1
        assert late.finish is FinishReason.DEADLINE and late.tokens == []
        assert engine.stats()["running"] == 0 and engine.batch.state is None
    finally:
        engine.stop()


def test_a_pool_of_engines_spreads_requests_and_each_gets_the_translator_tokens(translator, sources):
    """serve --inter-threads 2: each request goes to the engine with the fewest waiting and running, ids
    are unique across the engines, both decode at once (each over its own binding of the same sessions)
    and every request gets the tokens it gets alone. On CUDA a model has one engine: a pool of two is refused."""
    if translator.device == "cuda":
        with pytest.raises(ConfigError, match="inter_threads 2 on cuda"):
            EnginePool(translator, 2, EngineConfig(max_running_rows=8))
        return
    expected = [tokens for tokens, _ in translator.translate_ids(sources, max_batch_size=1)]
    pool = EnginePool(translator, 2, EngineConfig(max_running_rows=8))
    queued = [pool.submit(Request(src)) for src in sources[:4]]  # not started yet: all four wait
    assert [len(engine.waiting) for engine in pool.engines] == [2, 2]
    assert pool.stats() == {"waiting": 4, "running": 0, "steps": 0, "admissions": 0}
    pool.start()
    try:
        requests = queued + [pool.submit(Request(src)) for src in sources[4:]]
        for r in requests:
            assert r.done.wait(60)
        assert [r.tokens for r in requests] == expected
        assert len({r.id for r in requests}) == len(requests)
        assert all(engine.steps > 0 and engine.admissions > 0 for engine in pool.engines)
        assert pool.stats()["admissions"] == sum(engine.admissions for engine in pool.engines)
        assert pool.idle()
    finally:
        pool.stop()


def test_a_pools_busy_hint_takes_no_engines_lock(tiny_bundle):
    """EnginePool.busy is asked from an engine thread's on_finish, which may hold its own engine's lock while
    another engine's thread, holding its lock, asks too: the hint reads without the locks, so neither waits.
    (Host arrays: a pool of two is refused on CUDA.)"""
    pool = EnginePool(_translator(tiny_bundle, False), 2, EngineConfig(max_running_rows=8))  # not started: it waits
    assert not pool.busy()
    pool.submit(Request([5, 6, 7]))
    answers = []
    with pool.engines[0].lock, pool.engines[1].lock:  # both engines' locks held by someone else
        asking = threading.Thread(target=lambda: answers.append(pool.busy()))
        asking.start()
        asking.join(5)
    assert answers == [True]


def test_full_waiting_queue_is_refused_at_once(translator, sources):
    engine = Engine(translator, EngineConfig(max_waiting=2))  # not started: nothing leaves the queue
    engine.submit(Request(sources[0]))
    engine.submit(Request(sources[1]))
    with pytest.raises(EngineOverloaded, match="waiting queue full"):
        engine.submit(Request(sources[2]))


def test_a_newcomer_in_a_hole_decodes_as_if_alone_and_trim_drops_slots_no_row_reaches(translator, sources):
    newcomer = max(sources, key=len)  # longer than the batch's sources: insert must widen the source axis
    alone = translator.translate_ids([newcomer], max_batch_size=1, max_decoding_length=12)[0][0]
    state = translator.prefill(sources[:3])
    for _ in range(40):  # the cache doubles to 64 slots
        step(translator, state)
    state.free([1])
    state.insert([1], translator.prefill([newcomer]))
    got = [int(step(translator, state)[1]) for _ in range(12)]
    assert got[: len(alone)] == alone and (len(alone) == 12 or got[len(alone)] == translator.eos_id)
    capacity = state.capacity
    state.trim()  # rows 0 and 2 reach slot 52: nothing to drop
    assert state.capacity == capacity == 64
    state.free([0, 2])
    state.trim()  # only the newcomer's 12 slots remain in use
    assert state.length == 12 and state.valid[1].sum() == 12 and state.capacity == 32


def test_the_running_batch_reserves_its_requests_budgets_and_never_copies_the_cache_as_rows_fill_it(translator, sources):
    """Slots for the largest budget of the running requests (and one) at admission, in one resize to a multiple of
    a fresh state's 32, where the cache would double as the rows filled it; trim keeps them while such a request
    runs."""
    batch = RunningBatch(translator, room=8)
    long, short = Request(sources[0], max_decoding_length=60), Request(sources[1], max_decoding_length=3)
    batch.admit([long, short])
    budget = long.budget(translator.limits)
    assert budget > 32 and batch.slots() == budget + 1  # past the 32 slots of a fresh state
    assert batch.state.capacity == -(-(budget + 1) // 32) * 32
    k, capacity = batch.state.k, batch.state.capacity
    for _ in range(budget):  # the long request's every step (its rows decode on, as no engine finishes them)
        batch.step()
        assert batch.state.k is k and batch.state.capacity == capacity
    batch.leave([long])
    assert batch.slots() == short.budget(translator.limits) + 1
    batch.state.reserve(65)  # past a power of two: 96 slots, not 128
    assert batch.state.capacity == 96


def test_newcomers_past_the_buffers_copy_the_running_rows_once_into_room_for_every_row(translator, sources):
    """On the host a batch starts in its first rows' buffers (one request alone pays for no room); the first
    newcomers past them copy the running rows once, into buffers with room for `room` rows, and later ones up
    to it are written there without a copy (doubling, 3 rows grew to 6, then 8). A device copies each time."""
    batch = RunningBatch(translator, room=8)
    batch.admit([Request(s, max_decoding_length=20) for s in sources[:2]])  # budgets within the slots reserved
    batch.step()
    batch.admit([Request(sources[2], max_decoding_length=20)])
    k = batch.state.k
    batch.step()
    batch.admit([Request(s, max_decoding_length=20) for s in sources[3:8]])
    assert len(batch.rows) == 8 and batch.state.ops.views == np.shares_memory(batch.state.k, k)


def test_the_running_batch_keeps_requests_and_rows_in_step(translator, sources):
    batch = RunningBatch(translator)
    a, b, c, d, e = (Request(s) for s in sources[:5])
    batch.admit([a, b, c])
    assert batch.rows == [a, b, c] and batch.state.size == 3
    outputs, failed = batch.step()
    assert failed == []
    assert [request for request, *_ in outputs] == [a, b, c]
    batch.leave([b])
    assert batch.rows == [a, None, c] and batch.requests == [a, c]
    batch.admit([d, e])  # d fills the hole, e is appended
    assert batch.rows == [a, d, c, e] and batch.state.size == 4
    assert [request for request, *_ in batch.step()[0]] == [a, d, c, e]
    batch.leave([a])
    batch.compact()  # one hole in four: compacted (on the host in place: the last row moves into the hole)
    if translator.ops.views:
        assert batch.rows == [e, d, c] and batch.state.positions.tolist() == [1, 1, 2]
    else:
        assert batch.rows == [d, c, e] and batch.state.positions.tolist() == [1, 2, 1]
    assert batch.state.size == 3
    batch.leave([d, c, e])
    assert batch.rows == [] and batch.state is None


def test_compaction_moves_whole_requests_and_newcomers_take_the_room_each_getting_what_it_gets_alone(translator,
                                                                                                   sources):
    """On the host the holes go in place: a request with a row at or past the kept count moves whole, its
    rows in their order, into the first places the others leave free, and no other row is copied; newcomers
    then take the room past the rows, the running rows not copied either (the same buffers throughout). On a
    device every kept row is copied (`filter`). Either way each request gets what it gets alone."""
    limits, eos = translator.limits, translator.eos_id
    greedy = [Request(s) for s in sources[:5]]
    beam = Request(sources[5], options=DecodingOptions(beam_size=3, num_hypotheses=2))
    beam.search = make_search(beam.options, beam.budget(limits), eos)  # as the engine's admission does
    newcomers = [Request(s) for s in sources[6:8]]
    batch = RunningBatch(translator, room=8)
    batch.admit([*greedy, beam])
    assert batch.rows == [*greedy, beam, beam, beam]

    def step():  # as the engine's: a greedy request's tokens gain its row's, eos excepted
        outputs, failed = batch.step()
        assert failed == []
        for request, token, _, finish in outputs:
            if request.search is None and finish is not FinishReason.EOS:
                request.tokens.append(token)
        batch.leave([r for r, _, _, finish in outputs if (r.search.done if r.search else finish is not None)])

    for _ in range(2):
        step()
    assert batch.rows == [*greedy, beam, beam, beam]  # no one finished yet
    g1, g2, g3, g4, g5 = greedy
    before = batch.state.k
    kept = {i: translator.ops.numpy(before)[:, i, :, :2].copy() for i in range(8)}
    batch.leave([g1, g3])  # two holes in eight rows (as cancelled): compacted
    batch.compact()
    if translator.ops.views:
        assert batch.rows == [beam, g2, beam, g4, g5, beam]
        after = batch.state.k
        assert np.shares_memory(after, before)
        for new, old in enumerate([5, 1, 6, 3, 4, 7]):
            assert (after[:, new, :, :2] == kept[old]).all()
    else:
        assert batch.rows == [g2, g4, g5, beam, beam, beam]
    batch.admit(newcomers)
    assert batch.rows[6:] == newcomers
    if translator.ops.views:
        assert np.shares_memory(batch.state.k, before)  # in the room: the running rows were not copied
    while batch.state is not None:
        step()
    for request in [g2, g4, g5, *newcomers]:
        assert request.tokens == translator.translate_ids([request.src_ids], max_batch_size=1)[0][0]
    alone = translator.search_ids([beam.src_ids], beam.options, max_batch_size=1)[0]
    assert [h.tokens for h in beam.search.results()] == [h.tokens for h in alone]


def test_a_hole_kept_longer_than_the_position_table_never_advances(translator, sources):
    """Issue 15's INTERNAL errors: a hole used to advance with its batch until its position left the
    model's table, and the step failed for every row."""
    steps = translator.limits.max_target_tokens - 6  # the live rows stay inside the table; the hole joined 10 steps earlier
    with_hole = RunningBatch(translator)
    first = Request(sources[0])
    with_hole.admit([first])
    for _ in range(10):
        assert with_hole.step()[1] == []
    with_hole.admit([Request(s) for s in sources[1:5]])  # appended: there is no hole yet
    with_hole.leave([first])  # one hole in five rows: not compacted
    alone = RunningBatch(translator)
    alone.admit([Request(s) for s in sources[1:5]])
    for _ in range(steps):
        got = [token for _, token, *_ in with_hole.step()[0]]
        assert got == [token for _, token, *_ in alone.step()[0]]
    assert with_hole.state.positions.tolist() == [0] + [steps] * 4
    assert not with_hole.state.valid[0].any()


def _run_together(translator, requests: list[Request], config: EngineConfig | None = None, on_step=None) -> Engine:
    """Submit every request before the engine starts, so all join the same batch; wait for all."""
    engine = Engine(translator, config or EngineConfig(max_running_rows=16), on_step=on_step)
    for request in requests:
        engine.submit(request)
    engine.start()
    try:
        assert all(r.done.wait(120) for r in requests)
        assert engine.stats()["running"] == 0
    finally:
        engine.stop()
    return engine


def test_a_source_the_encoder_fails_on_fails_alone(translator, sources):
    expected = [tokens for tokens, _ in translator.translate_ids(sources[:7], max_batch_size=1)]
    outside = translator.bundle.model["vocab_size"] + 7  # outside the embedding table (CUDA would not refuse it)
    poisoned = Request([outside])
    others = [Request(s) for s in sources[:7]]
    _run_together(translator, [poisoned, *others])
    assert poisoned.finish is FinishReason.ERROR, poisoned.finish
    assert f"source token id {outside} is out of the vocabulary" in poisoned.error, poisoned.error
    assert [r.tokens for r in others] == expected
    assert all(r.finish in (FinishReason.EOS, FinishReason.LENGTH) for r in others)


@pytest.mark.parametrize("from_step", [0, 3])
def test_a_row_the_decoder_step_fails_on_fails_alone(translator, sources, monkeypatch, from_step):
    """A fault for one row at its first step, or at its fourth (from_step 3: by then greedy rows run their steps
    in the library, `Engine._burst`; a burst that fails leaves the step to the one-step path, which finds the row)."""
    poison = sources[0] * 3
    assert len(poison) not in {len(s) for s in sources[:7]}
    step, steps = translator._step, translator.decode_greedy_steps

    def fault(state):  # a fault for one row, wherever it sits in the batch
        if ((state.src_mask.sum(axis=1) == len(poison)) & ~state.hole & (state.positions >= from_step)).any():
            raise RuntimeError("injected fault")

    def fails_for_the_poisoned_row(state, k, *whole):
        fault(state)
        return step(state, k, *whole)

    def bursts_fail_for_the_poisoned_row(state, *args):
        fault(state)
        return steps(state, *args)

    expected = [tokens for tokens, _ in translator.translate_ids(sources[:7], max_batch_size=1)]
    monkeypatch.setattr(translator, "_step", fails_for_the_poisoned_row)
    monkeypatch.setattr(translator, "decode_greedy_steps", bursts_fail_for_the_poisoned_row)
    poisoned = Request(poison)
    others = [Request(s) for s in sources[:7]]
    _run_together(translator, [poisoned, *others])
    assert poisoned.finish is FinishReason.ERROR and poisoned.error == "RuntimeError: injected fault"
    assert [r.tokens for r in others] == expected
    assert all(r.finish in (FinishReason.EOS, FinishReason.LENGTH) for r in others)


def test_requests_at_every_limit_finish_with_length_alone_and_in_a_busy_batch(translator, eosless_bundle, sources):
    """The longest source the manifest allows, the largest output budget, and a model that never says
    eos (eosless_bundle): every row runs to its budget and ends with LENGTH, never past the position
    tables, alone and beside shorter rows that leave holes as they finish."""
    translator = _translator(eosless_bundle, translator.io_binding)
    limits = translator.limits
    longest = (sources[0] * limits.max_source_tokens)[: limits.max_source_tokens]
    for batch_mates in ([], sources[:6]):
        at_limit = Request(longest, max_decoding_length=limits.max_target_tokens)
        others = [Request(s, max_decoding_length=limits.max_target_tokens) for s in batch_mates]
        _run_together(translator, [at_limit, *others])
        assert at_limit.finish is FinishReason.LENGTH and len(at_limit.tokens) == limits.max_target_tokens
        assert all(r.finish is FinishReason.LENGTH and len(r.tokens) == r.budget(limits) for r in others)


MODES = [DecodingOptions(), DecodingOptions(beam_size=4, num_hypotheses=2), DecodingOptions(beam_size=2, length_penalty=1.0),
         DecodingOptions(sampling_topk=0, seed=7), DecodingOptions(sampling_topk=10, sampling_topp=0.9,
                                                                    sampling_temperature=0.7, seed=3)]


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_greedy_beam_and_sampled_requests_share_steps_and_each_gets_what_it_gets_alone(translator, sources, batching):
    """Requests of every mode and size join one running batch at staggered times: each gets exactly the
    n-best list (or draws) it gets alone, and the rows in use never pass the budget (a beam takes k)."""
    _share_steps_and_get_what_each_gets_alone(translator, sources, batching)


def test_a_sampler_without_top_k_does_not_make_its_batch_mates_rank_the_vocabulary(translator, sources, monkeypatch):
    """A sampled request without top-k needs its row's whole distribution; the step ranks only the k best of
    every row (a beam's 2 × 4 here) and hands the sampler its row's log-probs over the vocabulary, which it
    ranks itself. Every request gets what it gets alone."""
    modes = [DecodingOptions(), DecodingOptions(beam_size=4), DecodingOptions(sampling_topk=0, seed=7)] * 3
    alone = [translator.search_ids([s], m, max_batch_size=1)[0] for s, m in zip(sources, modes)]
    asked, decode = [], translator.decode_candidates

    def recording(state, k, scores=True, whole=None, budget=None):
        asked.append((k, None if whole is None else [engine.batch.rows[i].options for i in whole]))
        return decode(state, k, scores, whole, budget)

    monkeypatch.setattr(translator, "decode_candidates", recording)
    engine = Engine(translator, EngineConfig(max_running_rows=32))
    requests = [engine.submit(Request(s, options=m)) for s, m in zip(sources, modes)]  # before the start: one batch
    engine.start()
    try:
        assert all(r.done.wait(60) for r in requests)
    finally:
        engine.stop()
    assert (8, [modes[2]] * 3) in asked  # three samplers among beams and greedy rows
    assert all(k <= 8 for k, _ in asked)
    assert all(whole is None or whole == [modes[2]] * len(whole) for _, whole in asked)
    assert [r.tokens for r in requests] == [expected[0].tokens for expected in alone]


def test_int8_requests_get_what_they_get_alone_in_a_busy_mixed_batch(tiny_bundle, tiny_corpus):
    """The same with the int8 variant: each row's activations are quantised on a scale of its own
    (nmtserve.RowQuantize, in the kernel graphs), so its batch-mates cannot move its result (with ONNX Runtime's
    one scale for the whole tensor, attention_kernel=False, this test fails: a beam's score moves)."""
    int8 = OnnxTranslator(tiny_bundle, variant="int8", intra_op_threads=1, shared_cross=False)
    assert int8.graphs[1] == "decoder_kernels"
    sources = [int8.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    _share_steps_and_get_what_each_gets_alone(int8, sources, "continuous")


def _share_steps_and_get_what_each_gets_alone(translator, sources, batching):
    modes = [MODES[i % len(MODES)] for i in range(len(sources))]
    alone = [translator.search_ids([s], m, max_batch_size=1)[0] for s, m in zip(sources, modes)]
    seen = []  # (rows in use, decoding modes present) after each step

    def on_step(rows, slots, seconds):
        running = engine.batch.requests
        seen.append((sum(r.width for r in running), {MODES.index(r.options) for r in running}))

    engine = Engine(translator, EngineConfig(max_running_rows=12, batching=batching), on_step=on_step)
    engine.start()
    try:
        requests = []
        for i, (src, mode) in enumerate(zip(sources, modes)):
            requests.append(engine.submit(Request(src, options=mode)))
            if i % 4 == 0:
                time.sleep(0.01)
        assert all(r.done.wait(120) for r in requests)
    finally:
        engine.stop()
    for request, expected in zip(requests, alone):
        if request.options.sampling and TEST_VARIANT == "fp16":
            # fp16 on CUDA: a row's probabilities differ in their last bits with the batch's shape (other GEMM
            # kernels), enough to move a draw from the whole vocabulary across a boundary now and then
            assert request.finish in (FinishReason.EOS, FinishReason.LENGTH)
            continue
        assert request.tokens == expected[0].tokens
        if request.options.beam_size > 1:
            assert [h.tokens for h in request.hypotheses] == [h.tokens for h in expected]
            assert request.score == pytest.approx(expected[0].score, abs=1e-3)
    assert max(rows for rows, _ in seen) <= 12 and engine.stats()["running"] == 0
    assert max(len(modes) for _, modes in seen) >= 3  # modes really shared steps


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_with_cancellations_gets_what_each_request_gets_alone(translator, sources, seed):
    """Seeded random traffic: greedy, beam (2-5 beams, n-best, length penalty, patience) and sampled requests
    with output limits from 5 tokens to the model's, arriving at random moments into a continuous or static
    batch of a random row cap, a sixth of them cancelled while others run. Every request not cancelled gets
    exactly the n-best list it gets alone (a driver like this one found two beams of different lengths
    moving in one step: tests/export/test_search.py)."""
    rng = random.Random(seed)

    def options() -> DecodingOptions:
        kind = rng.random()
        if kind < 0.4:
            return DecodingOptions()
        if kind < 0.8:
            k = rng.randint(2, 5)
            return DecodingOptions(beam_size=k, num_hypotheses=rng.randint(1, k), length_penalty=rng.choice([0.0, 1.0]),
                                   patience=rng.choice([1.0, 2.0]))
        return DecodingOptions(sampling_topk=rng.choice([0, 5]), sampling_topp=rng.choice([1.0, 0.9]),
                               sampling_temperature=rng.choice([1.0, 0.7]), seed=rng.randint(1, 1000))

    jobs = [(rng.choice(sources), options(), rng.choice([256, 20, 5])) for _ in range(24)]
    engine = Engine(translator, EngineConfig(max_running_rows=rng.choice([6, 12, 24]), admit_rows=rng.choice([1, 8]),
                                             admit_steps=rng.choice([1, 4]),
                                             batching=rng.choice(["continuous", "continuous", "static"]))).start()
    try:
        requests, to_cancel = [], []
        for source, mode, limit in jobs:
            requests.append(engine.submit(Request(source, max_decoding_length=limit, options=mode)))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.01)
            if rng.random() < 0.2:
                to_cancel.append(requests[-1])
            if to_cancel and rng.random() < 0.3:
                to_cancel.pop().cancel()
        assert all(r.done.wait(120) for r in requests)
    finally:
        engine.stop()
    checked = 0
    for (source, mode, limit), request in zip(jobs, requests):
        if request.cancelled or (mode.sampling and TEST_VARIANT == "fp16"):  # fp16: see _share_steps_and_get_what_…
            continue
        alone = translator.search_ids([source], replace(mode, max_decoding_length=limit), max_batch_size=1)[0]
        assert [h.tokens for h in request.hypotheses or [request]] == [h.tokens for h in alone], (mode, limit)
        checked += 1
    assert checked >= len(jobs) // 2


def test_a_cancelled_beam_frees_all_its_rows_and_its_batch_mates_finish(translator, sources, monkeypatch):
    greedy_alone = [tokens for tokens, _ in translator.translate_ids(sources[:3], max_batch_size=1)]
    engine = Engine(translator, EngineConfig(max_running_rows=16))
    beam = Request(sources[0] * 6, max_decoding_length=200, options=DecodingOptions(beam_size=4, length_rule="ctranslate2"))
    step = translator._step

    def beam_never_says_eos(state, k, *whole):  # the beam ends by its cancel, not by finishing first (a fast host did)
        ids, scores = step(state, k, *whole)
        own = [i for i, r in enumerate(engine.batch.rows) if r is beam]
        ids[own] = np.where(ids[own] == translator.eos_id, translator.eos_id + 1, ids[own])
        return ids, scores

    monkeypatch.setattr(translator, "_step", beam_never_says_eos)
    engine.start()
    try:
        engine.submit(beam)
        deadline = time.monotonic() + 10
        while beam.admitted is None and time.monotonic() < deadline:
            time.sleep(0.001)
        mates = [engine.submit(Request(s)) for s in sources[:3]]
        beam.cancel()
        assert beam.done.wait(10) and all(r.done.wait(30) for r in mates)
        assert beam.finish is FinishReason.CANCELLED
        assert [r.tokens for r in mates] == greedy_alone
        # the hand-back thread finishes a mate as its row ends, while its burst runs on; the engine thread empties the
        # batch when the burst ends, a moment later
        deadline = time.monotonic() + 10
        while engine.batch.state is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.stats()["running"] == 0 and engine.batch.state is None
    finally:
        engine.stop()


def test_a_beam_that_never_says_eos_ends_with_length_at_its_budget(translator, sources, monkeypatch):
    step = translator._step

    def never_eos(state, k, *whole):
        ids, scores = step(state, k, *whole)
        return np.where(ids == translator.eos_id, translator.eos_id + 1, ids), scores

    monkeypatch.setattr(translator, "_step", never_eos)
    limits = translator.limits
    beam = Request(sources[0], max_decoding_length=limits.max_target_tokens, options=DecodingOptions(beam_size=3))
    _run_together(translator, [beam, Request(sources[1])])
    assert beam.finish is FinishReason.LENGTH and len(beam.tokens) == beam.budget(limits)


def _iterate(engine: Engine) -> list[Request]:
    """One iteration of the engine's loop, in this thread (the engine is not started) -> who joined."""
    with engine.lock:
        admitted = engine._schedule()
    engine._execute(admitted)
    return admitted


def test_newcomers_to_a_full_batch_gather_then_join_longest_source_first(translator, sources):
    by_length = sorted(sources, key=len)
    running_sources, short, long = by_length[-16:], by_length[0], by_length[-17]  # the running rows decode longest
    assert len(long) > len(short)
    engine = Engine(translator, EngineConfig(max_running_rows=16, admit_rows=2, admit_steps=3))
    running = [engine.submit(Request(s)) for s in running_sources]
    assert _iterate(engine) == running  # an empty batch takes everyone at once, in arrival order
    early, late = engine.submit(Request(short)), engine.submit(Request(long))
    engine.batch.leave(running[:1])  # one free row: fewer than admit_rows (2 of 16)
    engine._publish()
    joined = [_iterate(engine) for _ in range(3)]
    assert not any(r.done.is_set() for r in running[1:])  # (no other row freed meanwhile)
    assert joined[:2] == [[], []]  # they gather while fewer than admit_rows rows are free …
    assert joined[2] == [late]  # … until admit_steps steps have passed since the latest admission (the running
    # rows' own, at step 0); then least slack first:
    # the longer source joins before the shorter one that came first (it needs more steps)
    engine.batch.leave(running[1:3])
    engine._publish()
    other = engine.submit(Request(short))
    assert sorted(map(id, _iterate(engine))) == sorted(map(id, [early, other]))  # two free rows, two waiting: at once


def test_newcomers_below_saturation_gather_too(translator, sources):
    """Free rows are plenty, yet a lone newcomer gathers until admit_rows rows of newcomers wait or admit_steps
    steps have passed since the latest admission: each group is one encoder call, and each call stalls every
    running row (one sentence encoded costs about two of a group of eight). A batch of fewer than half
    admit_rows rows takes newcomers at once (few rows to stall, and newcomers too rare to gather)."""
    by_length = sorted(sources, key=len)
    engine = Engine(translator, EngineConfig(max_running_rows=16, admit_rows=2, admit_steps=3))
    running = [engine.submit(Request(s)) for s in by_length[-4:]]
    assert _iterate(engine) == running
    lone = engine.submit(Request(by_length[0]))
    assert [_iterate(engine) for _ in range(3)] == [[], [], [lone]]  # one row waiting: until admit_steps
    pair = [engine.submit(Request(s)) for s in by_length[1:3]]
    assert sorted(map(id, _iterate(engine))) == sorted(map(id, pair))  # two rows waiting: at once
    beam = engine.submit(Request(by_length[3], options=DecodingOptions(beam_size=2)))
    assert _iterate(engine) == [beam]  # a beam of two rows: at once
    assert not any(r.done.is_set() for r in running)  # (every step above had free rows to spare)
    assert engine.stats()["admissions"] == 4  # running, lone, pair, beam: an encoder call each
    engine = Engine(translator, EngineConfig(max_running_rows=64, admit_rows=8, admit_steps=4))
    running = [engine.submit(Request(s)) for s in by_length[-3:]]
    assert _iterate(engine) == running
    lone = engine.submit(Request(by_length[0]))
    assert _iterate(engine) == [lone]  # three rows running, fewer than half of admit_rows: at once
    lone = engine.submit(Request(by_length[1]))
    assert _iterate(engine) == []  # four: it gathers
    assert not any(r.done.is_set() for r in running)


def test_requests_that_waited_long_still_gather_after_an_admission(translator, sources):
    """At saturation every waiting request has waited more than admit_steps; the gathering counts from the
    latest admission (as text-generation-inference's max_waiting_tokens), so they still join in groups
    rather than a row or two at every step, each an encoder call of its own."""
    by_length = sorted(sources, key=len)
    engine = Engine(translator, EngineConfig(max_running_rows=16, admit_rows=2, admit_steps=3))
    running = [engine.submit(Request(s)) for s in by_length[-16:]]
    assert _iterate(engine) == running
    waiting = [engine.submit(Request(s)) for s in by_length[:3]]
    assert [_iterate(engine) for _ in range(4)] == [[], [], [], []]  # a full batch: no row free
    engine.batch.leave(running[:1])
    engine._publish()
    first = _iterate(engine)  # one free row, and no admission for 5 steps: one joins at once
    assert len(first) == 1 and first[0] in waiting
    engine.batch.leave(running[1:2])
    engine._publish()
    joined = [_iterate(engine) for _ in range(3)]
    assert not any(r.done.is_set() for r in running[2:])  # (no other row freed meanwhile)
    assert joined[:2] == [[], []]  # waited 6 steps and more, yet they gather: an admission was just made
    assert len(joined[2]) == 1 and joined[2][0] in waiting


def test_greedy_steps_run_in_the_library_through_row_ends_until_newcomers_may_join(tiny_bundle, tiny_corpus,
                                                                                    monkeypatch):
    """A batch of greedy requests steps in the library (host states; the io-binding translator above steps
    in Python) in continuous bursts: up to max_burst_steps steps an iteration, the admission's included, through the
    rows' ends (short budgets here). Tokens and scores are those of ONNX Runtime's own session one step at a time,
    and the step metrics count every step with its rows. A burst ends after the step at which a newcomer may join
    (`_schedule`'s rule, kept in the library): at once where its group is one row; after the rest of its gathering
    where it waits for a group of two."""
    translator = OnnxTranslator(tiny_bundle, intra_op_threads=1, shared_cross=False)
    assert translator.native_steps
    in_python = OnnxTranslator(tiny_bundle, intra_op_threads=1, shared_cross=False, native_steps=False)
    sources = [translator.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:6]
    budgets = [3, 256, 5, 256, 7, 256]
    one_step = [Request(s, max_decoding_length=b) for s, b in zip(sources, budgets)]
    _run_together(in_python, one_step, EngineConfig(max_running_rows=8))
    bursts, steps, one_step_calls, seen = [], translator.decode_greedy_steps, [], []
    one_step_of = translator.decode_candidates

    def recording(*args):
        tokens, *rest = steps(*args)
        bursts.append(len(tokens))
        return tokens, *rest

    def one_step_recording(*args, **kwargs):
        one_step_calls.append(len(bursts))  # after how many bursts
        return one_step_of(*args, **kwargs)
    monkeypatch.setattr(translator, "decode_greedy_steps", recording)
    monkeypatch.setattr(translator, "decode_candidates", one_step_recording)
    requests = [Request(s, max_decoding_length=b) for s, b in zip(sources, budgets)]
    engine = _run_together(translator, requests, EngineConfig(max_running_rows=8),
                           on_step=lambda rows, slots, seconds: seen.append(rows))
    assert [(r.tokens, r.score, r.finish) for r in requests] == [(r.tokens, r.score, r.finish) for r in one_step]
    assert {r.finish for r in requests} == {FinishReason.LENGTH, FinishReason.EOS}
    last = max(len(r.tokens) + (r.finish is FinishReason.EOS) for r in requests)  # the step at which the last ends
    assert bursts[0] == min(last, engine.config.max_burst_steps) and sum(bursts) == last and one_step_calls == []
    assert len(seen) == engine.steps == last  # every step in the library, each counted
    assert seen[0] == len(requests) and seen == sorted(seen, reverse=True)  # the rows each step ran for
    engine = Engine(translator, EngineConfig(max_running_rows=8, admit_rows=1))  # groups of one row
    first = engine.submit(Request(sources[1], max_decoding_length=256))
    _iterate(engine)  # first joins: one step
    with engine.lock:
        assert engine._schedule() == [] and engine._burst([]) == CONTINUE
    newcomer = engine.submit(Request(sources[2]))  # during the burst, as it were
    assert len(engine._execute([], CONTINUE)) == 1 and len(first.tokens) == 2
    assert _iterate(engine) == [newcomer]
    engine = Engine(translator, EngineConfig(max_running_rows=16, admit_rows=2, admit_steps=4))
    first = engine.submit(Request(sources[1], max_decoding_length=256))
    _iterate(engine)  # first joins: one step
    newcomer = engine.submit(Request(sources[2]))  # one row: it gathers until 4 steps after first's admission
    with engine.lock:
        assert engine._schedule() == [] and engine._burst([]) == CONTINUE
    assert len(engine._execute([], CONTINUE)) == 3 and len(first.tokens) == 4  # the rest of its gathering
    assert _iterate(engine) == [newcomer]


def test_a_request_that_finishes_in_a_burst_is_handed_back_while_the_burst_goes_on(eosless_bundle, tiny_corpus):
    """A started engine's hand-back thread finishes a request as soon as its row ends, while the library steps the
    rest of the batch on: it no longer counts as running, and its tokens are those it has alone."""
    translator = OnnxTranslator(eosless_bundle, intra_op_threads=1, shared_cross=False)
    source = max((translator.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs), key=len)
    expected = translator.translate_ids([source], max_decoding_length=2)[0][0]
    seen = {}

    def on_finish(request: Request) -> None:
        seen.update(thread=threading.current_thread().name, in_burst=engine.hand_back.burst is not None,
                    long_done=long.done.is_set(), running=engine.stats()["running"])
    # its whole budget (256 steps: a long source) in one burst, long after short's end: time for the hand-back
    # thread to wake even on a busy host
    long = Request(source * 4, max_decoding_length=256)
    short = Request(source, max_decoding_length=2, on_finish=on_finish)
    engine = Engine(translator, EngineConfig(max_running_rows=8, max_burst_steps=256))
    for request in (long, short):
        engine.submit(request)
    engine.start()
    try:
        assert long.done.wait(60) and short.done.is_set()
    finally:
        engine.stop()
    assert seen == {"thread": "nmtserve-hand-back", "in_burst": True, "long_done": False, "running": 1}
    assert short.tokens == expected and short.finish is FinishReason.LENGTH
    assert len(long.tokens) == translator.limits.output_budget(4 * len(source), 256) == 256
    assert not engine.hand_back.thread.is_alive()  # stopped with the engine


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux only: the thread name is set with prctl")
def test_the_engine_thread_is_named_for_top_and_perf(translator):
    """The engine thread's name in the kernel (top -H, perf, /proc) is nmtserve-engine, not python."""
    engine = Engine(translator).start()
    try:
        engine.submit(Request([5, 6, 7], max_decoding_length=2)).done.wait(30)  # the loop has started
        assert Path(f"/proc/self/task/{engine.thread.native_id}/comm").read_text().strip() == "nmtserve-engine"
    finally:
        engine.stop()
