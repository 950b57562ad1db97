"""Several models behind one server: the tiny en→fr bundle trained here and a tiny random
Marian model imported as fr→en (its SentencePiece models learnt French sources and English targets),
each with its own engine. Routing by model or language pair, ListModels, per-model GetModelInfo and
health, the --models file, and one model's flood never holding up the other's requests."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.loadtests.marian_model import ENGLISH, FRENCH, sentences
from nmtserve.server.config import ServerConfig
from nmtserve.server.models import model_specs
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, metric, run_cli, scrape

SERVICE = "nmtserve.v1.TranslationService"


@pytest.fixture(scope="module")
def two_models(tiny_bundle, fr_en_bundle):
    server = ServerThread(ServerConfig.from_flags(bundle=f"{tiny_bundle},{fr_en_bundle}", host="127.0.0.1", port=0,
                                       metrics_port=0, max_decoding_length=64))
    yield server
    server.stop()


def _alone(bundle, text: str, options: DecodingOptions) -> str:
    tr = OnnxTranslator(bundle, shared_cross=False)  # the server's step
    return tr.tokenizer.decode(tr.search_ids([tr.tokenizer.encode(text)], options)[0][0].tokens)


def test_list_models_and_model_info_describe_each_model(two_models, tiny_bundle, fr_en_bundle):
    with two_models.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        listed = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
        assert [(m.model, m.source_language, m.target_language) for m in listed] == [("en-fr", "en", "fr"),
                                                                                      ("fr-en", "fr", "en")]
        assert [m.default_options.beam_size for m in listed] == [1, 4]  # ours greedy; Marian's num_beams
        assert all(m.variant == "fp32" and m.device == "cpu" and m.limits.max_decoding_length == 64 for m in listed)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(model="fr-en"), timeout=30) == listed[1]
        for model, code, message in (
                ("", grpc.StatusCode.INVALID_ARGUMENT, "model '': required; this server serves en-fr, fr-en"),
                ("de-en", grpc.StatusCode.NOT_FOUND, "model 'de-en': not served here; this server serves en-fr, fr-en")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetModelInfo(pb.GetModelInfoRequest(model=model), timeout=30)
            assert refused.value.code() == code
            assert refused.value.details() == message


def test_requests_reach_the_model_they_name_or_whose_languages_match(two_models, tiny_bundle, fr_en_bundle):
    english, french = sentences(ENGLISH, 1, 11)[0], sentences(FRENCH, 1, 12)[0]
    greedy = pb.DecodingOptions(beam_size=1, max_decoding_length=20)
    expected_fr = _alone(tiny_bundle, "the cat sees the dog", DecodingOptions(max_decoding_length=20))
    expected_en = _alone(fr_en_bundle, french, DecodingOptions(max_decoding_length=20))
    with two_models.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        for route in (dict(model="en-fr"), dict(target_language="fr"), dict(source_language="en"),
                      dict(source_language="en", target_language="fr")):
            got = stub.Translate(pb.TranslateRequest(sentences=["the cat sees the dog"], options=greedy, **route),
                                 timeout=30)
            assert got.translations[0].text == expected_fr, route
        for route in (dict(model="fr-en"), dict(target_language="en"), dict(source_language="fr", target_language="en")):
            got = stub.Translate(pb.TranslateRequest(sentences=[french], options=greedy, **route), timeout=30)
            assert got.translations[0].text == expected_en, route
        streamed = list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=french, options=greedy, model="fr-en"),
                                             timeout=30))
        assert streamed[-1].final.text == expected_en == "".join(m.delta for m in streamed[:-1])
        served = "en-fr (en→fr); fr-en (fr→en)"
        invalid, not_found = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
        for route, code, message in (
                (dict(), invalid, f"model: not given, and this server serves several: {served}; name one, or give "
                                  "source_language and target_language"),
                (dict(model="de-en"), not_found, f"model 'de-en': not served here; this server serves {served}"),
                (dict(source_language="de", target_language="fr"), not_found,
                 f"source_language 'de', target_language 'fr': no model serves this pair; this server serves {served}"),
                (dict(model="fr-en", source_language="en"), invalid, "source_language 'en': model fr-en translates from fr"),
                (dict(model="fr-en", target_language="fr"), invalid,
                 "target_language 'fr': model fr-en translates into en")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Translate(pb.TranslateRequest(sentences=[english], **route), timeout=30)
            assert refused.value.code() == code, route
            assert refused.value.details() == message


def test_health_reports_each_model_and_the_server(two_models):
    with two_models.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE, f"{SERVICE}/en-fr", f"{SERVICE}/fr-en"):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service=f"{SERVICE}/de-en"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_count_each_model_apart(two_models):
    """Every request series carries the model it counts; a call that names no served model counts under
    model="" (the label's values stay bounded by the models served)."""
    port = two_models.running.metrics_port
    greedy = pb.DecodingOptions(beam_size=1, max_decoding_length=20)
    before = scrape(port)
    with two_models.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        en_fr = stub.Translate(pb.TranslateRequest(sentences=["the cat sees the dog"] * 2, options=greedy,
                                                   model="en-fr"), timeout=30).translations
        fr_en = stub.Translate(pb.TranslateRequest(sentences=sentences(FRENCH, 1, 14), options=greedy, model="fr-en"),
                               timeout=30).translations
        text = stub.TranslateText(pb.TranslateTextRequest(texts=[" ".join(sentences(FRENCH, 3, 15))], options=greedy,
                                                          model="fr-en"), timeout=60).translations[0]
        with pytest.raises(grpc.RpcError):
            stub.Translate(pb.TranslateRequest(sentences=["x"], model="de-en"), timeout=30)
    after = scrape(port)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert text.sentences == 3
    assert delta("nmtserve_requests_total", model="en-fr", rpc="Translate", code="OK") == 1
    assert delta("nmtserve_requests_total", model="fr-en", rpc="Translate", code="OK") == 1
    assert delta("nmtserve_requests_total", model="fr-en", rpc="TranslateText", code="OK") == 1
    assert delta("nmtserve_sentences_total", model="en-fr") == 2
    assert delta("nmtserve_sentences_total", model="fr-en") == 4
    assert delta("nmtserve_request_duration_seconds_count", model="fr-en", rpc="TranslateText") == 3
    assert delta("nmtserve_output_tokens_total", model="en-fr") == sum(t.output_tokens for t in en_fr)
    assert delta("nmtserve_output_tokens_total", model="fr-en") == fr_en[0].output_tokens + text.output_tokens
    assert delta("nmtserve_input_tokens_total", model="fr-en") == fr_en[0].input_tokens + text.input_tokens
    assert delta("nmtserve_step_rows_count", model="en-fr") > 0 and delta("nmtserve_step_rows_count", model="fr-en") > 0
    assert delta("nmtserve_rejected_requests_total", model="", code="NOT_FOUND") == 1
    assert delta("nmtserve_requests_total", model="", rpc="Translate", code="NOT_FOUND") == 1
    assert {s.labels["model"] for s in after if "model" in s.labels} == {"", "en-fr", "fr-en"}
    assert {s.labels["model"] for s in after if s.name == "nmtserve_requests_running"} == {"en-fr", "fr-en"}


def test_a_flood_on_one_model_does_not_hold_up_the_other(two_models, fr_en_bundle):
    """While en-fr has more requests than its batch holds (some wait), fr-en's requests are translated
    one after another, each exactly as alone: each model's engine runs its own steps. The flood's clients
    send again as soon as they are answered, until fr-en's requests are done (at most 200 requests each),
    so en-fr is busy throughout however fast either model runs: its engine steps while each fr-en request
    runs. (Its batch may be empty for an instant: the flood's identical sentences finish at the same step.)"""
    flood_engine = two_models.running.models["en-fr"].engine
    french = sentences(FRENCH, 6, 13)
    expected = [_alone(fr_en_bundle, s, DecodingOptions(max_decoding_length=20)) for s in french]
    flood_request = pb.TranslateRequest(sentences=["the cat sees the dog"] * 8, model="en-fr",
                                        options=pb.DecodingOptions(beam_size=1, max_decoding_length=64))
    done = threading.Event()

    def flood_client(stub) -> int:
        answered = 0
        while not done.is_set() and answered < 200:
            assert len(stub.Translate(flood_request, timeout=120).translations) == 8
            answered += 1
        return answered

    flood_busy: list[bool] = []
    with two_models.channel() as channel, ThreadPoolExecutor(12) as pool:
        stub = pb_grpc.TranslationServiceStub(channel)
        flood = [pool.submit(flood_client, stub) for _ in range(12)]  # 96 rows against the engine's 64
        try:
            deadline = time.monotonic() + 60
            while flood_engine.stats()["waiting"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            for text, want in zip(french, expected):
                steps = flood_engine.stats()["steps"]
                got = stub.Translate(pb.TranslateRequest(sentences=[text], model="fr-en", options=pb.DecodingOptions(
                    beam_size=1, max_decoding_length=20)), timeout=60).translations[0]
                assert got.text == want
                stats = flood_engine.stats()
                flood_busy.append(stats["steps"] > steps or stats["running"] + stats["waiting"] > 0)
        finally:
            done.set()
        answered = [f.result() for f in flood]
    assert all(n < 200 for n in answered), f"the flood ran out before fr-en's requests were done: {answered}"
    assert all(flood_busy), flood_busy


def test_the_models_file_names_ids_and_settings(tiny_bundle, fr_en_bundle, tmp_path):
    models = tmp_path / "models.toml"
    models.write_text(f'[[models]]\nbundle = "{tiny_bundle}"\nid = "ours"\nvariant = "int8"\n\n'
                      f'[[models]]\nbundle = "{fr_en_bundle}"\nthreads = 1\ninter_threads = 2\n', encoding="utf-8")
    specs = model_specs(ServerConfig.from_flags(models=str(models)))
    assert [(s.id, s.variant, s.threads, s.inter_threads) for s in specs] == [("ours", "int8", 2, 1), ("fr-en", "fp32", 1, 2)]
    server = ServerThread(ServerConfig.from_flags(models=str(models), host="127.0.0.1", port=0, metrics_port=0))
    try:
        with server.channel() as channel:
            listed = pb_grpc.TranslationServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).models
        assert [(m.model, m.variant) for m in listed] == [("ours", "int8"), ("fr-en", "fp32")]
        assert [len(m.engine.engines) for m in server.running.models.values()] == [1, 2]
    finally:
        server.stop()
    bad = tmp_path / "bad.toml"
    for text, message in ((f'[[models]]\nbundle = "{tiny_bundle}"\nvariants = "int8"\n',
                           f"--models {bad}: models[0]: unknown key 'variants'; keys are bundle, id, variant, device, "
                           "threads, inter_threads, glossary"),
                          ('[[models]]\nid = "x"\n', f"--models {bad}: models[0]: bundle is required"),
                          (f'[[models]]\nbundle = "{tiny_bundle}"\nthreads = "two"\n',
                           f"--models {bad}: models[0].threads = 'two': expected an integer"),
                          (f'[[models]]\nbundle = "{tiny_bundle}"\nid = "x"\ninter_threads = 0\n',
                           "inter_threads 0 for model 'x' (--inter-threads, or its models file): must be at least 1"),
                          (f'[[models]]\nbundle = "{tiny_bundle}"\nid = "x"\ndevice = "cuda"\ninter_threads = 2\n',
                           "model 'x': inter_threads 2 on cuda: one decoding context per model on a GPU (two at once "
                           "gave wrong tokens there; one running batch fills the GPU): use inter_threads 1 "
                           "(--inter-threads, or its models file)")):
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError) as refused:
            model_specs(ServerConfig.from_flags(models=str(bad)))
        assert str(refused.value) == message
    with pytest.raises(ConfigError, match="model id 'en-fr' names both"):
        model_specs(ServerConfig.from_flags(bundle=f"{tiny_bundle},{tiny_bundle}"))
    # no variant named: each model's device decides (fp16 is the only one cuda takes); a named one stays
    models.write_text(f'[[models]]\nbundle = "{tiny_bundle}"\ndevice = "cuda"\n\n[[models]]\nbundle = "{fr_en_bundle}"\n'
                      f'[[models]]\nbundle = "{fr_en_bundle}"\nid = "named"\nvariant = "int8"\n', encoding="utf-8")
    assert [(s.device, s.variant) for s in model_specs(ServerConfig.from_flags(models=str(models)))] == [
        ("cuda", "fp16"), ("cpu", "fp32"), ("cpu", "int8")]
    result = run_cli("serve", "--models", str(bad), "--port", "0", timeout=120)
    assert result.returncode == 2 and result.stderr.strip().endswith(message), result.stderr  # the last bad file
    result = run_cli("serve", str(tiny_bundle), "--models", str(models), "--port", "0", timeout=120)
    assert result.returncode == 2 and "give bundle directories or --models FILE, not both" in result.stderr


def test_a_models_glossary_serves_the_calls_that_give_none(tiny_bundle, tmp_path):
    """models.toml's glossary (a TSV file): a call without a glossary gets the model's terms, one with a glossary
    its own instead; a bad file stops the server at start, naming the file and line."""
    terms = tmp_path / "terms.tsv"
    terms.write_text("# en\tfr\ncat\tchien\n\nbird\toiseau\n", encoding="utf-8")
    models = tmp_path / "models.toml"
    models.write_text(f'[[models]]\nbundle = "{tiny_bundle}"\nglossary = "{terms}"\n', encoding="utf-8")
    sentence = "the cat sees a bird ."
    translator = OnnxTranslator(tiny_bundle, shared_cross=False)
    expected = [t.text for t in (translator.translate_batch([sentence], glossary=g, max_decoding_length=64)[0]
                                 for g in ([("cat", "chien"), ("bird", "oiseau")], [("cat", "chat")]))]
    server = ServerThread(ServerConfig.from_flags(models=str(models), host="127.0.0.1", port=0, metrics_port=-1,
                                                  max_decoding_length=64))
    try:
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            found = [stub.Translate(pb.TranslateRequest(sentences=[sentence], glossary=glossary), timeout=60)
                     .translations[0].text for glossary in ([], [pb.GlossaryEntry(source="cat", target="chat")])]
    finally:
        server.stop()
    assert found == expected and expected[0] != expected[1] and "chien" in found[0] and "oiseau" in found[0]
    for text, message in (("cat\tchien\nbird oiseau\n", f"glossary {terms}, line 2: expected a source term, a tab and "
                                                         "a target term; got 'bird oiseau'"),
                          ("cat\tchien\n\nCat\tfélin\n", f"glossary {terms}, line 3: source term 'Cat' is also "
                                                            f"glossary {terms}, line 1's")):
        terms.write_text(text, encoding="utf-8")
        result = run_cli("serve", "--models", str(models), "--port", "0", timeout=120)
        assert result.returncode == 2 and result.stderr.strip().endswith(message), result.stderr


def test_translate_cli_names_the_model_or_the_target_language(two_models, fr_en_bundle):
    french = sentences(FRENCH, 1, 14)[0]
    expected = _alone(fr_en_bundle, french, DecodingOptions(max_decoding_length=20))
    for route in (["--model", "fr-en"], ["--target-lang", "en"], ["--source-lang", "fr"]):
        out = run_cli("translate", "--server", two_models.target, *route, "--beam-size", "1", "--max-decoding-length", "20",
                      french, timeout=120)
        assert out.returncode == 0 and out.stdout == expected + "\n", (route, out.stderr)
    out = run_cli("translate", "--server", two_models.target, "--model", "de-en", french, timeout=120)
    assert out.returncode != 0 and "model 'de-en': not served here; this server serves" in out.stderr
