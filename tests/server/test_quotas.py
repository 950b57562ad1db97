"""Per-client quotas (server/quotas.py): a client over max_concurrent or chars_per_minute is refused at once with
RESOURCE_EXHAUSTED and a retry-after, on both fronts; another client is served meanwhile; a call's slot is freed
however it ends; refusals and characters are counted by client name."""

import threading

import grpc
import pytest
import requests

from nmtserve.server.auth import client_entry
from nmtserve.server.config import ServerConfig
from nmtserve.server.quotas import ClientQuota, QuotaExceeded
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread

FLOOD, CHARS, OPEN = "key-of-a-flooding-client", "key-of-a-client-of-sixty-chars", "key-of-a-client-without-limits"
SENTENCES = [f"the cat sees the dog number {i}" for i in range(8)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_token_bucket_of_characters_refills_continuously_and_says_when_to_retry():
    clock = Clock()
    quota = ClientQuota("c", clock)
    quota.limit(None, 600)  # 10 characters a second, 600 at most
    quota.charge(550)
    with pytest.raises(QuotaExceeded) as over:
        quota.charge(80)  # 50 held: 30 more take 3 s
    assert (over.value.quota, over.value.retry_after) == ("characters", 3)
    clock.now = 3.0
    quota.charge(80)
    quota.refund(80)  # a call the server then refused gives its characters back
    assert quota.tokens == pytest.approx(80)
    clock.now = 1000.0
    quota.charge(600)  # the bucket holds one minute's worth, not more
    with pytest.raises(QuotaExceeded, match="split the text") as never:
        quota.charge(601)
    assert never.value.retry_after is None
    quota.limit(None, 1200)  # a new limit starts a full bucket
    quota.charge(1200)


def test_calls_in_flight_are_bounded_and_a_new_limit_keeps_them():
    quota = ClientQuota("c")
    quota.limit(2, None)
    quota.enter()
    quota.enter()
    with pytest.raises(QuotaExceeded, match="at its quota of 2 call") as over:
        quota.enter()
    assert (over.value.quota, over.value.retry_after) == ("concurrency", 1)
    quota.limit(3, None)
    quota.enter()
    for _ in range(3):
        quota.leave()
    assert quota.in_flight == 0


@pytest.fixture(scope="module")
def limited(tiny_bundle, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(client_entry("flood", FLOOD, max_concurrent=1) + client_entry("chars", CHARS, chars_per_minute=60)
                    + client_entry("open", OPEN))
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  http_port=0, api_keys=str(keys), max_decoding_length=64))
    server.url = f"http://127.0.0.1:{server.running.http_port}"
    yield server
    server.stop()


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _counted(server, name: str, **labels: str) -> float:
    return server.running.servicer.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_client_over_its_concurrency_is_refused_at_once_while_another_is_served(limited):
    """Eight calls of the flooding client at once (max_concurrent 1) and one of another client: the flood's extra
    calls are RESOURCE_EXHAUSTED with retry-after 1, the other client's call is answered; once they are over, the
    flooding client's slot is free again."""
    before = _counted(limited, "nmtserve_quota_rejections_total", client="flood", quota="concurrency")
    start, outcomes = threading.Barrier(9), {}

    def call(i: int, key: str) -> None:
        with limited.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            start.wait()
            try:
                stub.Translate(pb.TranslateRequest(sentences=SENTENCES), metadata=_bearer(key), timeout=60)
                outcomes[i] = "OK"
            except grpc.RpcError as e:
                outcomes[i] = (e.code(), e.details(), dict(e.trailing_metadata() or ()).get("retry-after"))

    threads = [threading.Thread(target=call, args=(i, FLOOD)) for i in range(8)]
    threads.append(threading.Thread(target=call, args=(8, OPEN)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes[8] == "OK"
    refused = [o for i, o in outcomes.items() if o != "OK"]
    assert refused and "OK" in [outcomes[i] for i in range(8)]
    assert all(o == (grpc.StatusCode.RESOURCE_EXHAUSTED, "client flood: at its quota of 1 call(s) in flight at once", "1")
               for o in refused)
    assert _counted(limited, "nmtserve_quota_rejections_total", client="flood", quota="concurrency") - before == len(refused)
    assert _counted(limited, "nmtserve_requests_total", client="open", model="en-fr", mode="greedy", rpc="Translate",
                    code="OK") >= 1
    with limited.channel() as channel:  # the slot is free after each call: no leak
        stub = pb_grpc.TranslationServiceStub(channel)
        for _ in range(3):
            assert stub.Translate(pb.TranslateRequest(sentences=["the cat"]), metadata=_bearer(FLOOD), timeout=30)


def test_a_stream_that_fails_or_is_cancelled_frees_its_slot(limited):
    with limited.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        stream = stub.TranslateStream(pb.TranslateStreamRequest(sentence="the cat sees the dog"),
                                      metadata=_bearer(FLOOD), timeout=30)
        next(stream)
        stream.cancel()
        with pytest.raises(grpc.RpcError) as invalid:  # an invalid call took the slot, then gave it back
            list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=""), metadata=_bearer(FLOOD), timeout=30))
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(2):
            assert list(stub.TranslateStream(pb.TranslateStreamRequest(sentence="the cat"), metadata=_bearer(FLOOD),
                                             timeout=30))[-1].final.text


def test_characters_per_minute_on_both_fronts(limited):
    """chars_per_minute 60: one character a second. 40 characters pass, 40 more at once are over (retry after
    the ~20 s the bucket needs), more than 60 never pass; the other clients are not charged."""
    forty = "the cat sees the dog and the dog sees it"
    assert len(forty) == 40
    with limited.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        assert stub.Translate(pb.TranslateRequest(sentences=[forty]), metadata=_bearer(CHARS), timeout=30)
        with pytest.raises(grpc.RpcError) as over:
            stub.Translate(pb.TranslateRequest(sentences=[forty]), metadata=_bearer(CHARS), timeout=30)
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "40 characters, over its quota of 60 a minute" in over.value.details()
        assert 15 <= int(dict(over.value.trailing_metadata())["retry-after"]) <= 21
        assert stub.Translate(pb.TranslateRequest(sentences=[forty] * 4), metadata=_bearer(OPEN), timeout=30)
    http = requests.post(f"{limited.url}/v1/translateText", json={"texts": [forty]},
                         headers={"authorization": f"Bearer {CHARS}"}, timeout=30)
    assert http.status_code == 429 and 15 <= int(http.headers["retry-after"]) <= 21
    assert http.json()["error"]["status"] == "RESOURCE_EXHAUSTED"
    never = requests.post(f"{limited.url}/translate", json={"q": forty * 2, "target": "fr", "api_key": CHARS},
                          timeout=30)
    assert never.status_code == 429 and "retry-after" not in never.headers
    assert "80 characters in one call, more than its quota of 60 a minute ever allows" in never.json()["error"]
    assert _counted(limited, "nmtserve_quota_rejections_total", client="chars", quota="characters") == 3
    assert _counted(limited, "nmtserve_client_characters_total", client="chars") == 40
    assert _counted(limited, "nmtserve_client_characters_total", client="open") >= 160
