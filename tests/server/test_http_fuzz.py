"""Property-based fuzzing of the HTTP front's JSON bodies against a real server (as tests/server/test_fuzz.py does for
gRPC's messages): any JSON value as a body, or in any field, is a translation or a 4xx whose JSON error names the
problem; never a 500, a hang or a crash, nor a failure of a good call made meanwhile; and a body that never finishes
arriving is a 400 once its time is up."""

import json
import re
import socket

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmtserve.server import http
from nmtserve.server.config import ServerConfig
from tests.helpers import ServerThread

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.sampled_from(["sentences", "options", "model", "targetLanguage", "source_language", "q", "source", "target",
                          "format", "alternatives", "api_key", "beamSize"])
BODY = st.one_of(JSON, st.dictionaries(FIELDS, JSON, max_size=5),
                 st.fixed_dictionaries({"sentences": st.lists(st.text(max_size=40), max_size=3)},
                                       optional={"options": st.dictionaries(st.sampled_from(
                                           ["beamSize", "numHypotheses", "samplingTopk", "lengthPenalty", "maxDecodingLength"]),
                                           JSON, max_size=3)}),
                 st.fixed_dictionaries({"q": JSON, "target": st.sampled_from(["fr", "de", "", "auto"])},
                                       optional={"alternatives": JSON, "format": JSON}))


@pytest.fixture(scope="module")
def bystander(url):
    """A client translating one good sentence over and over while the fuzzing runs: every one of its calls must
    succeed, whatever shares the batch with it."""
    import threading

    stop, answers = threading.Event(), []

    def translate():
        while not stop.is_set():
            got = requests.post(url + "/v1/translate", json={"sentences": ["the cat sees the dog"]}, timeout=60)
            answers.append(got.status_code)
    thread = threading.Thread(target=translate, daemon=True)
    thread.start()
    yield answers
    stop.set()
    thread.join(60)


@pytest.fixture(scope="module")
def url(tiny_bundle):
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  http_port=0, max_sentences=8, max_sentence_chars=300,
                                                  max_decoding_length=16))
    yield f"http://127.0.0.1:{server.running.http_port}"
    server.stop()


@SETTINGS
@given(body=BODY, path=st.sampled_from(["/v1/translate", "/v1/translateText", "/v1/translate:stream", "/translate"]))
def test_any_json_body_is_an_answer_or_a_4xx_naming_the_problem(url, bystander, body, path):
    got = requests.post(url + path, data=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)
    assert got.status_code in (200, 400, 404), (got.status_code, got.text[:300])
    if got.status_code != 200:
        error = got.json()["error"]
        message = error if path == "/translate" else error["message"]
        assert message and (path == "/translate" or error["status"] in ("INVALID_ARGUMENT", "NOT_FOUND"))
    elif path == "/v1/translate:stream":
        assert got.text.startswith("data: ")
    else:
        got.json()


def _response(client: socket.socket) -> str:
    """One HTTP response read whole from the socket (its headers and body may come in separate segments)."""
    data = b""
    while True:
        head, end, body = data.partition(b"\r\n\r\n")
        if end and len(body) >= int(re.search(rb"(?i)content-length: (\d+)", head).group(1)):
            return data.decode()
        chunk = client.recv(65536)
        if not chunk:
            return data.decode()
        data += chunk


@pytest.mark.parametrize("path, kind, start", [("/v1/translate", "application/json", b'{"sentences": ['),
                                               ("/translate", "application/x-www-form-urlencoded", b"q=the+cat&tar")])
def test_a_body_that_never_finishes_arriving_is_a_400_once_its_time_is_up(url, monkeypatch, path, kind, start):
    monkeypatch.setattr(http, "BODY_SECONDS", 0.5)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as client:
        client.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\nContent-Length: 100\r\n\r\n"
                       .encode() + start)  # and then nothing
        answer = _response(client)
    assert answer.startswith("HTTP/1.1 400") and "body: not received in full within 0.5 s" in answer
    assert requests.post(url + "/v1/translate", json={"sentences": ["a"]}, timeout=30).status_code == 200


def test_the_bystander_was_served_throughout(bystander):
    """Last in this module: the good calls made while the tests above ran (at least ten) all succeeded."""
    import time

    deadline = time.monotonic() + 30
    while len(bystander) < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(bystander) >= 10 and set(bystander) == {200}
