"""ONNX Runtime against PyTorch: per graph over a shape grid, step by step, and end to end."""

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError
from nmtserve.export.build.manifest import file_entry
from nmtserve.export.build.verify import (
    SHAPE_GRID,
    cached_decode_parity,
    check_graph_files,
    diverging_off_a_tie,
    graph_parity,
    reference_tokens,
    verify_bundle,
)
from nmtserve.export.runtime import translator as translator_module
from nmtserve.export.runtime.bundle import load_bundle
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.training.checkpoint import load_model
from nmtserve.training.data import read_tsv
from tests.helpers import TEST_DEVICE, TEST_SCORE_TOLERANCE, TEST_VARIANT, run_cli


def test_every_graph_passes_checker_and_strict_shape_inference(tiny_bundle):
    bundle = load_bundle(tiny_bundle)
    checked = check_graph_files(tiny_bundle, bundle.manifest)
    assert set(checked.values()) == {"ok"} and "ranker.onnx" in checked


def test_fp32_graphs_match_pytorch_over_the_shape_grid(tiny_bundle, tiny_checkpoint):
    assert (1, 1, 0) in SHAPE_GRID and any(b > 1 for b, _, _ in SHAPE_GRID)  # batch 1, source 1, step 1 (empty cache)
    report = graph_parity(load_model(tiny_checkpoint).model, OnnxTranslator(tiny_bundle))
    assert report["encoder_relative"] < 1e-4 and report["decoder_cache_relative"] < 1e-4
    assert report["decoder_log_probs"] < 1e-4


def test_cached_step_by_step_decode_matches_pytorch(tiny_bundle, tiny_checkpoint, tiny_corpus):
    loaded = load_model(tiny_checkpoint)
    sources = [loaded.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:6]]
    report = cached_decode_parity(loaded.model, OnnxTranslator(tiny_bundle), sources, steps=20)
    assert report["log_prob_diff"] < 1e-4 and report["same_best_token"] >= 0.99
    # each row is judged up to the step that gives its eos (PyTorch's greedy tokens, then eos), not after
    ended = reference_tokens(loaded.model, sources, batch_size=len(sources))
    assert report["judged_row_steps"] == sum(min(20, len(tokens) + 1) for tokens in ended) < 20 * len(sources)


def test_end_to_end_greedy_tokens_identical_to_pytorch(tiny_bundle, tiny_checkpoint, tiny_corpus):
    loaded = load_model(tiny_checkpoint)
    sources = [loaded.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    expected = reference_tokens(loaded.model, sources, batch_size=8)
    got = [tokens for tokens, _ in OnnxTranslator(tiny_bundle).translate_ids(sources, max_batch_size=8)]
    # the tiny checkpoint is barely trained: on some machines two tokens tie to 1e-5 somewhere along the
    # way, and float noise (~1e-6) may then pick either; any other difference fails
    assert diverging_off_a_tie(loaded.model.eval(), sources, got, expected) == []
    assert sum(a == b for a, b in zip(got, expected)) >= 0.9 * len(sources)


def test_translate_batch_is_independent_of_batching_and_returns_scores(tiny_bundle, tiny_corpus, monkeypatch):
    tr = OnnxTranslator(tiny_bundle)
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:12]] + [""]
    many = tr.translate_batch(texts, max_batch_size=16, return_scores=True)
    # small batches are encoded ahead in groups (here of 5 sources: 5 batches of 1, then 2 batches of 2)
    monkeypatch.setattr(translator_module, "ENCODE_AHEAD", 5)
    for size in (1, 2):
        one = tr.translate_batch(texts, max_batch_size=size, return_scores=True)
        assert [t.tokens for t in one] == [t.tokens for t in many]
        assert np.allclose([t.score for t in one], [t.score for t in many], atol=1e-3)
    assert all(t.score <= 0 for t in one) and tr.translate_batch(texts[:1])[0].score is None


@pytest.mark.parametrize("kernels", [False, True], ids=["ort-nodes", "search-head-kernel"])
def test_a_step_without_scores_gives_the_best_token_and_its_value_before_the_log_softmax(
        tiny_bundle, tiny_checkpoint, tiny_corpus, monkeypatch, kernels):
    """The step's search head (with_search_head): scored, each row's candidates are log-probabilities
    (TopK of the log-softmax); unscored, the If skips the log-softmax and gives each row's best token
    (ArgMax) with its value before the log-softmax: PyTorch's logit for that token. The same from
    nmtserve.SearchHead, which takes the If's place where nmtserve's kernels are built."""
    tr = OnnxTranslator(tiny_bundle, attention_kernel=kernels)
    nodes = onnx.load(str(tr.bundle.graph_path("fp32", tr.graphs[1]))).graph.node  # the step it runs
    if kernels:
        assert [n.op_type for n in nodes].count("SearchHead") == 1
    else:
        [head] = [n for n in nodes if n.op_type == "If"]
        branches = {a.name: [n.op_type for n in a.g.node] for a in head.attribute}
        assert branches["then_branch"].count("LogSoftmax") == 1 and "TopK" in branches["then_branch"]
        assert "LogSoftmax" not in branches["else_branch"] and "ArgMax" in branches["else_branch"]
    model = load_model(tiny_checkpoint).model.eval()
    monkeypatch.setattr(model, "_log_probs", lambda x: model.embed.logits(x).float())  # decode() gives logits
    sources = [tr.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:6]]
    scored, unscored = tr.prefill(sources), tr.prefill(sources)
    prefixes = [[model.config.bos_id] for _ in sources]
    for _ in range(3):
        ids, log_probs = tr.decode_candidates(scored, 1)
        raw_ids, raw = tr.decode_candidates(unscored, 1, scores=False)
        logits = np.stack([_pytorch_logits(model, s, p) for s, p in zip(sources, prefixes)])
        assert (raw_ids == ids).all() and (raw_ids[:, 0] == logits.argmax(axis=1)).all()
        best = logits[np.arange(len(sources)), ids[:, 0]]
        assert np.abs(raw[:, 0] - best).max() < 1e-3 and (raw > 0).any()
        assert np.abs(log_probs[:, 0] - (best - np.logaddexp.reduce(logits, axis=1))).max() < 1e-3
        for state in (scored, unscored):
            state.choose(ids[:, 0])
        prefixes = [p + [int(t)] for p, t in zip(prefixes, ids[:, 0])]
    with pytest.raises(ValueError, match="k 4"):
        tr.decode_candidates(unscored, 4, scores=False)


@pytest.mark.parametrize("kernels", [False, True], ids=["ort-nodes", "kernel-graph"])
def test_a_steps_finish_code_says_eos_then_budget(tiny_bundle, tiny_corpus, kernels):
    """The step's stopping rule (with_stop_rule, read as Decoder._finish_codes): each row's finish is 1 where its
    best token is eos, else 2 where its position after the step reaches its budget, else 0 (the rule in numpy
    here), over steps in which rows of short translations say eos and budgets end longer ones, one a step."""
    tr = OnnxTranslator(tiny_bundle, attention_kernel=kernels, shared_cross=False)
    sources = [tr.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    by_length = sorted(zip([len(t) for t, _ in tr.translate_ids(sources, max_batch_size=8)], range(len(sources))))
    steps = by_length[3][0] + 1  # the 4 shortest translations' eos come by then; the 4 longest run on
    assert by_length[-4][0] > steps
    state = tr.prefill([sources[i] for _, i in by_length[:4] + by_length[-4:]])
    budget = state.positions + np.array([1000] * 4 + [steps - 3, steps - 2, steps - 1, steps])
    seen = set()
    for _ in range(steps):
        before = state.positions.copy()
        ids, _, finish = tr.decode_candidates(state, 2, budget=budget)
        assert finish.tolist() == np.where(ids[:, 0] == tr.eos_id, 1, np.where(before + 1 >= budget, 2, 0)).tolist()
        seen |= set(finish.tolist())
        state.choose(ids[:, 0])
    assert seen == {0, 1, 2}


def _pytorch_logits(model, source: list[int], prefix: list[int]) -> np.ndarray:
    """The next token's values after `prefix`, from a model whose decode() gives logits."""
    src, src_mask = torch.tensor([source]), torch.ones(1, len(source), dtype=torch.bool)
    with torch.no_grad():
        return model.decode(torch.tensor([prefix]), model.encode(src, src_mask), src_mask,
                            torch.ones(1, len(prefix), dtype=torch.bool))[0, -1].numpy()


def test_greedy_without_scores_gives_the_scored_tokens_and_no_score(tiny_bundle, tiny_checkpoint, tiny_corpus):
    tr = OnnxTranslator(tiny_bundle)
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    scored = tr.translate_batch(texts, max_batch_size=8, return_scores=True)
    unscored = tr.translate_batch(texts, max_batch_size=8)
    assert all(t.score is None for t in unscored)
    sources = [tr.tokenizer.encode(t, tr.limits.max_source_tokens) for t in texts]
    # ranked before or after the log-softmax, two values a bit apart may round to one: then either is right
    assert diverging_off_a_tie(load_model(tiny_checkpoint).model.eval(), sources, [t.tokens for t in unscored],
                               [t.tokens for t in scored]) == []
    assert all(np.isnan(h.score) for h, in tr.search_ids(sources[:5], scores=False))


def test_a_group_of_batches_is_encoded_in_one_call_with_the_results_of_a_call_each(tiny_bundle, tiny_corpus,
                                                                                    monkeypatch):
    """search_ids encodes a group of batches (up to ENCODE_AHEAD sources) in one encoder call, each batch's
    cross K/V a view of its rows: at batch 1, greedy and beam give what each sentence encoded alone gives."""
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:24]]
    tr = OnnxTranslator(tiny_bundle)
    sources = [tr.tokenizer.encode(t, tr.limits.max_source_tokens) for t in texts]
    for options in (DecodingOptions(), DecodingOptions(beam_size=3, num_hypotheses=2)):
        alone = [tr.search_ids([s], options, max_batch_size=1)[0] for s in sources]
        calls = []
        prefill = OnnxTranslator.prefill
        monkeypatch.setattr(OnnxTranslator, "prefill",
                            lambda self, batch, caches=True: calls.append(len(batch)) or prefill(self, batch, caches))
        grouped = tr.search_ids(sources, options, max_batch_size=1)
        monkeypatch.undo()
        assert calls == [24]  # 24 batches of one, one encoder call
        assert [[h.tokens for h in x] for x in grouped] == [[h.tokens for h in x] for x in alone]
        assert np.allclose([h.score for x in grouped for h in x], [h.score for x in alone for h in x], atol=1e-5)


def test_batches_decoded_at_once_on_threads_give_the_results_of_one_at_a_time(tiny_bundle, tiny_corpus, monkeypatch):
    """inter_threads: groups of batches go to threads of their own, each with its own binding over the
    same sessions; greedy, beam and n-best come out as decoded one batch at a time."""
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:24]]
    one_thread = OnnxTranslator(tiny_bundle)
    parallel = OnnxTranslator(tiny_bundle, intra_op_threads=1, inter_threads=3)
    threads = set()
    decode_group = OnnxTranslator._decode_group

    def recording(self, *args):
        threads.add(threading.current_thread().name)
        return decode_group(self, *args)
    monkeypatch.setattr(OnnxTranslator, "_decode_group", recording)
    for options in ({}, {"beam_size": 3, "num_hypotheses": 2}):
        expected = one_thread.translate_batch(texts, max_batch_size=2, return_scores=True, **options)
        threads.clear()
        got = parallel.translate_batch(texts, max_batch_size=2, return_scores=True, **options)
        assert len({name for name in threads if name.startswith("nmtserve-batch")}) >= 2  # 12 batches, 3 threads
        assert [[h.tokens for h in t.hypotheses] for t in got] == [[h.tokens for h in t.hypotheses] for t in expected]
        assert np.allclose([h.score for t in got for h in t.hypotheses],
                           [h.score for t in expected for h in t.hypotheses], atol=1e-5)
    with pytest.raises(ConfigError, match="inter_threads 0: must be at least 1"):
        OnnxTranslator(tiny_bundle, inter_threads=0)


def _teacher_forced_log_probs(tr: OnnxTranslator, sources, paths) -> np.ndarray:
    """(B, T, V) log-probabilities of tr's decoder fed `paths` (then eos) instead of its own choices."""
    state = tr.prefill(sources)
    steps = []
    for t in range(max(len(p) for p in paths) + 1):
        steps.append(tr.decode_candidates(state, 0)[1])  # (B, V): the whole vocabulary, by token id
        state.choose(np.array([p[t] if t < len(p) else tr.eos_id for p in paths], np.int64))
    return np.stack(steps, axis=1)


@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_encoder_and_decoder_read_one_copy_of_the_tied_embedding(tiny_bundle, variant):
    """The embedding table both graphs hold is stored once in the bundle's weights file, and both sessions map
    that one place of the file, never copying it: two mappings (the encoder's and the decoder's) of the table's
    offset, file-backed pages with nothing private (smaps' Anonymous 0 kB), which the page cache holds once."""
    from onnx.external_data_helper import ExternalDataInfo

    tr = OnnxTranslator(tiny_bundle, variant=variant, intra_op_threads=1)
    [encoder_table], [decoder_table] = ([ExternalDataInfo(t) for t in onnx.load(
        str(tr.bundle.graph_path(variant, graph)), load_external_data=False).graph.initializer
        if t.name == "model.embed.weight"] for graph in tr.graphs)
    assert (encoder_table.offset, encoder_table.length) == (decoder_table.offset, decoder_table.length)
    weights = str(tiny_bundle / "weights.bin")
    mappings = [block for block in open("/proc/self/smaps").read().split("\n") if block]
    found, anonymous = 0, []
    for i, line in enumerate(mappings):
        fields = line.split()
        if len(fields) == 6 and fields[5] == weights and int(fields[2], 16) == encoder_table.offset:
            found += 1
            anonymous.append(next(m for m in mappings[i + 1:] if m.startswith("Anonymous:")).split()[1])
    assert found >= 2, found  # one for each session
    assert anonymous == ["0"] * found, anonymous
    src_ids, src_mask = tr.pad([[10, 11, 12, tr.eos_id]])
    assert np.isfinite(tr.encode(src_ids, src_mask)[0]).all()  # the mapped table serves a real lookup


def test_int8_picks_fp32s_token_wherever_fp32_is_decisive(tiny_bundle, tiny_corpus):
    """Teacher-forced along fp32's greedy path. Whole-sentence agreement of a barely trained model is
    no measure (one flipped near-tie changes the rest, 4/40 to 26/40 sentences across training seeds);
    per step it is: measured on six tiny checkpoints, int8 chose fp32's token at 100% of the 173-643
    steps where fp32 led by more than 0.5 nats, and at 0.91-0.98 of all steps."""
    fp32, int8 = OnnxTranslator(tiny_bundle, variant="fp32"), OnnxTranslator(tiny_bundle, variant="int8")
    sources = [fp32.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    paths = [tokens for tokens, _ in fp32.translate_ids(sources, max_batch_size=64)]
    a, q = _teacher_forced_log_probs(fp32, sources, paths), _teacher_forced_log_probs(int8, sources, paths)
    on_path = np.arange(a.shape[1])[None, :] <= np.array([len(p) for p in paths])[:, None]  # (B, T)
    best_two = np.sort(a, axis=-1)[..., -2:]
    decisive = on_path & (best_two[..., 1] - best_two[..., 0] > 0.5)
    same = a.argmax(-1) == q.argmax(-1)
    assert decisive.sum() >= 50, decisive.sum()
    assert same[decisive].mean() >= 0.99 and same[on_path].mean() >= 0.8, (same[decisive].mean(), same[on_path].mean())


def test_cli_export_verify_reports_every_check(tiny_checkpoint, tmp_path):
    result = run_cli("export", str(tiny_checkpoint), "--out", str(tmp_path / "b"), "--variants", "fp32,int8,fp16",
                     "--verify", "--verify-limit", "20")
    assert result.returncode == 0, result.stderr
    for kernels in ("", "_kernels"):  # the portable graphs, and those on nmtserve's kernels
        for check in (f"fp32{kernels}_encoder_within_1e-4", f"fp32{kernels}_decoder_within_1e-4",
                      f"fp32{kernels}_cached_decode_within_1e-4", f"fp32{kernels}_shared_cross_cached_decode_within_1e-4",
                      f"fp32{kernels}_identical_tokens_at_least_99%", f"int8{kernels}_bleu_within_0.5_of_fp32"):
            assert f"pass  {check}" in result.stdout
    assert "not measured  fp16" in result.stdout  # no CUDA here; said, not skipped silently
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    latency = manifest["verification"]["variants"]["fp32"]["step_latency_ms"]["batch_1"]
    assert set(latency) == {"1", "16", "64", "128"}


def _perturb_one_weight(graph: Path, scale: float) -> str:
    """Change one element of the graph's first MatMul weight (a projection of the first layer), as a
    broken exporter would write it: the manifest records the new file. Returns the weight's name."""
    model = onnx.load(str(graph))
    matmul_inputs = {name for node in model.graph.node if node.op_type == "MatMul" for name in node.input}
    weight = next(w for w in model.graph.initializer if w.name in matmul_inputs and w.data_type == onnx.TensorProto.FLOAT)
    array = onnx.numpy_helper.to_array(weight).copy()
    array.flat[0] = array.flat[0] * scale + 0.5
    weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    onnx.save(model, str(graph))
    manifest_path = graph.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][graph.name] = file_entry(graph)
    manifest_path.write_text(json.dumps(manifest))
    return weight.name


@pytest.mark.parametrize("graph, check", [("encoder", "fp32_encoder_within_1e-4"), ("decoder", "fp32_decoder_within_1e-4"),
                                          ("decoder_shared", "fp32_shared_cross_cached_decode_within_1e-4"),
                                          ("encoder_kernels", "fp32_kernels_encoder_within_1e-4"),
                                          ("decoder_kernels", "fp32_kernels_decoder_within_1e-4"),
                                          ("decoder_shared_kernels", "fp32_kernels_shared_cross_cached_decode_within_1e-4")])
def test_verification_catches_one_perturbed_weight_in_any_graph(tiny_bundle, tiny_checkpoint, tmp_path, graph, check):
    """Every graph the runtime may load is verified: one weight changed in any of them fails its check, and only
    the checks of the graphs that read it."""
    bundle = shutil.copytree(tiny_bundle, tmp_path / "b")
    name = _perturb_one_weight(load_bundle(bundle).graph_path("fp32", graph), scale=2.0)
    report = verify_bundle(bundle, load_model(tiny_checkpoint), limit=20)
    assert not report["passed"], name
    assert not report["checks"][check], (name, report["variants"])
    other = "fp32_encoder_within_1e-4" if graph.endswith("_kernels") else "fp32_kernels_encoder_within_1e-4"
    assert report["checks"][other], (name, other)


def test_io_binding_keeps_the_caches_in_ortvalues_and_translates_identically(tiny_bundle, tiny_corpus):
    import onnxruntime as ort

    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:24]]
    # fp32 on a CPU: the same graphs both ways are the portable ones (the kernel graphs run on host states only),
    # whose int8 quantises on one scale per tensor, which makes a row's tokens depend on its batch-mates' states
    for variant in ("fp32",) if TEST_DEVICE == "cpu" else (TEST_VARIANT,):
        host = OnnxTranslator(tiny_bundle, variant=variant, device=TEST_DEVICE, io_binding=False, attention_kernel=False)
        bound = OnnxTranslator(tiny_bundle, variant=variant, device=TEST_DEVICE, io_binding=True)
        assert bound.graphs == host.graphs
        expected = host.translate_batch(texts, max_batch_size=8, return_scores=True)
        got = bound.translate_batch(texts, max_batch_size=8, return_scores=True)
        assert [t.tokens for t in got] == [t.tokens for t in expected], variant
        assert np.allclose([t.score for t in got], [t.score for t in expected], atol=TEST_SCORE_TOLERANCE), variant
        state = bound.prefill([bound.tokenizer.encode(texts[0]), bound.tokenizer.encode(texts[1])])
        assert all(isinstance(x, ort.OrtValue) for x in (state.k, state.v, state.cross_k, state.cross_v))
        tokens, scores = bound.decode_one_token(state)
        assert tokens.dtype == np.int64 and tokens.shape == scores.shape == (2,)
        assert isinstance(state.k, ort.OrtValue) and state.length == 1 and state.valid[:, 0].all()


def test_io_binding_translators_checks_on_plain_arrays_give_the_host_paths_values(tiny_bundle, tiny_corpus):
    """`encode` and `step` on host arrays (export --verify's form) on a session of the test device with IOBinding:
    host memory is bound as host memory (on CUDA, bound as device memory it was an invalid copy in the encoder)."""
    host = OnnxTranslator(tiny_bundle, variant=TEST_VARIANT, device=TEST_DEVICE, io_binding=False, attention_kernel=False)
    bound = OnnxTranslator(tiny_bundle, variant=TEST_VARIANT, device=TEST_DEVICE, io_binding=True)
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:3]]
    src_ids, src_mask = host.pad([host.tokenizer.encode(t) for t in texts])
    encoded = [tr.encode(src_ids, src_mask) for tr in (host, bound)]
    for expected, got in zip(*encoded):
        assert isinstance(got, np.ndarray) and np.allclose(got, expected, atol=TEST_SCORE_TOLERANCE)
    cross_k, cross_v, _ = encoded[0]
    n_layers, batch, heads, _, head_dim = cross_k.shape
    past = np.zeros((n_layers, batch, heads, 0, head_dim), host.kv_dtype)
    tokens, positions, valid = np.full(batch, host.bos_id, np.int64), np.zeros(batch, np.int64), np.zeros((batch, 0), bool)
    steps = [tr.step(tokens, positions, past, past, valid, cross_k, cross_v, src_mask) for tr in (host, bound)]
    for expected, got in zip(*steps):
        assert np.allclose(got, expected, atol=TEST_SCORE_TOLERANCE)
