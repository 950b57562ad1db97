"""The HTTP/JSON front (server/http.py) on a real server's own port, beside its gRPC port: the same translations,
the same errors under HTTP's status codes, server-sent events, LibreTranslate's API and a valid OpenAPI document."""

import json

import grpc
import jsonschema
import pytest
import requests
from openapi_spec_validator import validate

from nmtserve.server.config import ServerConfig
from nmtserve.server.http import error_response
from nmtserve.server.http_status import HTTP_STATUS, Aborted
from nmtserve.server.service import OVERLOADED_RETRY_SECONDS
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread

SENTENCES = ["the cat sees the dog", "we are happy ."]


@pytest.fixture(scope="module")
def server(tiny_bundle):
    running = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                   http_port=0, max_sentences=8, max_sentence_chars=300,
                                                   max_decoding_length=64, max_message_bytes=64 * 1024))
    running.url = f"http://127.0.0.1:{running.running.http_port}"
    yield running
    running.stop()


def _grpc(server, rpc: str, request):
    with server.channel() as channel:
        return getattr(pb_grpc.TranslationServiceStub(channel), rpc)(request, timeout=60)


def _events(response: requests.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event ("message" when unnamed)."""
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines.get("event", "message"), json.loads(lines["data"])))
    return events


def _schema_of(document: dict, name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}", "components": document["components"]}


def test_translate_over_http_is_translate_over_grpc(server):
    options = {"beamSize": 3, "numHypotheses": 2, "returnScores": True, "max_decoding_length": 20}  # either name form
    got = requests.post(f"{server.url}/v1/translate", json={"sentences": SENTENCES, "options": options}, timeout=60)
    assert got.status_code == 200 and got.headers["content-type"] == "application/json"
    expected = _grpc(server, "Translate", pb.TranslateRequest(sentences=SENTENCES, options=pb.DecodingOptions(
        beam_size=3, num_hypotheses=2, return_scores=True, max_decoding_length=20)))
    translations = got.json()["translations"]
    assert [t["text"] for t in translations] == [t.text for t in expected.translations]
    assert [[a["text"] for a in t["alternatives"]] for t in translations] == \
        [[a.text for a in t.alternatives] for t in expected.translations]
    assert [t["finishReason"] for t in translations] == [pb.FinishReason.Name(t.finish_reason) for t in expected.translations]
    assert [t["confidence"] for t in translations] == pytest.approx([t.confidence for t in expected.translations])
    glossary = [{"source": "cat", "target": "chien"}]
    termed = requests.post(f"{server.url}/v1/translate", json={"sentences": ["the cat sleeps ."], "glossary": glossary},
                           timeout=60).json()["translations"][0]["text"]
    assert termed == _grpc(server, "Translate", pb.TranslateRequest(sentences=["the cat sleeps ."], glossary=[
        pb.GlossaryEntry(source="cat", target="chien")])).translations[0].text and "chien" in termed
    text = requests.post(f"{server.url}/v1/translateText", json={"texts": ["the cat sees the dog. we are happy ."]},
                         timeout=60)
    assert text.json()["translations"][0]["text"] == _grpc(server, "TranslateText", pb.TranslateTextRequest(
        texts=["the cat sees the dog. we are happy ."])).translations[0].text
    html = "<p>the cat <b>sees</b> the dog.</p>"
    marked = requests.post(f"{server.url}/v1/translateText", json={"texts": [html], "mimeType": "text/html"}, timeout=60)
    assert marked.json()["translations"][0]["text"] == _grpc(server, "TranslateText", pb.TranslateTextRequest(
        texts=[html], mime_type="text/html")).translations[0].text
    attended = requests.post(f"{server.url}/v1/translate", json={"sentences": SENTENCES[:1],
                                                                 "options": {"returnAttention": True}}, timeout=60)
    attention = attended.json()["translations"][0]["attention"]
    expected = _grpc(server, "Translate", pb.TranslateRequest(sentences=SENTENCES[:1], options=pb.DecodingOptions(
        return_attention=True))).translations[0].attention
    assert attention["targetTokens"] == list(expected.target_tokens) and len(attention["rows"]) == len(expected.rows)
    assert [r["weights"] for r in attention["rows"]] == [pytest.approx(list(r.weights)) for r in expected.rows]


def test_streams_are_server_sent_events_of_the_grpc_stream(server):
    got = requests.post(f"{server.url}/v1/translate:stream", json={"sentence": SENTENCES[0]}, timeout=60)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
    events = _events(got)
    final = events[-1][1]["final"]
    assert all(name == "message" for name, _ in events)
    assert "".join(data.get("delta", "") for _, data in events[:-1]) == final["text"]
    assert final["text"] == _grpc(server, "Translate", pb.TranslateRequest(sentences=SENTENCES[:1])).translations[0].text
    text = "the cat sees the dog. we are happy ."
    streamed = _events(requests.post(f"{server.url}/v1/translateText:stream", json={"text": text}, timeout=60))
    assert "".join(data.get("delta", "") for _, data in streamed) == _grpc(
        server, "TranslateText", pb.TranslateTextRequest(texts=[text])).translations[0].text
    refused = requests.post(f"{server.url}/v1/translate:stream", json={"sentence": ""}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["status"] == "INVALID_ARGUMENT"  # before any event


def test_models_and_an_unknown_model_is_not_found_on_both_fronts(server):
    models = requests.get(f"{server.url}/v1/models", timeout=30).json()["models"]
    info = _grpc(server, "ListModels", pb.ListModelsRequest()).models[0]
    assert [m["model"] for m in models] == [info.model] and models[0]["sourceLanguage"] == info.source_language
    assert requests.get(f"{server.url}/v1/models/{info.model}", timeout=30).json()["model"] == info.model
    missing = requests.get(f"{server.url}/v1/models/de-en", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["status"] == "NOT_FOUND"
    unknown = requests.post(f"{server.url}/v1/translate", json={"sentences": ["a"], "model": "de-en"}, timeout=30)
    with pytest.raises(grpc.RpcError) as refused:
        _grpc(server, "Translate", pb.TranslateRequest(sentences=["a"], model="de-en"))
    assert unknown.status_code == 404 and refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert unknown.json()["error"]["message"] == refused.value.details()


@pytest.mark.parametrize("body, status, message", [
    (json.dumps({"sentences": [""]}), 400, "sentences[0]: empty sentence"),
    (json.dumps({"sentences": ["a"], "options": {"beamSize": 99}}), 400, "beam_size 99"),
    (json.dumps({"sentences": 5}), 400, "sentences"),
    (json.dumps({"sentences": ["a"], "no_such_field": 1}), 400, "no_such_field"),
    ('{"sentences": ["a"', 400, "body: not JSON"),
    (b'{"sentences": ["\xff"]}', 400, "body: not UTF-8"),
    (json.dumps({"sentences": ["a" * 70_000]}), 400, "body: 70"),
])
def test_bad_input_is_a_4xx_with_a_json_error_naming_the_field(server, body, status, message):
    got = requests.post(f"{server.url}/v1/translate", data=body, headers={"content-type": "application/json"},
                        timeout=30)
    assert got.status_code == status
    error = got.json()["error"]
    assert error["code"] == status and error["status"] == "INVALID_ARGUMENT" and message in error["message"]
    with server.channel() as channel:  # the server goes on
        assert pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=["a"]), timeout=30)


def test_deadlines_and_draining_keep_grpcs_codes(server):
    late = requests.post(f"{server.url}/v1/translate", json={"sentences": SENTENCES * 4},
                         headers={"X-Server-Timeout": "0.000001"}, timeout=30)
    assert late.status_code == 504 and late.json()["error"]["status"] == "DEADLINE_EXCEEDED"
    bad = requests.post(f"{server.url}/v1/translate", json={"sentences": ["a"]}, headers={"X-Server-Timeout": "soon"},
                        timeout=30)
    assert bad.status_code == 400 and "x-server-timeout header 'soon'" in bad.json()["error"]["message"]
    assert requests.get(f"{server.url}/readyz", timeout=30).json() == {"status": "SERVING"}
    server.running.servicer.accepting = False  # as while draining
    try:
        refused = requests.post(f"{server.url}/v1/translate", json={"sentences": ["a"]}, timeout=30)
        ready = requests.get(f"{server.url}/readyz", timeout=30)
        alive = requests.get(f"{server.url}/livez", timeout=30)
    finally:
        server.running.servicer.accepting = True
    assert refused.status_code == 503 and refused.json()["error"]["status"] == "UNAVAILABLE"
    assert ready.status_code == 503 and ready.json() == {"status": "NOT_SERVING"}
    assert alive.status_code == 200  # liveness holds through the drain: Kubernetes must not restart a draining pod


def test_status_codes_follow_grpcs_http_mapping():
    assert {code.name: status for code, status in HTTP_STATUS.items()} == {
        "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
        "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "INTERNAL": 500}
    assert error_response(Aborted(grpc.StatusCode.UNKNOWN, "x")).status_code == 500


def test_a_full_queue_is_429_with_retry_after_and_the_others_are_served(tiny_bundle):
    """A real overload: one running row and one waiting request, and 16 calls at once; those the engine cannot
    queue get RESOURCE_EXHAUSTED as 429 with Retry-After at once, every other one its translation."""
    from concurrent.futures import ThreadPoolExecutor

    small = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                 http_port=0, max_running_rows=1, max_waiting=1,
                                                 max_decoding_length=64))
    try:
        url = f"http://127.0.0.1:{small.running.http_port}/v1/translate"
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: requests.post(url, json={"sentences": [f"the cat sees the dog {i}"]},
                                                            timeout=60), range(16)))
    finally:
        small.stop()
    full = [a for a in answers if a.status_code == 429]
    assert full and all(a.status_code in (200, 429) for a in answers)
    assert all(a.headers["retry-after"] == str(OVERLOADED_RETRY_SECONDS) for a in full)
    assert all(a.json()["error"]["status"] == "RESOURCE_EXHAUSTED" for a in full)
    assert all(a.json()["translations"][0]["text"] for a in answers if a.status_code == 200)


def test_libretranslate_api(server):
    expected = [t.text for t in _grpc(server, "TranslateText", pb.TranslateTextRequest(texts=SENTENCES)).translations]
    one = requests.post(f"{server.url}/translate", json={"q": SENTENCES[0], "source": "en", "target": "fr"}, timeout=60)
    assert one.status_code == 200 and one.json() == {"translatedText": expected[0]}
    several = requests.post(f"{server.url}/translate", json={"q": SENTENCES, "source": "auto", "target": "fr",
                                                             "api_key": "unused"}, timeout=60)
    # "auto" with one source language served: that one, certain (no detection)
    assert several.json() == {"translatedText": expected,
                              "detectedLanguage": [{"confidence": 100.0, "language": "en"}] * len(SENTENCES)}
    form = requests.post(f"{server.url}/translate", data={"q": SENTENCES[0], "source": "en", "target": "fr"},
                         timeout=60)
    assert form.json() == {"translatedText": expected[0]}
    alternatives = requests.post(f"{server.url}/translate", json={"q": SENTENCES[0], "target": "fr", "alternatives": 2},
                                 timeout=60).json()
    nbest = _grpc(server, "Translate", pb.TranslateRequest(sentences=SENTENCES[:1], options=pb.DecodingOptions(
        beam_size=3, num_hypotheses=3))).translations[0]
    assert alternatives == {"translatedText": nbest.text, "alternatives": [a.text for a in nbest.alternatives],
                            "detectedLanguage": {"confidence": 100.0, "language": "en"}}
    html = "<p>The cat <b>sleeps</b>.</p>"
    marked = requests.post(f"{server.url}/translate", json={"q": html, "source": "en", "target": "fr", "format": "html"},
                           timeout=60).json()
    assert marked == {"translatedText": _grpc(server, "TranslateText", pb.TranslateTextRequest(
        texts=[html], mime_type="text/html")).translations[0].text}
    assert marked["translatedText"].startswith("<p>") and marked["translatedText"].count("<b>") == 1
    for body, status, message in (({"q": "a", "target": "fr", "format": "html", "alternatives": 1}, 400,
                                   "alternatives: sentence by sentence, with format text only"),
                                  ({"q": "a", "target": "fr", "format": "pdf"}, 400, "format 'pdf'"),
                                  ({"q": "a"}, 400, "target: required"),
                                  ({"q": 3, "target": "fr"}, 400, "q 3"),
                                  ({"q": "a", "target": "fr", "alternatives": "many"}, 400, "alternatives 'many'"),
                                  ({"q": "a", "target": "de"}, 400, "target_language 'de'")):
        got = requests.post(f"{server.url}/translate", json=body, timeout=30)
        assert got.status_code == status and message in got.json()["error"], body
    assert requests.get(f"{server.url}/languages", timeout=30).json() == [{"code": "en", "name": "en", "targets": ["fr"]}]


def test_the_openapi_document_is_valid_and_describes_the_responses(server):
    document = requests.get(f"{server.url}/openapi.json", timeout=30).json()
    validate(document)
    assert {"/v1/translate", "/v1/translate:stream", "/v1/translateText", "/v1/translateText:stream", "/v1/models",
            "/v1/models/{model}", "/translate", "/languages", "/livez", "/readyz", "/openapi.json"} == set(document["paths"])
    translated = requests.post(f"{server.url}/v1/translate", json={"sentences": SENTENCES, "options": {
        "returnScores": True, "returnAttention": True}}, timeout=60).json()
    jsonschema.validate(translated, _schema_of(document, "TranslateResponse"))
    jsonschema.validate(requests.get(f"{server.url}/v1/models", timeout=30).json(),
                        _schema_of(document, "ListModelsResponse"))
    error = requests.post(f"{server.url}/v1/translate", json={"sentences": [""]}, timeout=30).json()
    jsonschema.validate(error, _schema_of(document, "Error"))
    with pytest.raises(jsonschema.ValidationError):  # the schemas say something: a wrong type fails them
        jsonschema.validate({"translations": [{"text": 5}]}, _schema_of(document, "TranslateResponse"))


def test_connections_have_nagles_algorithm_off(server):
    """TCP_NODELAY on every accepted connection: with Nagle's algorithm on, a kept-alive connection's response body
    waits behind its headers for the client's delayed ACK (tens of milliseconds a call)."""
    import socket

    with requests.Session() as session:  # one kept-alive connection, open while the server's side is looked at
        assert session.post(f"{server.url}/v1/translate", json={"sentences": ["a"]}, timeout=30).status_code == 200
        connections = server.running.http._server.server_state.connections
        sockets = [c.transport.get_extra_info("socket") for c in list(connections)]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
