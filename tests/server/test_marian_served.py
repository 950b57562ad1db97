"""An imported Marian bundle served over gRPC: the model's generation defaults
(beam 4, transformers' stopping) apply to requests that leave the options unset, GetModelInfo tells
them and the languages, and the translations are transformers' generate's."""

from __future__ import annotations

import grpc
import pytest
import torch

from nmtserve.decoding import DecodingOptions
from nmtserve.export.build.exporter import ExportConfig, export_bundle
from nmtserve.loadtests.marian_model import ENGLISH, sentences
from nmtserve.server.config import ServerConfig
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread


@pytest.fixture(scope="module")
def marian_served(marian_bundle):
    server = ServerThread(ServerConfig.from_flags(bundle=str(marian_bundle), host="127.0.0.1", port=0, metrics_port=0))
    yield server
    server.stop()


@pytest.mark.parametrize("marian_dir", ["swish"], indirect=True)  # one configuration is enough over gRPC
def test_defaults_languages_and_translations_follow_the_marian_model(marian_dir, marian_served):
    from transformers import MarianMTModel
    from transformers import MarianTokenizer as HFTokenizer

    hf_tok = HFTokenizer(str(marian_dir / "source.spm"), str(marian_dir / "target.spm"), str(marian_dir / "vocab.json"))
    model = MarianMTModel.from_pretrained(marian_dir, dtype=torch.float32).eval()
    texts = sentences(ENGLISH, 12, 21)
    with marian_served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert (info.source_language, info.target_language) == ("en", "fr")
        d = info.default_options
        assert (d.beam_size, d.length_penalty, d.beam_stopping, d.max_decoding_length, d.length_rule) == \
            (4, 1.0, pb.BEAM_STOPPING_TRANSFORMERS, 39, pb.LENGTH_RULE_NMTSERVE)

        def translate(**options):
            return stub.Translate(pb.TranslateRequest(sentences=texts, options=pb.DecodingOptions(**options)),
                                  timeout=60).translations

        got = {(beams, rule): translate(beam_size=beams, length_rule=rule) for beams in (0, 1)  # 0: the default, 4
               for rule in (pb.LENGTH_RULE_UNSPECIFIED, pb.LENGTH_RULE_TRANSFORMERS)}
    for i, text in enumerate(texts):
        src = hf_tok(text, return_tensors="pt")
        limits = {pb.LENGTH_RULE_UNSPECIFIED: dict(max_new_tokens=min(39, 2 * src["input_ids"].shape[1] + 10),
                                                   forced_eos_token_id=None),
                  pb.LENGTH_RULE_TRANSFORMERS: dict(max_length=40, forced_eos_token_id=model.config.eos_token_id)}
        for (beams, rule), translations in got.items():
            expected = model.generate(**src, num_beams=beams or 4, **limits[rule])
            assert translations[i].text == hf_tok.decode(expected[0], skip_special_tokens=True,
                                                         use_source_tokenizer=False), (beams, rule)


@pytest.mark.parametrize("marian_dir", ["swish"], indirect=True)
def test_target_language_must_be_the_models(marian_served, marian_bundle):
    """Naming the model's own target language translates as OnnxTranslator does with the model's defaults (the
    server's step, beam 4 and transformers' stopping from generation_config.json); another one is refused."""
    from nmtserve.export.runtime.translator import OnnxTranslator

    reference = OnnxTranslator(marian_bundle, shared_cross=False)
    defaults = reference.bundle.manifest["decoding_defaults"]
    expected = reference.translate_batch(["The cat."], **defaults)[0].text
    with marian_served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        named = stub.Translate(pb.TranslateRequest(sentences=["The cat."], target_language="fr"), timeout=30)
        assert [t.text for t in named.translations] == [expected]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Translate(pb.TranslateRequest(sentences=["The cat."], target_language="de"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "target_language 'de': model en-fr translates into fr"


def test_a_multilingual_model_reads_the_requests_language_token(tmp_path):
    from nmtserve.export.runtime.translator import OnnxTranslator
    from nmtserve.loadtests.marian_model import build_marian_dir
    from nmtserve.training.marian import import_marian

    directory = build_marian_dir(tmp_path / "multi", languages=("de", "fr"))
    import_marian(directory, tmp_path / "multi.pt", "en", "de")
    export_bundle(ExportConfig(str(tmp_path / "multi.pt"), str(tmp_path / "bundle"), ["fp32"]))
    tr = OnnxTranslator(tmp_path / "bundle", shared_cross=False)  # the server's step
    server = ServerThread(ServerConfig.from_flags(bundle=str(tmp_path / "bundle"), host="127.0.0.1", port=0, metrics_port=0))
    try:
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            assert list(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).target_languages) == ["de", "fr"]
            greedy = pb.DecodingOptions(beam_size=1)
            for language in ("de", "fr", ""):  # "" is the bundle's target language, de
                got = stub.Translate(pb.TranslateRequest(sentences=["The cat sees the dog."], target_language=language,
                                                         options=greedy), timeout=30).translations[0]
                ids = tr.tokenizer.encode("The cat sees the dog.", target_language=language or "de")
                assert ids[0] == tr.tokenizer.vocab[f">>{language or 'de'}<<"] and got.input_tokens == len(ids)
                assert got.text == tr.tokenizer.decode(tr.search_ids([ids], DecodingOptions())[0][0].tokens)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Translate(pb.TranslateRequest(sentences=["The cat."], target_language="es"), timeout=30)
            assert refused.value.details() == "target_language 'es': model en-de translates into de, fr"
    finally:
        server.stop()
