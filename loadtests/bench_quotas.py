"""Per-client quotas: does one API key's flood hold up another key's calls?

    nmtserve bench quotas bundles/default --max-concurrent 2 --report runs/bench/quotas.json

One `nmtserve serve BUNDLE --api-keys FILE` process whose key file has three clients: `limited` (the flood's key
under a quota: --max-concurrent calls at once, and --chars-per-minute where given), `open` (the same flood's key
without a quota) and `probe` (no quota). Each run, in this order:
- probes alone: `probes` Translate calls of one sentence with the probe's key, one after another;
- floods: `flood_clients` closed-loop clients in a process of their own send calls of `flood_sentences` sentences, and once they run the same
  probes, again and again for `seconds`; three floods, each on its own:
  - `polite`: the limited key, each refused call sent again after its retry-after (what a client library does);
  - `hostile`: the limited key, each refused call sent again at once (the worst a client can do: its refusals
    cost the server a gRPC call each, and on one machine the flooding process takes cores from the server);
  - `open`: the open key, no quota: what the server does without one.
With `limiter` (an HAProxy configuration, the deployment's deploy/kubernetes/overlays/limiter/haproxy.cfg), every
call, probes and floods, goes through HAProxy in front of the server, each client held to
`limiter_calls_per_second`; `flood_nice` runs the flooding process at that niceness, to stand in for a flooding
client on another host (on one host its own CPU is taken from the server's). Reported, as the median and min–max
over runs: the probes' p50 and p90 latency alone and under each flood, and each flood's sentences/s translated,
calls/s refused (and of those, refused by the limiter), and the cores the server, HAProxy (where it runs) and the
flooding process used (all on this host's cores: a flooding client elsewhere would take none of them). Every
probe must succeed.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.errors import NmtserveError
from nmtserve.loadtests.flood import FloodProcess, probe
from nmtserve.loadtests.limiter import Limiter
from nmtserve.loadtests.machine import describe, machine_info, thread_times
from nmtserve.loadtests.measure import percentile
from nmtserve.loadtests.workload import ServerProcess, default_sentence_file, mixed, read_sentences

# flood: (its key, whether it waits out a refusal's retry-after)
FLOODS = {"polite": ("limited", True), "hostile": ("limited", False), "open": ("open", False)}
KEYS = {"limited": "bench-key-of-the-flood-under-a-quota", "open": "bench-key-of-the-flood-without-one",
        "probe": "bench-key-of-the-probes"}


@dataclass
class QuotasBenchConfig:
    bundle: str
    sentences: str | None = None  # sentence file; default: the bundle's training data test split
    max_concurrent: int = 2  # the limited flood's quota
    chars_per_minute: int | None = None
    flood_clients: int = 16
    flood_sentences: int = 8  # per call
    probes: int = 30
    seconds: float = 15.0
    runs: int = 3
    threads: int = 1  # ONNX Runtime intra-op threads
    max_decoding_length: int = 32  # of every call, flood and probes
    limiter: str | None = None  # HAProxy configuration in front of the server
    limiter_calls_per_second: int = 300
    flood_nice: int = 0


def key_file(path: Path, cfg: QuotasBenchConfig) -> None:
    from nmtserve.server.auth import client_entry

    limits = {"max_concurrent": cfg.max_concurrent} | (
        {"chars_per_minute": cfg.chars_per_minute} if cfg.chars_per_minute else {})
    path.write_text("".join(client_entry(name, key, **(limits if name == "limited" else {}))
                            for name, key in KEYS.items()))


def _bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[name]}")]


def _cpu(pid: int) -> float:
    """Seconds a process's threads have run (Linux's scheduler statistics)."""
    times = thread_times(pid)
    if times is None:
        raise NmtserveError(f"/proc/{pid}/task/*/schedstat cannot be read: this benchmark needs Linux's scheduler "
                            "statistics")
    return sum(run for run, _wait in times.values())


def _refused_in_front(limiter: Limiter | None) -> float:
    """The calls HAProxy's gRPC and HTTP fronts have refused so far (none without a limiter)."""
    return limiter.refused("grpc", "http") if limiter else 0.0


def _probes(stub, model: str, sentences: list[str], options, seconds: float = 0.0) -> list[float]:
    """The probing key's latencies (flood.probe); a refused probe stops the bench, saying what to change."""
    import grpc

    try:
        return probe(stub, model, sentences, options, seconds, _bearer("probe"))
    except grpc.RpcError as e:
        raise NmtserveError(f"a probe call failed: {e.code().name}: {e.details()} (behind --limiter, give "
                            "--limiter-calls-per-second above the probes' calls a second)") from None


def run_quotas_bench(cfg: QuotasBenchConfig, progress: Progress) -> dict:
    from nmtserve.client import open_channel
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    pool = read_sentences(cfg.sentences or default_sentence_file(cfg.bundle))
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        keys = Path(scratch) / "keys.toml"
        key_file(keys, cfg)
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(ServerProcess(
                cfg.bundle, "--api-keys", str(keys), "--threads", str(cfg.threads), "--metrics-port", "-1",
                "--http-port", "0", log=Path(scratch) / "server.log"))
            limiter = cfg.limiter and stack.enter_context(Limiter(
                cfg.limiter, server.target, f"127.0.0.1:{server.http_port}", cfg.limiter_calls_per_second,
                log=Path(scratch) / "haproxy.log"))
            target = limiter.target if limiter else server.target
            serving = {"server": server.proc.pid} | ({"limiter": limiter.proc.pid} if limiter else {})
            channel = stack.enter_context(open_channel(target))
            stub = pb_grpc.TranslationServiceStub(channel)
            model = stub.ListModels(pb.ListModelsRequest(), metadata=_bearer("probe"), timeout=30).models[0].model
            options = pb.DecodingOptions(max_decoding_length=cfg.max_decoding_length)
            _probes(stub, model, pool[:4], options)  # warm-up: a channel's first calls
            progress.expect(cfg.runs)
            for run in range(cfg.runs):
                probes = mixed(pool, cfg.probes, seed=run)
                progress.stage(f"run {run + 1}/{cfg.runs}: probes alone, under each flood")
                cells = {"alone": _probes(stub, model, probes, options)}
                floods = {}
                for flood, (key, polite) in FLOODS.items():
                    with FloodProcess(target, model, pool, cfg.flood_clients, cfg.flood_sentences, run, options,
                                      _bearer(key), polite) as flooding:
                        os.setpriority(os.PRIO_PROCESS, flooding.process.pid, cfg.flood_nice)
                        time.sleep(min(3.0, cfg.seconds / 4))  # the process starts; its first calls fill the batch
                        start, refused, in_front, t0 = (flooding.done, flooding.rejected, _refused_in_front(limiter),
                                                        time.perf_counter())
                        processes = serving | {"flooding_process": flooding.process.pid}
                        cpu = {name: _cpu(pid) for name, pid in processes.items()}
                        cells[flood] = _probes(stub, model, probes, options, cfg.seconds)
                        elapsed = time.perf_counter() - t0
                        floods[flood] = {
                            "sentences_per_s": (flooding.done - start) / elapsed,
                            "refused_calls_per_s": (flooding.rejected - refused) / elapsed,
                            "refused_in_front_per_s": (_refused_in_front(limiter) - in_front) / elapsed,
                            **{f"{name}_cores": (_cpu(pid) - cpu[name]) / elapsed for name, pid in processes.items()}}
                    if flooding.errors:
                        raise NmtserveError(f"{len(flooding.errors)} flood call(s) failed, e.g. {flooding.errors[0]}")
                row = {}
                for cell, latencies in cells.items():
                    row[f"probe_{cell}_p50_ms"] = percentile(latencies, 50) * 1e3
                    row[f"probe_{cell}_p90_ms"] = percentile(latencies, 90) * 1e3
                for flood, figures in floods.items():
                    row |= {f"flood_{flood}_{name}": value for name, value in figures.items()}
                runs.append(row)
    results = {key: {"median": round(statistics.median(r[key] for r in runs), 2),
                     "min": round(min(r[key] for r in runs), 2), "max": round(max(r[key] for r in runs), 2)}
               for key in runs[0]}
    alone = results["probe_alone_p50_ms"]["median"]
    ratios = {f"probe p50 under the {flood} flood/alone": round(results[f"probe_{flood}_p50_ms"]["median"] / alone, 2)
              for flood in FLOODS}
    return {"bundle": cfg.bundle, "model": model, "quota": {"max_concurrent": cfg.max_concurrent,
                                                            "chars_per_minute": cfg.chars_per_minute},
            "flood_clients": cfg.flood_clients, "flood_sentences_per_call": cfg.flood_sentences, "probes": cfg.probes,
            "threads": cfg.threads, "runs": cfg.runs, "flood_nice": cfg.flood_nice,
            "limiter": cfg.limiter and {"config": cfg.limiter, "calls_per_second": cfg.limiter_calls_per_second},
            "machine": machine_info(), "results": results, "ratios": ratios}


def format_table(report: dict) -> str:
    quota = report["quota"]
    limits = f"max_concurrent {quota['max_concurrent']}" + (
        f", chars_per_minute {quota['chars_per_minute']}" if quota["chars_per_minute"] else "")
    lines = [describe(report["machine"]),
             f"one server ({report['model']}, {report['threads']} ORT thread(s)); a flood of {report['flood_clients']} "
             f"clients × {report['flood_sentences_per_call']} sentences with one key, limited ({limits}: polite, hostile) "
             "or open; "
             f"another key probes one sentence at a time; median [min–max] of {report['runs']} runs"]
    if report["limiter"]:
        lines.append(f"every call through HAProxy ({report['limiter']['config']}), "
                     f"{report['limiter']['calls_per_second']} calls a second per client")
    if report["flood_nice"]:
        lines.append(f"the flooding process at nice {report['flood_nice']}")
    for key, cell in report["results"].items():
        lines.append(f"{key:<42}{cell['median']:>10,.2f} [{cell['min']:,.2f}–{cell['max']:,.2f}]")
    lines += [f"{name}: {value:.2f}" for name, value in report["ratios"].items()]
    return "\n".join(lines)
