"""Beam search, n-best lists and sampling over gRPC, on a real server (tests/server/conftest.py): each
sentence gets what OnnxTranslator gives it alone, whatever traffic shares the running batch."""

import concurrent.futures
import json
import shutil

import grpc
import numpy as np
import pytest

from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.server.config import ServerConfig
from nmtserve.training.data import read_tsv
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, metric, scrape

# (request options, the same as OnnxTranslator.translate_batch keywords); the server's limit is 64 tokens
MODES = [
    (pb.DecodingOptions(), {}),
    (pb.DecodingOptions(beam_size=4, num_hypotheses=3, return_scores=True), dict(beam_size=4, num_hypotheses=3)),
    (pb.DecodingOptions(beam_size=2, length_penalty=1.0), dict(beam_size=2, length_penalty=1.0)),
    (pb.DecodingOptions(sampling_topk=0, seed=11), dict(sampling_topk=0, seed=11)),
    (pb.DecodingOptions(sampling_topk=8, sampling_topp=0.8, sampling_temperature=0.6, seed=5),
     dict(sampling_topk=8, sampling_topp=0.8, sampling_temperature=0.6, seed=5)),
    # CTranslate2's disabled tokens: these requests' rows rank the whole vocabulary in their searches
    (pb.DecodingOptions(min_decoding_length=6, no_repeat_ngram_size=2, suppress_sequences=["le chat"]),
     dict(min_decoding_length=6, no_repeat_ngram_size=2, suppress_sequences=["le chat"])),
    (pb.DecodingOptions(beam_size=3, num_hypotheses=2, no_repeat_ngram_size=2, disable_unk=True),
     dict(beam_size=3, num_hypotheses=2, no_repeat_ngram_size=2, disable_unk=True)),
    (pb.DecodingOptions(sampling_topk=5, seed=3, min_decoding_length=4, suppress_sequences=["s"]),
     dict(sampling_topk=5, seed=3, min_decoding_length=4, suppress_sequences=["s"])),
    # CTranslate2's repetition penalty, on the logits of these rows alone
    (pb.DecodingOptions(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (pb.DecodingOptions(beam_size=2, repetition_penalty=0.8), dict(beam_size=2, repetition_penalty=0.8)),
    # CTranslate2's return_attention: the aligner's call once these requests finish
    (pb.DecodingOptions(return_attention=True), dict(return_attention=True)),
    (pb.DecodingOptions(beam_size=3, num_hypotheses=2, return_attention=True),
     dict(beam_size=3, num_hypotheses=2, return_attention=True)),
]


@pytest.fixture(scope="module")
def sentences(tiny_corpus) -> list[str]:
    return [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:10]]


@pytest.fixture(scope="module")
def alone(tiny_bundle, sentences) -> list[list]:
    """alone[m][i]: mode m's Translation of sentence i, each sentence in a batch of its own."""
    tr = OnnxTranslator(tiny_bundle, shared_cross=False)  # the server's step
    return [tr.translate_batch(sentences, max_batch_size=1, max_decoding_length=64, return_scores=True, **kw)
            for _, kw in MODES]


@pytest.fixture(scope="module")
def two_engines(tiny_bundle):
    """The model served by two engines (serve --inter-threads 2), one intra-op thread each."""
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=0,
                                       max_sentences=8, max_sentence_chars=300, max_decoding_length=64,
                                       inter_threads=2, threads=1))
    yield server
    server.stop()


@pytest.mark.parametrize("server", ["served", "two_engines"])
def test_every_mode_in_concurrent_mixed_traffic_gets_its_alone_result(server, request, sentences, alone):
    """Unary calls of every mode and streams with a beam, 4 client threads at once, twice over; with two
    engines, both decode (each over its own binding of the same sessions) and nothing depends on which."""
    served = request.getfixturevalue(server)
    engines = served.running.engine.engines
    steps_before = [engine.stats()["steps"] for engine in engines]

    def call(job):
        m, i = job
        with served.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            if m == 1 and i % 2:  # a beam streamed: deltas then the final translation
                messages = list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=sentences[i],
                                                                               options=MODES[m][0]), timeout=60))
                final = messages[-1].final
                assert "".join(msg.delta for msg in messages[:-1]) == final.text
                return m, i, final
            return m, i, stub.Translate(pb.TranslateRequest(sentences=[sentences[i]], options=MODES[m][0]),
                                        timeout=60).translations[0]

    jobs = [(m, i) for _ in range(2) for i in range(len(sentences)) for m in range(len(MODES))]
    before = scrape(served.running.metrics_port)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, jobs))
    after = scrape(served.running.metrics_port)
    assert all(engine.stats()["steps"] > before for engine, before in zip(engines, steps_before))
    # the request metrics count each decoding mode apart (MODES: 4 greedy, 5 beam, 3 sampled)
    for mode, share in (("greedy", 4), ("beam", 5), ("sampling", 3)):
        sentences_done = metric(after, "nmtserve_sentences_total", mode=mode) - metric(before, "nmtserve_sentences_total",
                                                                                        mode=mode)
        assert sentences_done == share * 2 * len(sentences), mode
    streamed = metric(after, "nmtserve_requests_total", mode="beam", rpc="TranslateStream", code="OK") - metric(
        before, "nmtserve_requests_total", mode="beam", rpc="TranslateStream", code="OK")
    assert streamed == len(sentences)
    for m, i, got in results:
        expected = alone[m][i]
        assert got.text == expected.text, (MODES[m][1], i)
        assert [a.text for a in got.alternatives] == [a.text for a in expected.alternatives]
        for message, translation in zip([got, *got.alternatives], expected.hypotheses, strict=True):
            rows = [list(row.weights) for row in message.attention.rows]
            assert len(rows) == (message.output_tokens if translation.attention is not None else 0)
            if rows:
                np.testing.assert_allclose(rows, translation.attention, atol=1e-5)
        if m == 1:
            assert len(got.alternatives) == 2 and got.score == pytest.approx(expected.score, abs=1e-3)
            assert [a.score for a in got.alternatives] == pytest.approx([a.score for a in expected.alternatives],
                                                                         abs=1e-3)
            assert got.score >= got.alternatives[0].score >= got.alternatives[1].score


@pytest.mark.parametrize("options, message", [
    (pb.DecodingOptions(beam_size=9), "options.beam_size 9: must be at most 8 (the server's --max-beam-size)"),
    (pb.DecodingOptions(beam_size=2, num_hypotheses=3), "options.num_hypotheses 3: must be between 1 and beam_size (2)"),
    (pb.DecodingOptions(sampling_topk=0, sampling_topp=1.5), "options.sampling_topp 1.5: must be in (0, 1]"),
    (pb.DecodingOptions(sampling_topk=0, sampling_temperature=-1.0), "options.sampling_temperature -1.0: must be above 0"),
    (pb.DecodingOptions(beam_size=3, sampling_topk=5), "options.sampling_topk 5: must be 1 (no sampling) with beam_size"),
    (pb.DecodingOptions(min_decoding_length=999), "options.min_decoding_length 999: must be between 0 and max_decoding_length"),
    (pb.DecodingOptions(suppress_sequences=[" "]), "options.suppress_sequences ((),): must be sequences of at least one"),
    (pb.DecodingOptions(repetition_penalty=0.0), "options.repetition_penalty 0.0: must be above 0 (1: none)"),
])
def test_an_out_of_range_option_is_invalid_argument_naming_the_field_value_and_limit(served, options, message):
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        for call in (lambda: stub.Translate(pb.TranslateRequest(sentences=["The cat sleeps."], options=options)),
                     lambda: list(stub.TranslateStream(pb.TranslateStreamRequest(sentence="The cat.", options=options)))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(message)


def test_model_info_reports_the_beam_limit(served):
    with served.channel() as channel:
        info = pb_grpc.TranslationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest())
    assert info.limits.max_beam_size == 8


def test_target_prefix_in_one_call_with_others_gets_the_offline_result(served, tiny_bundle, tiny_corpus):
    """target_prefix per sentence (rows of 0 to 3 forced words in one admission, beside calls without), greedy and
    beam 4: each translation begins with its prefix and equals OnnxTranslator's translate_batch; a count other than
    the sentences' or a prefix without room is INVALID_ARGUMENT naming it."""
    pairs = read_tsv(tiny_corpus / "test.tsv").pairs[:8]
    texts = [s for s, _ in pairs]
    prefixes = [" ".join(t.split()[:i % 4]) for i, (_, t) in enumerate(pairs)]
    tr = OnnxTranslator(tiny_bundle, shared_cross=False)
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        for beam in (1, 4):
            expected = tr.translate_batch(texts, beam_size=beam, max_decoding_length=64, target_prefix=prefixes)
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                plain = pool.submit(stub.Translate, pb.TranslateRequest(sentences=texts), timeout=60)
                got = stub.Translate(pb.TranslateRequest(sentences=texts, target_prefix=prefixes,
                                                         options=pb.DecodingOptions(beam_size=beam)), timeout=60)
                plain.result()
            assert [t.text for t in got.translations] == [t.text for t in expected]
            assert all(t.text.startswith(p) for t, p in zip(got.translations, prefixes))
            events = list(stub.TranslateStream(pb.TranslateStreamRequest(
                sentence=texts[3], target_prefix=prefixes[3], options=pb.DecodingOptions(beam_size=beam)), timeout=60))
            assert "".join(e.delta for e in events) == events[-1].final.text == expected[3].text
            assert events[0].delta.startswith(prefixes[3])
            favoured = stub.Translate(pb.TranslateRequest(sentences=texts, target_prefix=prefixes, options=pb.DecodingOptions(
                beam_size=beam, prefix_bias_beta=0.5)), timeout=60)
            assert [t.text for t in favoured.translations] == [t.text for t in tr.translate_batch(
                texts, beam_size=beam, max_decoding_length=64, target_prefix=prefixes, prefix_bias_beta=0.5)]
        for prefixes, message in ((["Le"], "target_prefix: 1 given for 8 sentences"),
                                  ([""] * 7 + ["le " * 80], "target_prefix[7]: ")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Translate(pb.TranslateRequest(sentences=texts, target_prefix=prefixes), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


def test_return_attention_names_its_tokens_and_is_refused_where_there_is_none(served, tiny_bundle, tiny_corpus,
                                                                               tmp_path):
    """return_attention: a row per token the translation shows (a target_prefix's first; a TranslateStream's final
    too), a column per source token the model read, each row summing to 1. TranslateText, and a model whose bundle has
    no aligner graph (one exported before it), are INVALID_ARGUMENT naming the option."""
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs[:3]]
    tokenizer = OnnxTranslator(tiny_bundle).tokenizer
    options = pb.DecodingOptions(return_attention=True)
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        got = stub.Translate(pb.TranslateRequest(sentences=texts, target_prefix=["le", "", "la"], options=options),
                             timeout=60).translations
        final = list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=texts[1], options=options),
                                          timeout=60))[-1].final
        for text, t in zip(texts, got):
            a = t.attention
            assert list(a.source_tokens) == [tokenizer.piece(i) for i in tokenizer.encode(text)]
            assert len(a.target_tokens) == len(a.rows) == t.output_tokens
            assert tokenizer.decode([tokenizer.sp.piece_to_id(p) for p in a.target_tokens]) == t.text
            assert all(len(r.weights) == len(a.source_tokens) and sum(r.weights) == pytest.approx(1, abs=1e-4)
                       for r in a.rows)
        assert got[0].attention.target_tokens[0] == "▁le" and final.attention == got[1].attention
        with pytest.raises(grpc.RpcError) as e:
            stub.TranslateText(pb.TranslateTextRequest(texts=["The cat sleeps."], options=options), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "options.return_attention" in e.value.details()

    old = tmp_path / "old-bundle"  # as exported before the aligner graph
    shutil.copytree(tiny_bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / manifest.pop("aligner")).unlink()
    del manifest["files"]["aligner.onnx"], manifest["graphs"]["aligner"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    server = ServerThread(ServerConfig.from_flags(bundle=str(old), host="127.0.0.1", port=0, metrics_port=0))
    try:
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            assert stub.Translate(pb.TranslateRequest(sentences=texts[:1]), timeout=60).translations[0].text
            with pytest.raises(grpc.RpcError) as e:
                stub.Translate(pb.TranslateRequest(sentences=texts[:1], options=options), timeout=60)
            html = [stub.TranslateText(pb.TranslateTextRequest(texts=[f"<p>{t}</p>"], mime_type="text/html"), timeout=60)
                    for t in texts[:1]]  # no inline tag: no attention needed
            with pytest.raises(grpc.RpcError) as inline:
                stub.TranslateText(pb.TranslateTextRequest(texts=["<p>The <b>cat</b>.</p>"], mime_type="text/html"),
                                   timeout=60)
    finally:
        server.stop()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"options.return_attention: the bundle {old} has no aligner graph (export it again")
    assert html[0].translations[0].text.startswith("<p>")
    assert inline.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert inline.value.details().startswith("mime_type 'text/html' with inline tags: return_attention: the bundle")
