"""The gRPC service on a real port: equality with OnnxTranslator under concurrency, streaming,
invalid input, overload, deadlines, health and reflection."""

import asyncio
import concurrent.futures
import math
import random
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nmtserve.errors import ConfigError
from nmtserve.export.runtime.engine import EnginePool
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.glossary import Glossary
from nmtserve.server import bridge
from nmtserve.server.app import start_server
from nmtserve.server.config import ServerConfig
from nmtserve.server.convert import InvalidRequest
from nmtserve.server.models import OPTIONS_KEPT, ModelSpec, ServedModel
from nmtserve.training.data import read_tsv
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, run_cli, scrape, wait_engine_idle


@pytest.fixture(scope="module")
def sentences(tiny_corpus):
    return [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]


def test_concurrent_clients_get_the_translator_output(served, tiny_bundle, sentences):
    translator = OnnxTranslator(tiny_bundle, shared_cross=False)  # the server's step
    reference = translator.translate_batch(sentences, max_decoding_length=64)  # the server's limit
    expected = {t: r.text for t, r in zip(sentences, reference)}
    rng = random.Random(0)
    batches = [rng.sample(sentences, rng.randint(1, 4)) for _ in range(64)]  # mixed lengths and sizes

    def call(batch):
        with served.channel() as channel:
            response = pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=batch), timeout=60)
        return [t.text for t in response.translations]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:  # 64 concurrent clients
        results = list(pool.map(call, batches))
    assert results == [[expected[s] for s in batch] for batch in batches]
    assert served.running.engine.stats()["running"] == 0


@pytest.mark.parametrize("variant, kernel", [("fp32", "off"), ("fp32", "on"), ("int8", "on"), ("int8", "off")])
def test_a_server_with_or_without_the_kernels_serves_the_translator_output(tiny_bundle, sentences, variant, kernel):
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                       variant=variant, attention_kernel=kernel, max_decoding_length=64))
    try:
        reference = OnnxTranslator(tiny_bundle, variant=variant, shared_cross=False, attention_kernel=kernel == "on")
        expected = [t.text for t in reference.translate_batch(sentences[:16], max_decoding_length=64)]
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            got = [t.text for t in stub.Translate(pb.TranslateRequest(sentences=sentences[:16]), timeout=60).translations]
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        if variant == "int8" and kernel == "off":
            # ONNX Runtime's one scale per tensor: a sentence's tokens depend on its batch-mates, and the server's
            # batches are not the translator's; most sentences still agree
            assert len(got) == len(expected) and sum(a == b for a, b in zip(got, expected)) >= 12, (got, expected)
        else:
            assert got == expected
        suffix = "_kernels" if kernel == "on" else ""
        assert list(info.graphs) == [f"encoder{suffix}", f"decoder{suffix}"]
        assert info.kernels == ("nmtserve's kernels" if kernel == "on" else "ONNX Runtime's own nodes: nmtserve's kernels "
                                "off as asked")
    finally:
        server.stop()


@pytest.mark.parametrize("flag", ["--attention-kernel", "--io-binding"])
def test_a_bad_kernel_flag_is_one_line_naming_it(tiny_bundle, flag):
    out = run_cli("serve", str(tiny_bundle), "--port", "0", flag, "sometimes")
    assert out.returncode == 2 and f"{flag} 'sometimes': choose auto, on or off" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_server_with_io_binding_serves_the_translator_output(tiny_bundle, sentences):
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                       io_binding="on", max_decoding_length=64))
    try:
        reference = OnnxTranslator(tiny_bundle, shared_cross=False)  # the server's step
        expected = [t.text for t in reference.translate_batch(sentences[:16], max_decoding_length=64)]
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda s: stub.Translate(pb.TranslateRequest(sentences=[s]), timeout=60)
                                    .translations[0].text, sentences[:16]))
        assert got == expected
        assert server.running.engine.tr.io_binding
    finally:
        server.stop()


def test_stream_deltas_join_to_the_final_text(served, sentences):
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        for sentence in sentences[:5]:
            messages = list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=sentence), timeout=30))
            deltas = [m.delta for m in messages[:-1]]
            assert all(m.HasField("delta") for m in messages[:-1]) and messages[-1].HasField("final")
            final = messages[-1].final
            assert "".join(deltas) == final.text
            unary = stub.Translate(pb.TranslateRequest(sentences=[sentence]), timeout=30).translations[0]
            assert final.text == unary.text and final.output_tokens == unary.output_tokens


def test_stream_interval_sends_a_delta_per_interval_of_tokens(tiny_bundle, sentences):
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                       stream_interval=4))
    try:
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            longest = 0
            for sentence in sentences[:8]:
                messages = list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=sentence), timeout=30))
                final, deltas = messages[-1].final, [m.delta for m in messages[:-1]]
                assert "".join(deltas) == final.text
                assert len(deltas) <= final.output_tokens // 4 + 1  # one per 4 tokens, and what is left at the end
                longest = max(longest, final.output_tokens)
            assert longest >= 8  # (a stream long enough that one delta a token would break the bound)
    finally:
        server.stop()
    # (0 running rows used to serve, and every request then waited for its deadline)
    for flag, field in (("--stream-interval", "stream_interval"), ("--max-burst-steps", "max_burst_steps"),
                        ("--max-running-rows", "max_running_rows"), ("--max-waiting", "max_waiting"),
                        ("--max-decoding-length", "max_decoding_length")):
        with pytest.raises(ConfigError, match=f"{flag} 0: must be at least 1"):
            asyncio.run(start_server(ServerConfig.from_flags(bundle=str(tiny_bundle), port=0, metrics_port=-1, **{field: 0})))


@pytest.mark.parametrize("request_, field", [
    (pb.TranslateRequest(), "sentences: 0 given"),
    (pb.TranslateRequest(sentences=["ok"] * 9), "sentences: 9 given, between 1 and 8"),
    (pb.TranslateRequest(sentences=["The cat sleeps.", "  "]), "sentences[1]: empty sentence"),
    (pb.TranslateRequest(sentences=["x" * 301]), "sentences[0]: 301 characters, the limit is 300"),
    (pb.TranslateRequest(sentences=["ok", "\u200b\x07"]), r"sentences[1]: nothing to translate in '\u200b\x07'"),
    (pb.TranslateRequest(sentences=["ok"], options=pb.DecodingOptions(max_decoding_length=65)),
     "options.max_decoding_length 65 exceeds the limit 64"),
])
def test_invalid_requests_name_the_field(served, request_, field):
    with served.channel() as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.TranslationServiceStub(channel).Translate(request_, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_a_models_options_are_converted_once_per_message_and_refused_at_every_call(tiny_bundle):
    """ServedModel.options keeps each distinct message's conversion (the same object for the same bytes, another for
    other options, at most OPTIONS_KEPT of them); an invalid message is refused at every call, never kept."""
    config = ServerConfig.from_flags(bundle=str(tiny_bundle), port=0, metrics_port=-1, max_decoding_length=64)
    engine = EnginePool(OnnxTranslator(tiny_bundle), 1, config.engine)  # not started: options need no engine thread
    model = ServedModel(ModelSpec("m", str(tiny_bundle), "fp32", "cpu", 1), engine, config)
    plain = model.options(pb.DecodingOptions())
    assert model.options(pb.DecodingOptions()) is plain and plain[1] == model.defaults
    beam = model.options(pb.DecodingOptions(beam_size=4, max_decoding_length=9))
    assert beam == (9, model.defaults.override(beam_size=4))
    assert model.options(pb.DecodingOptions(max_decoding_length=9, beam_size=4)) is beam
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="options.max_decoding_length 65 exceeds the limit 64"):
            model.options(pb.DecodingOptions(max_decoding_length=65))
    seeds = [model.options(pb.DecodingOptions(seed=seed))[1].seed for seed in range(1, OPTIONS_KEPT + 2)]
    assert seeds == list(range(1, OPTIONS_KEPT + 2)) and len(model._options) <= OPTIONS_KEPT


def test_scores_timings_and_finish_reasons(served, sentences):
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        options = pb.DecodingOptions(max_decoding_length=2, return_scores=True)
        t = stub.Translate(pb.TranslateRequest(sentences=sentences[:1], options=options), timeout=10).translations[0]
        assert t.finish_reason == pb.FINISH_REASON_LENGTH and t.output_tokens == 2 and t.score < 0
        assert 0 < t.timings.time_to_first_token_ns <= t.timings.total_ns
        # the handler's time holds validation and tokenization (prepare) and the sentence's time in the engine
        assert 0 < t.timings.prepare_ns and t.timings.prepare_ns + t.timings.total_ns <= t.timings.handler_ns
        # in order: queued, encoded, first token; the handler resumes after decoding, before the Translation
        assert t.timings.queue_ns < t.timings.encoded_ns < t.timings.time_to_first_token_ns
        assert t.timings.prepare_ns + t.timings.total_ns <= t.timings.resumed_ns <= t.timings.handler_ns
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.limits.max_sentences == 8 and info.variant == "fp32" and len(info.bundle_id) == 64
        # the built-in corpus's corpus.json names its languages; the export carries them into the manifest
        assert (info.source_language, info.target_language) == ("en", "fr")


def test_confidence_is_the_mean_log_prob_of_the_decoded_tokens_as_offline(served, tiny_bundle, sentences):
    """return_scores fills mean_log_prob (the score over the tokens decoded, eos counted when said) and confidence
    (its exp) for greedy and for each hypothesis of a beam's n-best list (length_penalty 0: scores are sums); the
    same as OnnxTranslator's offline. Without return_scores both are 0."""
    translator = OnnxTranslator(tiny_bundle, shared_cross=False)
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        for options in (pb.DecodingOptions(return_scores=True),
                        pb.DecodingOptions(return_scores=True, beam_size=2, num_hypotheses=2, length_penalty=0)):
            found = stub.Translate(pb.TranslateRequest(sentences=sentences[:4], options=options), timeout=30)
            offline = translator.translate_batch(sentences[:4], beam_size=options.beam_size or 1,
                                                 num_hypotheses=options.num_hypotheses or 1, length_penalty=0,
                                                 max_decoding_length=64, return_scores=True)
            for t, o in zip(found.translations, offline):
                eos = t.finish_reason == pb.FINISH_REASON_EOS
                for h in [t, *t.alternatives]:
                    assert h.mean_log_prob == pytest.approx(h.score / (h.output_tokens + eos), rel=1e-5)
                    assert h.confidence == pytest.approx(math.exp(h.mean_log_prob), rel=1e-5) and 0 < h.confidence <= 1
                assert len(t.alternatives) == (options.num_hypotheses or 1) - 1
                assert t.confidence == pytest.approx(o.confidence, rel=1e-5)
        plain = stub.Translate(pb.TranslateRequest(sentences=sentences[:1]), timeout=30).translations[0]
        assert plain.mean_log_prob == plain.confidence == plain.score == 0


def test_a_glossary_call_shares_the_batch_and_gets_the_offline_translations(served, tiny_bundle, sentences):
    """TranslateRequest.glossary: each sentence with a source term decodes by constrained beam search beside plain
    calls in the running batch; the translations are OnnxTranslator's with the same glossary, and contain the terms.
    A bad glossary, and a sentence whose terms need a beam over --max-beam-size, are INVALID_ARGUMENT naming them."""
    entries = [("cat", "chat"), ("dog", "chien"), ("horse", "cheval"), ("bird", "oiseau"), ("house", "maison")]
    chosen = sentences[:8]
    offline = OnnxTranslator(tiny_bundle, shared_cross=False).translate_batch(chosen, glossary=entries,
                                                                               max_decoding_length=64)
    plain = OnnxTranslator(tiny_bundle, shared_cross=False).translate_batch(chosen, max_decoding_length=64)
    glossary = [pb.GlossaryEntry(source=a, target=b) for a, b in entries]
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(stub.Translate, pb.TranslateRequest(sentences=chosen, glossary=glossary if i % 2 else []),
                                 timeout=60) for i in range(4)]
            found = [[t.text for t in c.result().translations] for c in calls]
        assert found == [[t.text for t in plain], [t.text for t in offline]] * 2 and found[0] != found[1]
        terms = [Glossary(entries).targets_for(s) for s in chosen]
        assert any(terms) and all(term in text for text, wanted in zip(found[1], terms) for term in wanted)
        stream = list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=chosen[0], glossary=glossary), timeout=60))
        assert stream[-1].final.text == offline[0].text
        for request_, field in [
            (pb.TranslateRequest(sentences=["a cat"], glossary=[pb.GlossaryEntry(source="cat", target="")]),
             "glossary[0]: source 'cat' and target '' must both be non-empty"),
            (pb.TranslateRequest(sentences=["ok", "a cat and a dog"],
                                 glossary=[pb.GlossaryEntry(source="cat", target="un très long chat noir"),
                                           pb.GlossaryEntry(source="dog", target="un grand chien blanc")]),
             "glossary: sentences[1]'s terms: beam_size"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Translate(request_, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), \
                err.value.details()


def test_health_and_reflection(served):
    with served.channel() as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="nmtserve.v1.TranslationService"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"nmtserve.v1.TranslationService", "grpc.health.v1.Health"} <= names


def test_deadline_exceeded_frees_the_rows(served, sentences):
    """A call whose deadline passes while its sentences are in the engine ends DEADLINE_EXCEEDED, and the engine
    drops them (counted as finished by deadline or cancellation in /metrics: they did reach it) and frees their
    rows. Deadlines from 1 ms up, until one lands while the sentences are in the engine."""
    def dropped() -> float:
        return sum(s.value for s in scrape(served.running.metrics_port) if s.name == "nmtserve_cancelled_sentences_total")

    engine, reached = served.running.engine, 0.0
    for timeout in (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.012):
        before = dropped()
        with served.channel() as channel, pytest.raises(grpc.RpcError) as err:
            pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(
                sentences=sentences[:8], options=pb.DecodingOptions(beam_size=4, max_decoding_length=64)), timeout=timeout)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_engine_idle(engine, 30), "the engine still held rows 30 s after the call's deadline"
        assert engine.stats() == {**engine.stats(), "running": 0, "waiting": 0}
        reached = dropped() - before
        if reached:
            break
    assert reached > 0, f"no deadline up to {timeout} s landed while the call's sentences were in the engine"


def test_overload_is_refused_with_resource_exhausted(tiny_bundle, sentences):
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=0,
                                       max_running_rows=1, max_waiting=1))
    clients = 16
    ready = threading.Barrier(clients)  # connect first, then call together: 16 calls overlap on any machine

    def call(sentence):
        with server.channel() as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            ready.wait(timeout=60)
            try:
                pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=[sentence]), timeout=60)
                return "OK"
            except grpc.RpcError as e:
                return e.code().name
    try:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            codes = list(pool.map(call, sentences[:clients]))
        assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    finally:
        server.stop()


def test_requests_at_every_limit_over_grpc_end_with_length_alone_and_in_a_busy_batch(eosless_bundle, sentences):
    """The longest source the server accepts and the largest max_decoding_length, with a model that never
    says eos (eosless_bundle): LENGTH at the full budget, never an error, alone and while unary calls and
    streams share the batch; one token more is refused."""
    server = ServerThread(ServerConfig.from_flags(bundle=str(eosless_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                       max_sentence_chars=100_000, max_decoding_length=10_000))
    try:
        translator = server.running.engine.tr
        limits = translator.limits
        words, longest = " ".join(sentences).split(), ""
        for n in range(1, len(words)):  # the most words that stay within the source limit
            text = " ".join(words[:n])
            if len(translator.tokenizer.encode(text)) > limits.max_source_tokens:
                too_long = text
                break
            longest = text
        assert len(translator.tokenizer.encode(longest)) >= limits.max_source_tokens - 8  # one word short at most
        largest = pb.DecodingOptions(max_decoding_length=limits.max_target_tokens)  # the limit the server tells
        budget = limits.output_budget(len(translator.tokenizer.encode(longest)), limits.max_target_tokens)
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            for mates in (0, 8):
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    busy = [pool.submit(stub.Translate, pb.TranslateRequest(sentences=sentences[i:i + 2], options=largest),
                                        timeout=120) for i in range(0, mates, 2)]
                    busy += [pool.submit(lambda s: list(stub.TranslateStream(pb.TranslateStreamRequest(
                        sentence=s, options=largest), timeout=120)), s) for s in sentences[:mates // 2]]
                    at_limit = stub.Translate(pb.TranslateRequest(sentences=[longest], options=largest),
                                              timeout=120).translations[0]
                    others = [f.result() for f in busy]
                assert at_limit.finish_reason == pb.FINISH_REASON_LENGTH and at_limit.output_tokens == budget
                finals = [t for r in others for t in (r.translations if hasattr(r, "translations") else [r[-1].final])]
                assert len(finals) == 3 * mates // 2
                assert all(t.finish_reason == pb.FINISH_REASON_LENGTH for t in finals)
            assert stub.GetModelInfo(pb.GetModelInfoRequest()).limits.max_decoding_length == limits.max_target_tokens
            for request, message in [
                    (pb.TranslateRequest(sentences=[too_long]), f"tokens, the limit is {limits.max_source_tokens}"),
                    (pb.TranslateRequest(sentences=["ok"], options=pb.DecodingOptions(
                        max_decoding_length=limits.max_target_tokens + 1)), f"the limit {limits.max_target_tokens}")]:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Translate(request, timeout=60)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().endswith(message)
    finally:
        server.stop()


def test_engine_threads_wake_the_event_loop_once_for_calls_made_together(monkeypatch):
    """Wakeups: calls from other threads all run on the loop, each thread's in its order, none lost, with
    fewer wake-ups of the loop than calls (one write to its self-pipe per call cost the engine thread
    ~0.24 ms each at saturation)."""

    async def main():
        loop = asyncio.get_running_loop()
        wakeups, ran, woken = bridge.Wakeups(loop), [], [0]
        real = bridge._write

        def counted(fd, hold_gil):
            woken[0] += 1
            return real(fd, hold_gil)
        monkeypatch.setattr(bridge, "_write", counted)

        def producer(name):
            for i in range(2000):
                wakeups.call(lambda i=i: ran.append((name, i, threading.current_thread() is threading.main_thread())),
                             busy=name == "a")  # one thread's wake-ups written holding the GIL, the other's letting it go
        threads = [threading.Thread(target=producer, args=(name,)) for name in "ab"]
        for t in threads:
            t.start()
        deadline = loop.time() + 20  # a lost wake-up leaves calls unrun: the asserts below say so
        while (any(t.is_alive() for t in threads) or len(ran) < 4000) and loop.time() < deadline:
            await asyncio.sleep(0.001)
        for t in threads:
            t.join()
        wakeups.close()
        return ran, woken[0]
    ran, woken = asyncio.run(main())
    assert len(ran) == 4000 and all(on_loop for _, _, on_loop in ran)
    for name in "ab":
        assert [i for n, i, _ in ran if n == name] == list(range(2000))
    assert 1 <= woken < 4000
