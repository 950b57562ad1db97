"""The limiter overlay's HAProxy (deploy/kubernetes/overlays/limiter/haproxy.cfg), run as it is in front of a real
server with API keys: a client over its calls a second is refused there with what the server's own refusals carry
(gRPC RESOURCE_EXHAUSTED with retry-after; HTTP 429 with the server's JSON error body, LibreTranslate's on its
/translate; the call's x-request-id), never reaching the server; a LibreTranslate client is its body's api_key; a
key in the ceilings map has its own ceiling;
another client and the health checks pass meanwhile; HAProxy's Prometheus page counts the refusals; its soft stop
(the container image's stop signal) lets the calls in flight finish and takes no new one."""

import hashlib
import re
import signal
import threading
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmtserve.loadtests.limiter import Limiter
from nmtserve.server.auth import client_entry
from nmtserve.server.config import ServerConfig
from nmtserve.server.http_status import error_body
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ROOT, ServerThread, system_tool

CONFIG = ROOT / "deploy" / "kubernetes" / "overlays" / "limiter" / "haproxy.cfg"
CEILING = 5  # calls a second per client
EAGER, OTHER = "key-of-a-client-that-never-waits", "key-of-another-client"
MESSAGE = "over the client's calls a second (the limiter in front)"


@pytest.fixture(scope="module")
def fronted(tiny_bundle, tmp_path_factory):
    system_tool("haproxy")
    scratch = tmp_path_factory.mktemp("limiter")
    keys = scratch / "keys.toml"
    keys.write_text(client_entry("eager", EAGER) + client_entry("other", OTHER))
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  http_port=0, api_keys=str(keys), max_decoding_length=16))
    try:
        with Limiter(CONFIG, f"127.0.0.1:{server.running.port}", f"127.0.0.1:{server.running.http_port}", CEILING,
                     log=scratch / "haproxy.log") as limiter:
            yield server, limiter
    finally:
        server.stop()


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _translate(stub, key: str):
    try:
        stub.Translate(pb.TranslateRequest(sentences=["the cat"]), metadata=_bearer(key), timeout=30)
        return "OK"
    except grpc.RpcError as e:
        return e.code(), e.details(), dict(e.trailing_metadata() or ()).get("retry-after")


def _served(server, client: str, rpc: str = "Translate") -> float:
    return server.running.servicer.metrics.registry.get_sample_value(
        "nmtserve_requests_total", {"client": client, "model": "en-fr", "mode": "greedy", "rpc": rpc,
                                    "code": "OK"}) or 0.0


def test_a_client_over_its_calls_a_second_is_refused_in_front_while_another_is_served(fronted):
    server, limiter = fronted
    served_before, refused_before = _served(server, "eager"), limiter.refused("grpc")
    with grpc.insecure_channel(limiter.target) as channel:
        stub, health = pb_grpc.TranslationServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        outcomes = [_translate(stub, EAGER) for _ in range(3 * CEILING)]
        # the same moment: another key passes, and health checks are never counted
        assert _translate(stub, OTHER) == "OK"
        for _ in range(3 * CEILING):
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        refused = [o for o in outcomes if o != "OK"]
        assert outcomes[:CEILING] == ["OK"] * CEILING and refused
        assert set(refused) == {(grpc.StatusCode.RESOURCE_EXHAUSTED, MESSAGE, "1")}
        # the refused calls never reached the server; HAProxy counts each
        assert _served(server, "eager") - served_before == outcomes.count("OK")
        assert limiter.refused("grpc") - refused_before == len(refused)
        time.sleep(2.5)  # the client waited: its last second's calls are under the ceiling again
        assert _translate(stub, EAGER) == "OK"


def test_over_http_the_refusal_is_a_429_with_the_servers_error_body(fronted):
    _, limiter = fronted
    time.sleep(2.5)  # a fresh second for the client
    answers = [requests.post(f"{limiter.http_url}/v1/translate", json={"sentences": ["the cat"]},
                             headers={"authorization": f"Bearer {EAGER}"}, timeout=30) for _ in range(3 * CEILING)]
    assert [a.status_code for a in answers[:CEILING]] == [200] * CEILING
    refused = [a for a in answers if a.status_code != 200]
    assert refused and all(a.status_code == 429 and a.headers["retry-after"] == "1" for a in refused)
    assert all(a.json() == error_body(grpc.StatusCode.RESOURCE_EXHAUSTED, MESSAGE) for a in refused)
    assert all(requests.get(f"{limiter.http_url}/livez", timeout=10).status_code == 200 for _ in range(3 * CEILING))


def test_a_refusal_in_front_carries_the_calls_request_id_as_the_servers_answers_do(fronted):
    """x-request-id: the client's own where the server would take it, else one the limiter makes, in every answer,
    whether the server gave it or the limiter refused the call (gRPC's trailers, HTTP's headers)."""
    _, limiter = fronted

    def grpc_ids(stub, given: list[tuple[str, str]]) -> list[tuple[bool, str]]:
        found = []
        for _ in range(3 * CEILING):
            try:
                _, call = stub.Translate.with_call(pb.TranslateRequest(sentences=["the cat"]),
                                                   metadata=_bearer(EAGER) + given, timeout=30)
                found.append((True, dict(call.trailing_metadata())["x-request-id"]))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                found.append((False, dict(e.trailing_metadata())["x-request-id"]))
        return found

    with grpc.insecure_channel(limiter.target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        time.sleep(2.5)  # a fresh second for the client
        own = grpc_ids(stub, [("x-request-id", "client-1.a:b_c")])
        assert {ok for ok, _ in own} == {True, False} and {i for _, i in own} == {"client-1.a:b_c"}
        for given in ([], [("x-request-id", "not one the server takes")]):
            time.sleep(2.5)
            made = grpc_ids(stub, given)
            assert {ok for ok, _ in made} == {True, False}
            assert len({i for _, i in made}) == len(made) and all(re.fullmatch(r"[0-9a-f-]{36}", i) for _, i in made)
    time.sleep(2.5)
    answers = [requests.post(f"{limiter.http_url}/v1/translate", json={"sentences": ["the cat"]}, timeout=30,
                             headers={"authorization": f"Bearer {EAGER}", "x-request-id": f"http-{i}"})
               for i in range(3 * CEILING)]
    assert {a.status_code for a in answers} == {200, 429}
    assert [a.headers["x-request-id"] for a in answers] == [f"http-{i}" for i in range(3 * CEILING)]
    time.sleep(2.5)
    answers = [requests.post(f"{limiter.http_url}/v1/translate", json={"sentences": ["the cat"]}, timeout=30,
                             headers={"authorization": f"Bearer {EAGER}"}) for _ in range(3 * CEILING)]
    assert {a.status_code for a in answers} == {200, 429} and len({a.headers["x-request-id"] for a in answers}) == len(answers)


def test_a_libretranslate_client_is_its_api_key_and_is_refused_in_libretranslates_words(fronted):
    """LibreTranslate's api_key in a JSON or a form body counts as the client's key, as the authorization header does:
    over the ceiling that key is refused in front with LibreTranslate's error body, while another key from the same
    address is served; the server sees the key too (the calls it answered are counted as its client's)."""
    server, limiter = fronted
    for body in ("json", "data"):  # a JSON body, a form
        def send(key: str) -> requests.Response:
            return requests.post(f"{limiter.http_url}/translate", timeout=30,
                                 **{body: {"q": "the cat", "source": "en", "target": "fr", "api_key": key}})
        time.sleep(2.5)  # a fresh second for the client
        served_before = _served(server, "eager", "TranslateText")  # LibreTranslate's /translate, without alternatives
        answers = [send(EAGER) for _ in range(3 * CEILING)]
        assert [a.status_code for a in answers[:CEILING]] == [200] * CEILING
        refused = [a for a in answers if a.status_code != 200]
        assert refused and all(a.status_code == 429 and a.headers["retry-after"] == "1" and a.json() == {"error": MESSAGE}
                               for a in refused)
        other = send(OTHER)
        assert other.status_code == 200 and other.json()["translatedText"]
        assert _served(server, "eager", "TranslateText") - served_before == len(answers) - len(refused)


def test_a_key_in_the_ceilings_map_has_its_own_ceiling(fronted, tmp_path):
    """ceilings.map: a key listed there (by its SHA-256, as the api-keys file holds it) is held to its own ceiling, the
    others to everyone's."""
    server, _ = fronted
    ceilings = tmp_path / "ceilings.map"
    ceilings.write_text(f"# the other key may call four times as often\n{hashlib.sha256(OTHER.encode()).hexdigest()} "
                        f"{4 * CEILING}\n")
    with Limiter(CONFIG, f"127.0.0.1:{server.running.port}", f"127.0.0.1:{server.running.http_port}", CEILING,
                 log=tmp_path / "haproxy.log", ceilings=ceilings) as limiter, grpc.insecure_channel(limiter.target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        other = [_translate(stub, OTHER) for _ in range(3 * CEILING)]
        eager = [_translate(stub, EAGER) for _ in range(3 * CEILING)]
        assert other == ["OK"] * (3 * CEILING)
        assert eager[:CEILING] == ["OK"] * CEILING and set(eager[CEILING + 1:]) == {
            (grpc.StatusCode.RESOURCE_EXHAUSTED, MESSAGE, "1")}
        time.sleep(2.5)
        answers = [requests.post(f"{limiter.http_url}/v1/translate", json={"sentences": ["the cat"]}, timeout=30,
                                 headers={"authorization": f"Bearer {OTHER}"}) for _ in range(3 * CEILING)]
        assert [a.status_code for a in answers] == [200] * (3 * CEILING)


def test_a_soft_stop_lets_the_calls_in_flight_finish_and_takes_no_new_one(fronted, tmp_path):
    """SIGUSR1 (the haproxy image's STOPSIGNAL) while a long TranslateText decodes: that call is answered in full,
    a new connection is refused, and HAProxy then exits on its own."""
    server, _ = fronted
    text = " ".join(f"the cat sees the dog number {i}." for i in range(120))
    limiter = Limiter(CONFIG, f"127.0.0.1:{server.running.port}", f"127.0.0.1:{server.running.http_port}", 100,
                      log=tmp_path / "haproxy.log")
    answer = {}

    def call() -> None:
        with grpc.insecure_channel(limiter.target) as channel:
            answer["text"] = pb_grpc.TranslationServiceStub(channel).TranslateText(
                pb.TranslateTextRequest(texts=[text]), metadata=_bearer(OTHER), timeout=60).translations[0].text

    try:
        caller = threading.Thread(target=call)
        caller.start()
        registry, deadline = server.running.servicer.metrics.registry, time.monotonic() + 30
        while not registry.get_sample_value("nmtserve_requests_running", {"model": "en-fr"}):  # in flight
            assert time.monotonic() < deadline and caller.is_alive(), "the call never ran"
            time.sleep(0.001)
        limiter.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        with grpc.insecure_channel(limiter.target) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=["the cat"]),
                                                              metadata=_bearer(OTHER), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        caller.join(60)
        assert answer["text"].count(".") >= 100  # every sentence came back
        assert limiter.proc.wait(30) == 0
    finally:
        limiter.stop()
