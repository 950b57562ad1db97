"""Faults from outside, on real servers: a client process killed mid-stream, a stream that is never
read, a server-side write that would fail, SIGTERM during a burst, SIGKILL and a restart. Each frees its rows, no accepted
request is lost silently (it finishes, or its client gets a status code), and the server's log
holds no traceback."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmtserve.export.runtime.bundle import load_bundle
from nmtserve.loadtests.workload import ServerProcess, free_port
from nmtserve.server.config import ServerConfig
from nmtserve.training.data import read_tsv
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, metric, scrape, wait_engine_idle


class Server(ServerProcess):
    """A served tiny bundle with its /metrics on a known port and its log in a file."""

    def __init__(self, bundle, log, port: int = 0):
        self.metrics_port = free_port()
        super().__init__(bundle, "--metrics-port", str(self.metrics_port), "--max-running-rows", "8",
                         "--max-decoding-length", "256", *(["--port", str(port)] if port else []), log=log,
                         cwd=Path(log).parent)

    def metric(self, name: str, **labels: str) -> float:
        return metric(scrape(self.metrics_port), name, **labels)

    def wait_idle(self, seconds: float = 20) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.metric("nmtserve_requests_running") == 0 and self.metric("nmtserve_requests_waiting") == 0:
                return True
            time.sleep(0.1)
        return False


@pytest.fixture
def long_sentences(tiny_corpus) -> list[str]:
    # long sources: their output budget (2 × source + 10) keeps the tiny model busy for a while
    return [" ".join([s] * 4) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:8]


@pytest.fixture
def server(tiny_bundle, tmp_path):
    log = tmp_path / "server.log"
    with Server(tiny_bundle, log) as running:
        yield running
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _translate(target: str, sentences: list[str]) -> list[str]:
    with grpc.insecure_channel(target) as channel:
        response = pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=sentences), timeout=120)
        return [t.text for t in response.translations]


CLIENT = """
import sys, grpc
from nmtserve.v1 import translation_pb2 as pb, translation_pb2_grpc as pb_grpc
stub = pb_grpc.TranslationServiceStub(grpc.insecure_channel(sys.argv[1]))
for message in stub.TranslateStream(pb.TranslateStreamRequest(sentence=sys.argv[2]), timeout=120):
    print("delta", flush=True)
    sys.stdin.read()  # hold the stream open until killed
"""


def test_a_client_killed_mid_stream_frees_its_row_and_its_batch_mates_finish(tiny_bundle, long_sentences, caplog):
    """In-process server whose decoder steps are slowed by 5 ms (a test hook, in Python and in the library),
    so that the killed clients' rows are still decoding when their processes die."""
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                       max_decoding_length=256))
    engine = server.running.engine
    step, steps = engine.tr._step, engine.tr.decode_greedy_steps

    def slow_step(state, k, *whole):
        time.sleep(0.005)
        return step(state, k, *whole)

    def slow_steps(state, n, *args):  # one step a call, as slow
        time.sleep(0.005)
        return steps(state, 1, *args)

    engine.tr._step, engine.tr.decode_greedy_steps = slow_step, slow_steps
    try:
        alone = _translate(server.target, long_sentences)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            mates = pool.submit(_translate, server.target, long_sentences)
            clients = [subprocess.Popen([sys.executable, "-c", CLIENT, server.target, s], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True) for s in long_sentences[:4]]
            for client in clients:
                assert client.stdout.readline() == "delta\n"  # its row is in the running batch, decoding
            running = engine.stats()["running"]
            for client in clients:
                client.kill()
                client.wait()
            assert mates.result(timeout=120) == alone  # OK, and exactly the tokens they get alone
        assert running >= 5, running  # the killed clients' rows were decoding beside their batch-mates
        wait_engine_idle(engine, 20)
        assert engine.stats()["running"] == engine.stats()["waiting"] == 0
        [model] = server.running.models
        cancelled = server.running.servicer.metrics.registry.get_sample_value("nmtserve_cancelled_sentences_total",
                                                                              {"model": model, "mode": "greedy",
                                                                               "reason": "cancelled"})
        assert cancelled >= 1, cancelled
    finally:
        server.stop()
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")]


def test_a_stream_never_read_finishes_in_the_engine_and_frees_its_row(server, long_sentences):
    finished_before = server.metric("nmtserve_sentences_total")
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        streams = [stub.TranslateStream(pb.TranslateStreamRequest(sentence=s), timeout=120) for s in long_sentences]
        deadline = time.monotonic() + 60
        while server.metric("nmtserve_sentences_total") < finished_before + len(streams) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.metric("nmtserve_sentences_total") == finished_before + len(streams)
        assert server.wait_idle()  # no row held for a reader that never comes
        assert _translate(server.target, long_sentences[:1])  # and the server still serves
        for stream in streams:
            stream.cancel()
    assert server.wait_idle()


def test_a_response_too_large_to_send_fails_alone_with_its_sizes(tiny_bundle, caplog):
    """A response over --max-message-bytes would fail in grpc's write (logged there as an error, after the
    call was counted OK). Here: 8 sentences in one call make a response over 200 bytes, one sentence
    fits; a stream's messages cannot fit 30 bytes. Each call too large gets RESOURCE_EXHAUSTED naming the
    sizes, its batch-mates get their translations, and every row is freed."""
    def expect_too_large(call) -> str:
        with pytest.raises(grpc.RpcError) as failure:
            call()
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, failure.value
        return failure.value.details()

    one = ["The cat sleeps."]
    for limit in (200, 30):
        server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                           max_message_bytes=limit))
        try:
            stub = pb_grpc.TranslationServiceStub(server.channel())
            if limit == 200:
                alone = _translate(server.target, one)
                with concurrent.futures.ThreadPoolExecutor(5) as pool:
                    big = pool.submit(expect_too_large, lambda: stub.Translate(
                        pb.TranslateRequest(sentences=one * 8), timeout=60))
                    mates = [pool.submit(_translate, server.target, one) for _ in range(4)]
                    assert [m.result(60) for m in mates] == [alone] * 4
                    message = big.result(60)
            else:
                message = expect_too_large(lambda: list(stub.TranslateStream(
                    pb.TranslateStreamRequest(sentence="The cat sleeps."), timeout=60)))
            assert f"bytes, over the server's message limit of {limit} (--max-message-bytes)" in message, message
            registry = server.running.servicer.metrics.registry
            rpc = "Translate" if limit == 200 else "TranslateStream"
            [model] = server.running.models
            assert registry.get_sample_value("nmtserve_requests_total",
                                             {"model": model, "mode": "greedy", "rpc": rpc,
                                              "code": "RESOURCE_EXHAUSTED", "client": ""}) == 1
            wait_engine_idle(server.running.engine, 20)
            assert server.running.engine.stats()["running"] == server.running.engine.stats()["waiting"] == 0
        finally:
            server.stop()
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")]


def test_sigterm_during_a_burst_finishes_or_refuses_every_call(server, long_sentences):
    def call(i: int) -> str:
        time.sleep(0.02 * i)  # calls keep arriving before, during and after the signal
        try:
            return "OK" if len(_translate(server.target, long_sentences[:2])) == 2 else "SHORT"
        except grpc.RpcError as e:
            return e.code().name

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(call, i) for i in range(48)]
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        codes = [f.result(timeout=120) for f in futures]
    assert server.proc.wait(timeout=60) == 0
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes  # finished, or refused with a code the client can retry
    assert codes.count("OK") > 0 and codes.count("UNAVAILABLE") > 0, codes


def test_sigkill_and_restart_serve_again_with_the_bundle_intact(tiny_bundle, long_sentences, tmp_path):
    workdir_before = set(os.listdir(tmp_path))
    with Server(tiny_bundle, tmp_path / "first.log") as first:
        expected = _translate(first.target, long_sentences)
        port = first.port
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_translate, first.target, long_sentences) for _ in range(8)]
            deadline = time.monotonic() + 60
            while first.metric("nmtserve_requests_running") == 0:
                assert time.monotonic() < deadline, "no request was running 60 s after the 8 calls began"
                time.sleep(0.01)
            first.proc.kill()
            outcomes = []
            for f in futures:  # every call ends, with its translations or with a status code; none hangs
                try:
                    outcomes.append("OK" if f.result(timeout=60) == expected else "WRONG")
                except grpc.RpcError as e:
                    outcomes.append(e.code().name)
        assert set(outcomes) <= {"OK", "UNAVAILABLE"} and "UNAVAILABLE" in outcomes, outcomes
    assert first.proc.returncode == -signal.SIGKILL
    load_bundle(tiny_bundle, verify_hashes=True)  # the bundle is as exported: the server writes nothing there
    with Server(tiny_bundle, tmp_path / "second.log", port=port) as second:
        with grpc.insecure_channel(second.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert _translate(second.target, long_sentences) == expected
    assert set(os.listdir(tmp_path)) - workdir_before == {"first.log", "second.log"}
