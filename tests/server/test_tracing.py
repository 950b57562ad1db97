"""--tracing: each call's span under its RPC's server span (the client's trace, from its traceparent), and each
sentence's queue, encode and decode spans inside it, read from OpenTelemetry's in-memory exporter."""

import pytest
import requests
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from nmtserve.errors import ConfigError
from nmtserve.server.config import ServerConfig
from nmtserve.server.tracing import start_tracing
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def traced(tiny_bundle):
    exporter = InMemorySpanExporter()
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  http_port=0, tracing="otlp", max_decoding_length=16),
                          span_exporter=exporter)
    yield server, exporter
    server.stop()


def test_a_grpc_call_is_a_span_in_the_clients_trace_with_its_sentences_stages(traced):
    server, exporter = traced
    exporter.clear()
    with server.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        stub.Translate(pb.TranslateRequest(sentences=["the cat", "the dog sleeps"]), timeout=30,
                       metadata=[("traceparent", TRACEPARENT), ("x-request-id", "traced-1")])
    spans = {span.name: span for span in exporter.get_finished_spans() if span.name != "nmtserve decode"}
    rpc = next(s for s in exporter.get_finished_spans() if s.name.endswith("TranslationService/Translate"))
    call = spans["nmtserve Translate"]
    assert format(rpc.context.trace_id, "032x") == TRACE_ID  # the client's trace goes on in the server
    assert call.parent.span_id == rpc.context.span_id and call.context.trace_id == rpc.context.trace_id
    assert call.attributes["nmtserve.request_id"] == "traced-1" and call.attributes["nmtserve.code"] == "OK"
    assert call.attributes["nmtserve.sentences"] == 2
    stages = [s for s in exporter.get_finished_spans() if s.parent is not None and s.parent.span_id == call.context.span_id]
    assert sorted(s.name for s in stages) == ["nmtserve decode"] * 2 + ["nmtserve encode"] * 2 + ["nmtserve queue"] * 2
    for stage in stages:
        assert call.start_time <= stage.start_time <= stage.end_time <= call.end_time, stage.name
    by_sentence = {}
    for stage in stages:
        by_sentence.setdefault(stage.attributes["nmtserve.sentence"], {})[stage.name] = stage
    for parts in by_sentence.values():  # queue, then encode, then decode, each from where the last ended
        assert parts["nmtserve queue"].end_time == parts["nmtserve encode"].start_time
        assert parts["nmtserve encode"].end_time == parts["nmtserve decode"].start_time


def test_an_http_call_and_a_refused_one_are_spans_too(traced):
    server, exporter = traced
    exporter.clear()
    url = f"http://127.0.0.1:{server.running.http_port}"
    assert requests.post(f"{url}/v1/translate", json={"sentences": ["the cat"]}, timeout=30).status_code == 200
    assert requests.post(f"{url}/v1/translate", json={"sentences": [""]}, timeout=30).status_code == 400
    calls = [s for s in exporter.get_finished_spans() if s.name == "nmtserve Translate"]
    assert [c.attributes["nmtserve.code"] for c in calls] == ["OK", "INVALID_ARGUMENT"]
    assert calls[1].status.status_code.name == "ERROR"


def test_a_tracing_mode_that_does_not_exist_is_refused():
    with pytest.raises(ConfigError, match="--tracing 'jaeger': choose off or otlp"):
        start_tracing("jaeger")
