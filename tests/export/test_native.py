"""The decoder step's session in nmtserve's library and its greedy loop (export/runtime/native.py): the
tokens and scores of ONNX Runtime's own session, errors with ONNX Runtime's message, and the switch."""

import os

import numpy as np
import pytest

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError, NmtserveError
from nmtserve.export.runtime import kernels
from nmtserve.export.runtime import native as native_module
from nmtserve.export.runtime.native import NativeBinding, NativeError, NativeSession
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.search import BeamSearch
from nmtserve.training.data import read_tsv

pytestmark = pytest.mark.usefixtures("kernel_library")  # every test here runs the library


def _pair(bundle, variant: str, **kwargs) -> tuple[OnnxTranslator, OnnxTranslator]:
    native = OnnxTranslator(bundle, variant=variant, intra_op_threads=1, **kwargs)
    assert native.native_steps and isinstance(native.decoder, NativeSession)
    return native, OnnxTranslator(bundle, variant=variant, intra_op_threads=1, native_steps=False, **kwargs)


@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_native_greedy_steps_give_the_tokens_and_scores_of_onnx_runtimes_session(tiny_bundle, eosless_bundle,
                                                                                  tiny_corpus, variant):
    """Greedy at batch 1 and 8, with and without scores, and with eos never found, so that every row runs
    to its budget (2 × source + 10 tokens): the loop stops at each row's budget, and the cache grows past
    its first 32 slots while the library loops."""
    for never_eos in (False, True):
        native, theirs = _pair(eosless_bundle if never_eos else tiny_bundle, variant)
        sources = [native.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
        assert max(2 * len(s) + 10 for s in sources) > 32
        for batch in (1, 8):
            for scores in (True, False):
                a, b = (tr.search_ids(sources, DecodingOptions(), max_batch_size=batch, scores=scores)
                        for tr in (native, theirs))
                assert [h.tokens for h, in a] == [h.tokens for h, in b]
                assert np.array_equal([h.score for h, in a], [h.score for h, in b], equal_nan=not scores)
        if never_eos:
            assert [len(h.tokens) for h, in a] == [native.limits.output_budget(len(s), 256) for s in sources]


def test_a_binding_keeps_the_c_arrays_of_each_kind_of_send_and_binds_each_new_states_buffers(tiny_bundle, tiny_corpus,
                                                                                             monkeypatch):
    """Each batch of one binds a new state's buffers (new addresses, and a new source length's shapes): a send of
    the same names and shapes reuses its C arrays with the new addresses, and a binding that keeps only one kind
    (`_TABLES` 1) makes them again at each new kind; the tokens are ONNX Runtime's session's either way."""
    sources = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    for kinds in (native_module._TABLES, 1):
        monkeypatch.setattr(native_module, "_TABLES", kinds)
        native, theirs = _pair(tiny_bundle, "fp32")
        expected = [t.text for t in theirs.translate_batch(sources, max_batch_size=1)]
        assert [t.text for t in native.translate_batch(sources, max_batch_size=1)] == expected
        assert len(native._binding._tables) > 1 if kinds > 1 else len(native._binding._tables) == 1


def test_every_search_runs_on_the_librarys_session(tiny_bundle, tiny_corpus):
    """Beam search, sampling and the server's step (rows of their own cross K/V) bind and run one step at a
    time through the same session, with the same results; two batches at once share it."""
    sources = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    for kwargs in ({}, {"shared_cross": False}, {"inter_threads": 2}):
        native, theirs = _pair(tiny_bundle, "fp32", **kwargs)
        for options in ({"beam_size": 4, "num_hypotheses": 2}, {"sampling_topk": 5, "seed": 3}, {}):
            a, b = (tr.translate_batch(sources, max_batch_size=4, return_scores=True, **options) for tr in (native, theirs))
            assert [(t.text, t.score, [(x.text, x.score) for x in t.alternatives]) for t in a] == \
                   [(t.text, t.score, [(x.text, x.score) for x in t.alternatives]) for t in b]


BEAM_OPTIONS = [  # CTranslate2's stopping with and without a length penalty, transformers', and the budget's last step
    # with a forced eos (length_rule "transformers"), which the library leaves to Python
    DecodingOptions(beam_size=4, num_hypotheses=2),
    DecodingOptions(beam_size=3, num_hypotheses=3, length_penalty=1.0, patience=1.5),
    DecodingOptions(beam_size=5, max_decoding_length=4),  # budgets that end searches
    DecodingOptions(beam_size=4, length_penalty=0.6, beam_stopping="transformers"),
    DecodingOptions(beam_size=2, max_decoding_length=6, length_rule="transformers"),
]


@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_native_beam_search_gives_the_n_best_lists_of_the_search_in_python(tiny_bundle, tiny_corpus, variant,
                                                                           monkeypatch):
    """Beam search's steps in the library (nmt_beam_steps, BeamSearch called back where a rule applies) at batch 1, 3
    and 8, with each of BEAM_OPTIONS, and with eos never found (every search to its budget, the cache growing past
    its first 32 slots while the library loops): the same hypotheses, scores and finish as the search in Python one
    step at a time; the library ran every step after the first."""
    native, theirs = _pair(tiny_bundle, variant)
    sources = [native.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    ran, beam_steps = [0], NativeBinding.beam_steps

    def counted(*args):
        steps, left = beam_steps(*args)
        ran[0] += steps
        return steps, left
    monkeypatch.setattr(NativeBinding, "beam_steps", counted)
    for never_eos in (False, True):
        if never_eos:
            native.eos_id = theirs.eos_id = -1
        for options in BEAM_OPTIONS[:1] if never_eos else BEAM_OPTIONS:
            for batch in (1, 3, 8):
                steps_before = ran[0]
                a, b = (tr.search_ids(sources, options, max_batch_size=batch) for tr in (native, theirs))
                assert a == b, (options, batch)
                assert ran[0] > steps_before
                if never_eos and batch == 1:
                    assert ran[0] - steps_before == sum(len(h[0].tokens) - 1 for h in a)
        if never_eos:
            assert [len(h[0].tokens) for h in a] == [native.limits.output_budget(len(s), 256) for s in sources]
            assert max(len(h[0].tokens) for h in a) > 32


def test_the_library_takes_no_beam_step_past_the_ordinary_ones_it_is_given(tiny_bundle, tiny_corpus, monkeypatch):
    """Each search says how many ordinary steps the library may take before it calls the search back
    (BeamSearch.ordinary_steps): given 2, the library never takes more in a row, and the n-best lists stay the
    search's."""
    native, theirs = _pair(tiny_bundle, "fp32")
    sources = [native.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    in_a_row, advance = [], BeamSearch.advance

    def recorded(self, parents, tokens, scores):
        in_a_row.append(len(parents))
        return advance(self, parents, tokens, scores)
    monkeypatch.setattr(BeamSearch, "advance", recorded)
    monkeypatch.setattr(BeamSearch, "ordinary_steps", lambda self: min(2, self.budget - self.steps - 1))
    options = DecodingOptions(beam_size=4, num_hypotheses=2)
    assert native.search_ids(sources, options, max_batch_size=4) == theirs.search_ids(sources, options, max_batch_size=4)
    assert max(in_a_row) == 2


def test_an_error_in_beam_searchs_rules_called_back_by_the_library_is_raised_and_the_session_goes_on(
        tiny_bundle, tiny_corpus, monkeypatch):
    native, theirs = _pair(tiny_bundle, "fp32")
    sources = [native.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    select, calls = BeamSearch.select, [0]

    def failing(self, *args):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("a rule failed")
        return select(self, *args)
    monkeypatch.setattr(BeamSearch, "select", failing)
    options = DecodingOptions(beam_size=4)
    with pytest.raises(NmtserveError, match="sentence .*: error \\(ValueError: a rule failed\\)"):
        native.search_ids(sources, options, max_batch_size=8)
    assert native.search_ids(sources, options, max_batch_size=8) == theirs.search_ids(sources, options, max_batch_size=8)


def test_a_native_error_carries_onnx_runtimes_message_and_the_session_goes_on(tiny_bundle):
    native, plain = _pair(tiny_bundle, "fp32")
    binding = native.decoder.io_binding()
    assert isinstance(binding, NativeBinding)
    buffer = np.zeros(4, np.int64)
    binding.bind("no_such_input", np.int64, (4,), buffer.ctypes.data)  # sent with the next run
    with pytest.raises(NativeError, match="no_such_input"):
        binding.run()
    with pytest.raises(NativeError):  # nothing bound: ONNX Runtime refuses the run
        binding.run()
    texts = ["a b c", "the cat sleeps", "we are happy ."]  # the session goes on: as ONNX Runtime's own session
    found, expected = (tr.translate_batch(texts, return_scores=True) for tr in (native, plain))
    assert [t.tokens for t in found] == [t.tokens for t in expected]
    assert np.allclose([t.score for t in found], [t.score for t in expected], atol=1e-5)
    with pytest.raises(NativeError, match="(?i)protobuf|parse|model"):  # what ONNX Runtime says of the bytes
        NativeSession(b"not an onnx model", 1, {})


def test_python_calls_the_library_through_the_declarations_of_kernels_h(tiny_bundle):
    """Every function kernels.h declares is in the built library (the compiler reads the same declarations, so the
    definitions match them), and a wrong argument is cffi's TypeError before any call, never a crash."""
    import re

    declared = re.findall(r"\b(nmt_\w+)\(", kernels.INTERFACE.read_text())
    native, _ = _pair(tiny_bundle, "fp32")
    library = native.decoder._library
    assert {"nmt_greedy_run", "nmt_beam_steps", "nmt_bind", "nmt_runner_create"} <= set(declared)
    for name in declared:
        assert callable(getattr(library, name)), name
    binding = native.decoder.io_binding()
    with pytest.raises(TypeError):
        library.nmt_run(binding._handle, "not a binding", binding._error, 10)
    with pytest.raises(TypeError):
        binding.greedy_run(1, np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.float32), np.zeros(1, bool),
                           np.zeros(1, bool), np.zeros(1, np.int64), (), "step zero",
                           (np.zeros((1, 1), np.int64), None, np.zeros(1, np.int64), np.zeros(1, np.uint8)))


def test_asking_for_native_steps_where_they_cannot_run_is_a_config_error(tiny_bundle):
    with pytest.raises(ConfigError, match="native_steps"):
        OnnxTranslator(tiny_bundle, attention_kernel=False, native_steps=True)
    assert not OnnxTranslator(tiny_bundle, attention_kernel=False).native_steps  # ONNX Runtime's own session


def test_the_servers_greedy_steps_keep_holes_still_and_stop_when_asked(tiny_bundle, eosless_bundle, tiny_corpus):
    """`decode_greedy_steps` (a static batch's bursts, the library's greedy loop with until_a_row_ends) over rows of their
    own cross K/V with a hole: each step's tokens and scores are those of one step at a time, the hole's position
    stays at 0, and the loop ends at a row's eos, at a row's budget, after one step when `stop_at` has passed, and at
    the cache's end. The same loop in Python (`_greedy_run_here`, on ONNX Runtime's own
    session) gives the same, step by step."""
    native, python = _pair(tiny_bundle, "fp32", shared_cross=False)
    sources = [native.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:4]
    ours, here, theirs = native.prefill(sources), python.prefill(sources), native.prefill(sources)
    for state in (ours, here, theirs):
        state.free([1])
    far = np.full(4, 10_000)
    tokens, scores, end, by_eos = native.decode_greedy_steps(ours, 50, far)
    expected = []
    while not expected or expected[-1][0][~theirs.hole].tolist().count(native.eos_id) == 0:
        expected.append(native.decode_one_token(theirs))
    assert len(tokens) == len(expected) < 50  # up to the first eos of a row that is not the hole
    keep = ~ours.hole
    for (t, s), (want, want_score) in zip(zip(tokens, scores), expected):
        assert t[keep].tolist() == want[keep].tolist() and np.array_equal(s[keep], want_score[keep])
    assert ours.positions.tolist() == theirs.positions.tolist() and ours.positions[1] == 0
    ended = [i for i in (0, 2, 3) if expected[-1][0][i] == native.eos_id]
    assert np.flatnonzero(end[keep] >= 0).tolist() == [[0, 2, 3].index(i) for i in ended] and by_eos[ended].all()
    same = python.decode_greedy_steps(here, 50, far)
    assert all(np.array_equal(x[:, keep] if x.ndim == 2 else x[keep], y[:, keep] if y.ndim == 2 else y[keep])
               for x, y in zip(same, (tokens, scores, end, by_eos)))
    # from here on no eos ends the loop: the same states stepped by the same model that never says eos
    for tr, state in zip(_pair(eosless_bundle, "fp32", shared_cross=False), (ours, here)):
        budget = state.positions + np.array([5, 0, 7, 9])
        tokens, _, end, by_eos = tr.decode_greedy_steps(state, 50, budget)
        assert len(tokens) == 5 and end.tolist()[0] == 4 and end[2:].tolist() == [-1, -1] and not by_eos[0]
        assert len(tr.decode_greedy_steps(state, 3, far)[0]) == 3
        assert len(tr.decode_greedy_steps(state, 10, far, stop_at=1.0)[0]) == 1  # time.monotonic() is past 1.0 s
        before = state.length
        assert len(tr.decode_greedy_steps(state, 1000, far, scores=False)[0]) == state.capacity - before \
            == state.length - before
        assert state.positions[1] == 0
    assert ours.positions.tolist() == here.positions.tolist()


def test_a_continuous_burst_runs_through_row_ends_and_hands_each_back_until_newcomers_may_join(eosless_bundle,
                                                                                                 tiny_corpus):
    """`decode_greedy_steps` with `Continuing` (the server's continuous bursts): rows of a model that never says eos,
    with budgets 2, 5 and 9 steps and a hole. With no one waiting the run goes through every row's end: a finished
    row keeps its position and its column is no longer written, its tokens are those of a run that ends there, and
    after each step in which a row finishes `progress` holds the steps run and one byte reaches the pipe. With
    requests waiting, it ends after the step at which they may join: two waiting in groups of two, once two rows are
    free; one, once `gather_steps` have run and a row is free; one, at once, where fewer than half a group's rows are
    live and a row is free besides."""
    tr = OnnxTranslator(eosless_bundle, intra_op_threads=1, shared_cross=False)
    sources = [tr.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:4]
    steps_each = np.array([2, 0, 5, 9])  # row 1 is the hole

    def burst(waiting: int, free_rows: int, gather: int, gather_steps: int, fd: int = -1):
        state = tr.prefill(sources)
        state.free([1])
        continuing = native_module.Continuing(np.array([waiting], np.int32), free_rows, gather, gather_steps,
                                              np.zeros(1, np.int64), fd)
        tokens, _, end, _ = tr.decode_greedy_steps(state, 50, state.positions + steps_each, True, 0.0, continuing)
        return state, tokens, end, continuing

    read, write = os.pipe()
    try:
        state, tokens, end, continuing = burst(0, 0, 2, 100, write)
        assert len(tokens) == 9 and continuing.out[0].shape[0] >= 9
        assert end[[0, 2, 3]].tolist() == [1, 4, 8] and state.positions.tolist() == [2, 0, 5, 9]
        assert int(continuing.progress[0]) == 9 and len(os.read(read, 100)) == 3  # a byte a step that ended rows
    finally:
        os.close(read)
        os.close(write)
    alone = tr.prefill(sources[:1])
    assert tokens[:2, 0].tolist() == tr.decode_greedy_steps(alone, 50, alone.positions + 2)[0][:, 0].tolist()
    assert len(burst(2, 0, 2, 100)[1]) == 5  # rows 0 and 2 free after step 5
    assert len(burst(1, 0, 2, 100)[1]) == 9  # one waits for a group of two that never frees: every row's end
    assert len(burst(1, 0, 2, 4)[1]) == 4  # a row free after 2 steps; 4 run
    assert len(burst(1, 1, 8, 100)[1]) == 1  # 3 live rows, fewer than 8 / 2, and one free


@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_offline_greedy_leaves_finished_rows_in_the_library_and_python_only_grows_the_cache(eosless_bundle, tiny_corpus,
                                                                                           monkeypatch, variant):
    """`greedy_run` (offline greedy on the library): a batch's steps, and its finished rows leaving it, run in the
    library; Python takes a run back only when the cache is full. With eos never said, 8 rows whose budgets end
    before the first 32 slots are full (4 short sources) and after, within 64 (4 long ones): the first run fills
    the 32 slots and comes back with the 4 long rows only, moved into the first places by the library; the second,
    on the doubled cache, ends with none. Tokens and scores are the Python loop's, row by row."""
    native, theirs = _pair(eosless_bundle, variant)
    pairs = [native.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    long = [s for s in pairs if 40 < native.limits.output_budget(len(s), 256) <= 64][:4]
    sources = [s[:3] for s in pairs[:4]] + long  # budgets 16, and 41 to 64: 2 × source + 10 tokens
    assert len(long) == 4
    runs = []
    greedy_run = NativeBinding.greedy_run

    def recording(self, rows, *args, **kwargs):
        taken, left = greedy_run(self, rows, *args, **kwargs)
        runs.append((rows, len(args[-1][0]), taken, left))  # rows at the start, room, steps, rows left
        return taken, left
    monkeypatch.setattr(NativeBinding, "greedy_run", recording)
    for scores in (True, False):
        runs.clear()
        a, b = (tr.search_ids(sources, DecodingOptions(), max_batch_size=8, scores=scores) for tr in (native, theirs))
        assert [h.tokens for h, in a] == [h.tokens for h, in b]
        assert np.array_equal([h.score for h, in a], [h.score for h, in b], equal_nan=not scores)
        assert [h.finish for h, in a] == ["length"] * 8
        assert runs[0] == (8, 32, 32, 4) and runs[1][:2] == (4, 32) and runs[1][3] == 0 and len(runs) == 2


@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_offline_beam_search_leaves_finished_searches_in_the_library_and_python_only_grows_the_cache(
        tiny_bundle, tiny_corpus, monkeypatch, variant):
    """`beam_steps` (offline beam search on the library, after Python's first step): the searches that are over leave
    the batch in the library. With eos never said, 8 searches of beam 4 whose budgets end before the first 32 slots
    are full (4 short sources) and after, within 64 (4 long ones): the first run fills the 31 slots left and comes back
    with the 4 long searches only, moved into the first places by the library; the second, on the doubled cache, ends
    with none. The n-best lists are the search's in Python."""
    native, theirs = _pair(tiny_bundle, variant)
    native.eos_id = theirs.eos_id = -1
    pairs = [native.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    long = [s for s in pairs if 40 < native.limits.output_budget(len(s), 256) <= 64][:4]
    sources = [s[:3] for s in pairs[:4]] + long[::-1]  # budgets 16, then 64 to 41: the longest search moves
    assert len(long) == 4
    runs = []
    beam_steps = NativeBinding.beam_steps

    def recording(self, groups, *args):
        steps, left = beam_steps(self, groups, *args)
        runs.append((groups, len(args[-3][0]), steps, left))  # groups at the start, room, steps, groups left
        return steps, left
    monkeypatch.setattr(NativeBinding, "beam_steps", recording)
    options = DecodingOptions(beam_size=4, num_hypotheses=2)
    a, b = (tr.search_ids(sources, options, max_batch_size=8) for tr in (native, theirs))
    assert a == b
    assert [len(h[0].tokens) for h in a] == [native.limits.output_budget(len(s), 256) for s in sources]
    assert runs[0] == (8, 31, 31, 4) and runs[1][:2] == (4, 32) and runs[1][3] == 0 and len(runs) == 2
