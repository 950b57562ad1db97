"""What a served call costs with nothing of nmtserve behind it: the RPC path's floor on this host.

A bare grpc.aio server (this module run as a process: `python -m nmtserve.loadtests.grpc_floor`) answers
ListModels at once with an empty message; the measuring process calls it with Python's blocking stubs on
the channel the served benchmark's clients use, as they call (`bench_served._cell`):

- one client: the p50 of a call, which every served call pays beside its translation;
- FLOOR_CLIENTS clients for a few seconds: calls/s, and the CPU a call of the server process and of the
  client, which share the host's cores with the engines when the benchmark's clients run on the server's host;
- with `rate`, the same clients paced to that many calls a second in all (a served cell's): the server's and the
  client's CPU a call at that load. An event loop below saturation wakes for fewer calls at a time, so a call
  costs it more than at the floor's own saturation: a served server is compared with the floor at its own rate too;
- with `bound_rate`, paced once more, to the calls a second of the most a server could make if its calls cost only
  the floor at its saturation (bench_served.rpc_bound): what the floor costs at that rate bounds it again, lower.

`nmtserve bench served` measures it once a run, every server idle, and sets it against the offline baseline
(bench_served._report): how close a server that cost nothing but this could come to OnnxTranslator at
one client and at saturation.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

FLOOR_CLIENTS = 64  # as a saturated cell's
ONE_CLIENT_CALLS = 1000
SATURATED_SECONDS = 2.0


def _serve() -> None:
    """The bare server, on a free loopback port it prints; ends with its standard input (its parent gone)."""
    import grpc

    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    class NoOp(pb_grpc.TranslationServiceServicer):
        async def ListModels(self, request, context):
            return pb.ListModelsResponse()

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_TranslationServiceServicer_to_server(NoOp(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(None)

    asyncio.run(main())


def grpc_floor(rate: float = 0.0, bound_rate: Callable[[dict], float] | None = None) -> dict:
    """-> p50_ms (one client), calls_per_s, server_cpu_ms and client_cpu_ms a call (FLOOR_CLIENTS clients as fast
    as they can); with `rate` (calls a second), `at_rate`: calls_per_s, server_cpu_ms and client_cpu_ms with the
    clients paced to it; with `bound_rate` (a function of the saturated measure that gives calls a second),
    `at_bound`: the same, paced to the rate it gives."""
    from nmtserve.client import open_channel
    from nmtserve.errors import NmtserveError
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    server = subprocess.Popen([sys.executable, "-m", "nmtserve.loadtests.grpc_floor"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line.strip().isdigit():
            raise NmtserveError(f"the bare grpc server for the RPC floor did not start (it printed {line!r})")
        with open_channel(f"127.0.0.1:{line.strip()}") as channel:
            call = pb_grpc.TranslationServiceStub(channel).ListModels
            for _ in range(100):  # the channel's and the server's first calls
                call(pb.ListModelsRequest())
            latencies = []
            for _ in range(ONE_CLIENT_CALLS):
                started = time.perf_counter()
                call(pb.ListModelsRequest())
                latencies.append(time.perf_counter() - started)
            floor = {"p50_ms": statistics.median(latencies) * 1e3, **_load(call, server.pid, 0.0)}
            if rate:
                floor["at_rate"] = _load(call, server.pid, rate)
            if bound_rate is not None:
                floor["at_bound"] = _load(call, server.pid, bound_rate(floor))
    finally:
        server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return floor


def _load(call, pid: int, rate: float) -> dict:
    """FLOOR_CLIENTS threads calling for SATURATED_SECONDS, each as soon as its last call returned (rate 0) or on a
    schedule of its own that makes `rate` calls a second in all -> calls_per_s, server_cpu_ms and client_cpu_ms a
    call."""
    from nmtserve.loadtests.machine import thread_times
    from nmtserve.v1 import translation_pb2 as pb

    counts, started = [0] * FLOOR_CLIENTS, time.perf_counter()
    stop, gap = started + SATURATED_SECONDS, FLOOR_CLIENTS / rate if rate else 0.0

    def client(i: int) -> None:
        due = started + gap * i / FLOOR_CLIENTS  # the clients' calls spread evenly over each gap
        while time.perf_counter() < stop:
            if gap:
                time.sleep(max(0.0, due - time.perf_counter()))
                due += gap
            call(pb.ListModelsRequest())
            counts[i] += 1

    before, client_cpu = thread_times(pid), time.process_time()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(FLOOR_CLIENTS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    seconds, client_cpu, after = time.perf_counter() - started, time.process_time() - client_cpu, thread_times(pid)
    calls = sum(counts)
    server_cpu = sum(after[kind][0] - before[kind][0] for kind in after) if before and after else None
    return {"calls_per_s": calls / seconds, "server_cpu_ms": server_cpu * 1e3 / calls if server_cpu is not None else None,
            "client_cpu_ms": client_cpu * 1e3 / calls}


if __name__ == "__main__":
    _serve()
