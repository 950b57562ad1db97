"""A multilingual NLLB bundle served over gRPC: one model for every pair of its languages. ListModels and
GetModelInfo list its source and target languages; each call names its pair, calls of different pairs and
decoding modes share the engine's running batch, and each translation equals OnnxTranslator's offline one (which
tests/export/test_model_families.py holds equal to transformers' generate). A language the model does not know is
INVALID_ARGUMENT naming it."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from nmtserve.export.build.exporter import ExportConfig, export_bundle
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.language_codes import NLLB
from nmtserve.loadtests.marian_model import ENGLISH, FRENCH, sentences
from nmtserve.server.config import ServerConfig
from nmtserve.training.m2m100 import import_m2m100
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread


@pytest.fixture(scope="module")
def nllb(nllb_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nllb-served")
    import_m2m100(nllb_dir, tmp / "model.pt")
    export_bundle(ExportConfig(str(tmp / "model.pt"), str(tmp / "bundle"), ["fp32"]))
    server = ServerThread(ServerConfig.from_flags(bundle=str(tmp / "bundle"), host="127.0.0.1", port=0, metrics_port=0))
    yield tmp / "bundle", server
    server.stop()


def test_model_info_lists_every_language(nllb):
    _, server = nllb
    with server.channel() as channel:
        info = pb_grpc.TranslationServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).models[0]
    assert sorted(info.source_languages) == sorted(info.target_languages) == sorted(NLLB)
    assert (info.source_language, info.target_language) == ("eng_Latn", "fra_Latn")  # tokenizer_config.json's


def test_calls_of_different_pairs_and_modes_at_once_equal_offline(nllb):
    bundle, server = nllb
    offline = OnnxTranslator(bundle, shared_cross=False)  # the server's step
    calls = [("eng_Latn", "fra_Latn", 1, sentences(ENGLISH, 6, 1)), ("fra_Latn", "eng_Latn", 4, sentences(FRENCH, 6, 2)),
             ("eng_Latn", "deu_Latn", 1, sentences(ENGLISH, 6, 3)), ("", "", 4, sentences(ENGLISH, 6, 4))]
    with server.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)

        def translate(call):
            source, target, beams, texts = call
            return stub.Translate(pb.TranslateRequest(sentences=texts, source_language=source, target_language=target,
                                                      options=pb.DecodingOptions(beam_size=beams)), timeout=60)
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            answers = list(pool.map(translate, calls))
        streamed = "".join(e.delta for e in stub.TranslateStream(pb.TranslateStreamRequest(
            sentence=calls[1][3][0], source_language="fra_Latn", target_language="eng_Latn"), timeout=60))
    defaults = offline.bundle.manifest["decoding_defaults"]
    for (source, target, beams, texts), answer in zip(calls, answers):
        expected = offline.translate_batch(texts, **{**defaults, "beam_size": beams}, source_language=source,
                                           target_language=target)
        assert [t.text for t in answer.translations] == [t.text for t in expected], (source, target, beams)
    assert len({t.text for a in answers for t in a.translations}) > 6  # the pairs translate differently
    first = offline.translate_batch(calls[1][3][:1], **defaults, source_language="fra_Latn", target_language="eng_Latn")
    assert streamed == first[0].text


@pytest.mark.parametrize("field, value", [("target_language", "xxx_Latn"), ("source_language", "en")])
def test_a_language_the_model_does_not_know_is_invalid_argument_naming_it(nllb, field, value):
    _, server = nllb
    with server.channel() as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=["The cat."], **{field: value}),
                                                          timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field} {value!r}: ") and "202 languages" in refused.value.details()


def test_source_language_auto_detects_among_the_models_languages(nllb):
    """source_language "auto": the language detected (py3langid) among the model's, in the response; the
    translation equals the one of a call that names that language."""
    _, server = nllb
    english, french = sentences(ENGLISH, 3, 5), sentences(FRENCH, 3, 6)
    with server.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        for texts, language in ((english, "eng_Latn"), (french, "fra_Latn")):
            auto = stub.Translate(pb.TranslateRequest(sentences=texts, source_language="auto",
                                                      target_language="deu_Latn"), timeout=60)
            named = stub.Translate(pb.TranslateRequest(sentences=texts, source_language=language,
                                                       target_language="deu_Latn"), timeout=60)
            assert auto.detected_language.language == language and 0.5 < auto.detected_language.confidence <= 1
            assert [t.text for t in auto.translations] == [t.text for t in named.translations]
            assert not named.HasField("detected_language")
        text = stub.TranslateText(pb.TranslateTextRequest(texts=[" ".join(french)], source_language="auto",
                                                          target_language="eng_Latn"), timeout=60)
        first = next(iter(stub.TranslateTextStream(pb.TranslateTextStreamRequest(
            text=" ".join(french), source_language="auto", target_language="eng_Latn"), timeout=60)))
        final = list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=french[0], source_language="auto",
                                                                    target_language="eng_Latn"), timeout=60))[-1]
    assert text.detected_language.language == first.detected_language.language == "fra_Latn"
    assert final.detected_language.language == "fra_Latn" and final.HasField("final")
