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


def test_every_thread_but_the_engines_yields_to_them(tiny_bundle, tmp_path):
    """`nmtserve serve` owns its process: the threads that wake for every call (the event loop, gRPC's, the hand-back
    threads, those started later) run SCHED_BATCH, which never preempts, and the two engines' decoding threads keep
    the default policy; the server serves as before."""
    proc = subprocess.Popen([NMTSERVE, "serve", str(tiny_bundle), "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", "-1", "--inter-threads", "2", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert "serving on port" in line, proc.stderr.read()
        with grpc.insecure_channel(f"127.0.0.1:{int(line.split()[-1])}") as channel:
            reply = pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=["a cat"]), timeout=60)
        assert len(reply.translations) == 1
        tasks = f"/proc/{proc.pid}/task"
        policies = {}
        for tid in os.listdir(tasks):
            with open(f"{tasks}/{tid}/comm") as comm:
                policies[int(tid)] = (comm.read().strip(), os.sched_getscheduler(int(tid)))
        decoding = {tid for tid, (_, policy) in policies.items() if policy == os.SCHED_OTHER}
        assert sorted(policies[tid][0] for tid in decoding) == ["nmtserve-engine"] * 2, policies
        assert policies[proc.pid][1] == os.SCHED_BATCH and len(policies) > 6, policies
        assert all(policy == os.SCHED_BATCH for tid, (_, policy) in policies.items() if tid not in decoding), policies
    finally:
        proc.kill()
        proc.wait()
