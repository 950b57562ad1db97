"""What the server says about each call: a request id (the client's x-request-id, or one made) in the answer's
metadata and in every log line of the call; logs that are one JSON object a line, with an access line for each
failed call (the default), for every call, or none; the build's versions as a metric."""

import json
import re

import grpc
import pytest
import requests

from nmtserve.loadtests.workload import ServerProcess
from nmtserve.server.metrics import build_versions
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc


def _trailers(call) -> dict:
    return dict(call.trailing_metadata() or ())


def test_a_grpc_call_answers_with_its_request_id_or_one_made_for_it(served):
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        _, call = stub.Translate.with_call(pb.TranslateRequest(sentences=["the cat"]), timeout=30,
                                           metadata=[("x-request-id", "order-42.a:b")])
        assert _trailers(call)["x-request-id"] == "order-42.a:b"
        _, call = stub.Translate.with_call(pb.TranslateRequest(sentences=["the cat"]), timeout=30)
        made = _trailers(call)["x-request-id"]
        _, call = stub.Translate.with_call(pb.TranslateRequest(sentences=["the cat"]), timeout=30,
                                           metadata=[("x-request-id", "not valid: spaces")])
        replaced = _trailers(call)["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made) and re.fullmatch(r"[0-9a-f]{32}", replaced) and made != replaced
        with pytest.raises(grpc.RpcError) as refused:  # a refusal carries it too
            stub.Translate(pb.TranslateRequest(sentences=[""]), timeout=30, metadata=[("x-request-id", "bad-1")])
        assert _trailers(refused.value)["x-request-id"] == "bad-1"
        stream = stub.TranslateStream(pb.TranslateStreamRequest(sentence="the cat"), timeout=30,
                                      metadata=[("x-request-id", "stream-1")])
        assert list(stream)[-1].final.text and _trailers(stream)["x-request-id"] == "stream-1"


def test_an_http_call_answers_with_its_request_id(tiny_bundle):
    from nmtserve.server.config import ServerConfig
    from tests.helpers import ServerThread

    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  http_port=0))
    try:
        url = f"http://127.0.0.1:{server.running.http_port}"
        ok = requests.post(f"{url}/v1/translate", json={"sentences": ["the cat"]},
                           headers={"x-request-id": "web-7"}, timeout=30)
        assert ok.status_code == 200 and ok.headers["x-request-id"] == "web-7"
        refused = requests.post(f"{url}/v1/translate", json={"sentences": [""]}, headers={"x-request-id": "web-8"},
                                timeout=30)
        assert refused.status_code == 400 and refused.headers["x-request-id"] == "web-8"
        streamed = requests.post(f"{url}/v1/translate:stream", json={"sentence": "the cat"}, timeout=30)
        assert re.fullmatch(r"[0-9a-f]{32}", streamed.headers["x-request-id"])
    finally:
        server.stop()


def _serve_and_call(bundle, log, *flags: str) -> list[dict]:
    """A `nmtserve serve` process (its default log format), one call that succeeds (request id r-1) and one that
    fails (r-2, no sentence), and its log's lines."""
    with ServerProcess(bundle, "--metrics-port", "-1", *flags, log=log) as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            stub.Translate(pb.TranslateRequest(sentences=["the cat"]), timeout=30, metadata=[("x-request-id", "r-1")])
            with pytest.raises(grpc.RpcError) as failed:
                stub.Translate(pb.TranslateRequest(sentences=[]), timeout=30, metadata=[("x-request-id", "r-2")])
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return [json.loads(line) for line in log.read_text().splitlines()]  # every line parses as JSON, or this raises


def _access(records: list[dict]) -> dict[str, dict]:
    """The access log's lines by request id."""
    return {r["request_id"]: r for r in records if r["logger"] == "nmtserve.access"}


def test_the_server_logs_one_json_object_a_line_and_an_access_line_for_each_failed_call_or_every_call(tiny_bundle,
                                                                                                      tmp_path):
    records = _serve_and_call(tiny_bundle, tmp_path / "errors.log")  # --access-log errors, the default
    assert {"time", "level", "logger", "message"} <= set(records[0])
    [failed] = _access(records).values()
    assert (failed["message"], failed["rpc"], failed["code"], failed["request_id"]) == \
        ("rpc", "Translate", "INVALID_ARGUMENT", "r-2")
    logged = _access(_serve_and_call(tiny_bundle, tmp_path / "on.log", "--access-log", "on"))
    assert sorted(logged) == ["r-1", "r-2"]
    assert (logged["r-1"]["code"], logged["r-1"]["sentences"]) == ("OK", 1) and logged["r-1"]["total_ms"] > 0
    records = _serve_and_call(tiny_bundle, tmp_path / "off.log", "--access-log", "off")
    assert records and not _access(records)


def test_the_build_is_a_metric(served):
    page = requests.get(f"http://127.0.0.1:{served.running.metrics_port}/metrics", timeout=10).text
    [line] = [line for line in page.splitlines() if line.startswith("nmtserve_build_info{")]
    versions = build_versions()
    assert f'version="{versions["version"]}"' in line and f'grpcio="{versions["grpcio"]}"' in line
    assert line.endswith(" 1.0")
