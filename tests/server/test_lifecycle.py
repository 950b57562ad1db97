"""`nmtserve serve` as a process: SIGTERM drains in-flight requests to completion and exits 0."""

import concurrent.futures
import os
import signal
import subprocess
import time

import grpc

from nmtserve.loadtests.workload import free_port
from nmtserve.training.data import read_tsv
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import NMTSERVE, metric, scrape


def _accepted(metrics_port: int) -> float:
    """Sentences the engine has taken: running + waiting + finished."""
    samples = scrape(metrics_port)
    return sum(metric(samples, name) for name in ("nmtserve_requests_running", "nmtserve_requests_waiting",
                                                   "nmtserve_sentences_total"))


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_bundle, tiny_corpus, tmp_path):
    # long sources: their output budget (2 × source + 10) keeps the tiny model busy for a while
    sentences = [" ".join([s] * 4) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:8]
    metrics_port = free_port()
    proc = subprocess.Popen([NMTSERVE, "serve", str(tiny_bundle), "--host", "127.0.0.1",
                             "--port", "0", "--metrics-port", str(metrics_port), "--max-running-rows", "4",
                             "--drain-timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "NMTSERVE_MAX_DECODING_LENGTH": "256"})
    try:
        line = proc.stdout.readline()
        assert "serving on port" in line, proc.stderr.read()
        target = f"127.0.0.1:{int(line.split()[-1])}"

        def call(_):
            with grpc.insecure_channel(target) as channel:
                r = pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=sentences), timeout=60)
                return len(r.translations)

        before = _accepted(metrics_port)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, i) for i in range(6)]
            # SIGTERM once every call is accepted: a call that arrives after it is refused, as it should be
            deadline = time.monotonic() + 30
            while _accepted(metrics_port) - before < 6 * len(sentences) and time.monotonic() < deadline:
                time.sleep(0.01)
            in_flight = sum(not f.done() for f in futures)
            proc.send_signal(signal.SIGTERM)
            assert in_flight > 0, "the requests finished before SIGTERM: nothing was drained"
            assert [f.result(timeout=60) for f in futures] == [8] * 6  # nothing accepted is dropped
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
