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
Reported, as the median and min–max over runs: the probes' p50 and p90 latency alone and under each flood, and each
flood's sentences/s translated, calls/s refused, and the cores the server and the flooding process used (all on
this host's cores: a flooding client elsewhere would take none of them). Every probe must succeed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.errors import NmtserveError
from nmtserve.loadtests.flood import FloodProcess, probe
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


def run_quotas_bench(cfg: QuotasBenchConfig, progress: Progress) -> dict:
    from nmtserve.client import open_channel
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    pool = read_sentences(cfg.sentences or default_sentence_file(cfg.bundle))
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        keys = Path(scratch) / "keys.toml"
        key_file(keys, cfg)
        with ServerProcess(cfg.bundle, "--api-keys", str(keys), "--threads", str(cfg.threads), "--metrics-port", "-1",
                           log=Path(scratch) / "server.log") as server, open_channel(server.target) as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            model = stub.ListModels(pb.ListModelsRequest(), metadata=_bearer("probe"), timeout=30).models[0].model
            options = pb.DecodingOptions(max_decoding_length=cfg.max_decoding_length)
            probe(stub, model, pool[:4], options, metadata=_bearer("probe"))  # warm-up: a channel's first calls
            progress.expect(cfg.runs)
            for run in range(cfg.runs):
                probes = mixed(pool, cfg.probes, seed=run)
                progress.stage(f"run {run + 1}/{cfg.runs}: probes alone, under each flood")
                cells = {"alone": probe(stub, model, probes, options, metadata=_bearer("probe"))}
                floods = {}
                for flood, (key, polite) in FLOODS.items():
                    with FloodProcess(server.target, model, pool, cfg.flood_clients, cfg.flood_sentences, run, options,
                                      _bearer(key), polite) as flooding:
                        time.sleep(min(3.0, cfg.seconds / 4))  # the process starts; its first calls fill the batch
                        start, refused, t0 = flooding.done, flooding.rejected, time.perf_counter()
                        cpu = _cpu(server.proc.pid), _cpu(flooding.process.pid)
                        cells[flood] = probe(stub, model, probes, options, cfg.seconds, _bearer("probe"))
                        elapsed = time.perf_counter() - t0
                        floods[flood] = ((flooding.done - start) / elapsed, (flooding.rejected - refused) / elapsed,
                                         (_cpu(server.proc.pid) - cpu[0]) / elapsed,
                                         (_cpu(flooding.process.pid) - cpu[1]) / elapsed)
                    if flooding.errors:
                        raise NmtserveError(f"{len(flooding.errors)} flood call(s) failed, e.g. {flooding.errors[0]}")
                row = {}
                for cell, latencies in cells.items():
                    row[f"probe_{cell}_p50_ms"] = percentile(latencies, 50) * 1e3
                    row[f"probe_{cell}_p90_ms"] = percentile(latencies, 90) * 1e3
                for flood, (done, refused, server_cores, flood_cores) in floods.items():
                    row[f"flood_{flood}_sentences_per_s"] = done
                    row[f"flood_{flood}_refused_calls_per_s"] = refused
                    row[f"flood_{flood}_server_cores"] = server_cores
                    row[f"flood_{flood}_flooding_process_cores"] = flood_cores
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
            "threads": cfg.threads, "runs": cfg.runs, "machine": machine_info(), "results": results, "ratios": ratios}


def format_table(report: dict) -> str:
    quota = report["quota"]
    limits = f"max_concurrent {quota['max_concurrent']}" + (
        f", chars_per_minute {quota['chars_per_minute']}" if quota["chars_per_minute"] else "")
    lines = [describe(report["machine"]),
             f"one server ({report['model']}, {report['threads']} ORT thread(s)); a flood of {report['flood_clients']} "
             f"clients × {report['flood_sentences_per_call']} sentences with one key, limited ({limits}: polite, hostile) "
             "or open; "
             f"another key probes one sentence at a time; median [min–max] of {report['runs']} runs"]
    for key, cell in report["results"].items():
        lines.append(f"{key:<42}{cell['median']:>10,.2f} [{cell['min']:,.2f}–{cell['max']:,.2f}]")
    lines += [f"{name}: {value:.2f}" for name, value in report["ratios"].items()]
    return "\n".join(lines)
