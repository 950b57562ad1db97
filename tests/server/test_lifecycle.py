"""`nmtserve serve` as a process: SIGTERM drains in-flight requests to completion and exits 0."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import grpc

from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.conftest import ROOT
from training.data import read_tsv


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_bundle, tiny_corpus):
    sentences = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:8]
    proc = subprocess.Popen([sys.executable, "-m", "nmtserve.cli", "serve", str(tiny_bundle), "--host", "127.0.0.1",
                             "--port", "0", "--max-running-rows", "4", "--drain-timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "NMTSERVE_MAX_OUTPUT_TOKENS": "128"})
    try:
        line = proc.stdout.readline()
        assert "serving on port" in line, proc.stderr.read()
        target = f"127.0.0.1:{int(line.split()[-1])}"

        def call(_):
            with grpc.insecure_channel(target) as channel:
                r = pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=sentences), timeout=60)
                return len(r.translations)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, i) for i in range(6)]
            time.sleep(0.3)  # let them arrive; 4 running rows make the rest queue
            in_flight = sum(not f.done() for f in futures)
            proc.send_signal(signal.SIGTERM)
            assert in_flight > 0, "the requests finished before SIGTERM: nothing was drained"
            assert [f.result(timeout=60) for f in futures] == [8] * 6  # nothing accepted is dropped
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
