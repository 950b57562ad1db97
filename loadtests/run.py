"""`nmtserve loadtest`: start a server on loopback (unless --server is given), run one scenario
headless with locust for a bounded time, over gRPC or (--protocol http) the HTTP/JSON front, and write
its results:

    OUT/stats_stats.csv, stats_stats_history.csv, stats_failures.csv, stats_exceptions.csv   locust's CSV
    OUT/report.html                                                                           locust's report
    OUT/chart.png                            throughput and latency percentiles over time and over users
    OUT/server.log                           the started server's log (one JSON line per RPC)

Exit status 1 when a call failed unexpectedly (RESOURCE_EXHAUSTED is expected and counted apart)
or, with --slo, when an objective is violated.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.errors import ConfigError, NmtserveError
from nmtserve.loadtests import slo as slo_check
from nmtserve.loadtests.charts import host
from nmtserve.loadtests.machine import machine_info
from nmtserve.loadtests.report import plot
from nmtserve.loadtests.workload import (
    DEFAULT_BUNDLE,
    SCENARIOS,
    ServerProcess,
    default_sentence_file,
    free_port,
    metric_families,
    scrape,
    sentence_files,
)
from nmtserve.server.config import ServerConfig
from nmtserve.server.models import model_specs

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# the overload scenario meets a server with a short queue, so that 4× the peak users exceed it
OVERLOAD_SERVER_FLAGS = ["--max-running-rows", "16", "--max-waiting", "16"]


@dataclass
class LoadTestConfig:
    scenario: str = "steady"
    bundle: str = str(DEFAULT_BUNDLE)  # comma-separated: a server of several models
    server: str = ""  # HOST:PORT of a running server; empty: start one on loopback
    peak_users: int = 32
    seconds: float = 60.0
    out: str = ""  # default runs/loadtest/<scenario>
    sentences: str = ""  # FILE, or MODEL=FILE pairs, comma-separated
    slo: str = ""
    think_time: float = 0.0
    server_flags: list[str] = field(default_factory=list)
    decoding: str = "default"  # or "mixed": 50% greedy, 40% beam 4, 10% sampled calls
    metrics_url: str = ""  # with server: its /metrics, for where a call's time went (a started server's is known)
    protocol: str = "grpc"  # or "http": the HTTP/JSON front (server: its URL, http://HOST:PORT)
    workers: int = 0  # above 0: locust's distributed mode, a master and this many worker processes
    api_key: str = ""  # for a server with --api-keys


def run_loadtest(cfg: LoadTestConfig) -> int:
    if cfg.scenario not in SCENARIOS:
        raise ConfigError(f"--scenario {cfg.scenario!r}: choose from {', '.join(SCENARIOS)}")
    if cfg.protocol not in ("grpc", "http"):
        raise ConfigError(f"--protocol {cfg.protocol!r}: grpc or http")
    if cfg.workers < 0:
        raise ConfigError(f"--workers {cfg.workers}: 0 (one locust process) or more")
    if cfg.peak_users < 1 or cfg.seconds <= 0:
        raise ConfigError(f"--peak-users {cfg.peak_users} / --seconds {cfg.seconds}: must be positive")
    objectives = slo_check.load_slo(cfg.slo) if cfg.slo else None  # a bad SLO file fails before the run
    out = Path(cfg.out or Path("runs") / "loadtest" / cfg.scenario)
    out.mkdir(parents=True, exist_ok=True)
    sentences = ",".join(f"{model}={path}" if model else path for model, path in _sentence_files(cfg).items())
    server, metrics_url = None, cfg.metrics_url
    if not cfg.server:
        metrics_port, http_port = free_port(), free_port()
        flags = ["--metrics-port", str(metrics_port), "--access-log", "on"] \
            + (OVERLOAD_SERVER_FLAGS if cfg.scenario == "overload" else []) \
            + (["--http-port", str(http_port)] if cfg.protocol == "http" else []) + cfg.server_flags
        server = ServerProcess(cfg.bundle, *flags, log=out / "server.log")
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    target = cfg.server or (f"http://127.0.0.1:{http_port}" if cfg.protocol == "http" else server.target)
    before = scrape(metrics_url, TIMES) if metrics_url else None
    after, models = None, ""
    try:
        # what every locust process's users read (the workers' too); the shape, statistics and reports are the master's
        users = ["-f", str(LOCUSTFILE), "--host", target, "--sentences-file", sentences, "--think-time",
                 str(cfg.think_time), "--decoding", cfg.decoding, "--protocol", cfg.protocol, "--loglevel", "WARNING"]
        cmd = [sys.executable, "-m", "locust", *users, "--headless",
               "--scenario", cfg.scenario, "--peak-users", str(cfg.peak_users), "--scenario-seconds", str(cfg.seconds),
               "--csv", str(out / "stats"), "--csv-full-history", "--html", str(out / "report.html"),
               "--stop-timeout", "10", "--only-summary"]  # the shape ends the run; the timeout below bounds it
        workers = []
        if cfg.workers:  # locust's distributed mode: a master that runs the shape, N worker processes with the users
            port = free_port()
            cmd += ["--master", "--expect-workers", str(cfg.workers), "--master-bind-host", "127.0.0.1",
                    "--master-bind-port", str(port)]
            workers = [[sys.executable, "-m", "locust", *users, "--worker", "--master-host", "127.0.0.1",
                        "--master-port", str(port)]] * cfg.workers
        print(f"nmtserve loadtest: {cfg.scenario} against {target} ({cfg.protocol}), peak {cfg.peak_users} users, "
              f"{cfg.seconds:g} s" + (f", {cfg.workers} locust workers" if cfg.workers else ""), flush=True)
        env = {**os.environ, "NMTSERVE_API_KEY": cfg.api_key} if cfg.api_key else None  # not on the command line
        with subprocess.Popen(cmd, env=env) as locust, contextlib.ExitStack() as stack, \
                Progress(f"loadtest {cfg.scenario}", total=round(cfg.seconds), unit="second") as progress:
            for worker in workers:
                stack.enter_context(_Worker(worker, env))
            started = time.monotonic()
            while locust.poll() is None:
                if time.monotonic() - started > cfg.seconds + 120:
                    locust.kill()
                    raise NmtserveError(f"locust did not end {cfg.seconds + 120:g} s after it started; see its output above")
                time.sleep(1.0)
                progress.reach(min(round(cfg.seconds), round(time.monotonic() - started)))
        if metrics_url:
            after, models = scrape(metrics_url, TIMES), served_models(metrics_url)
    finally:
        if server is not None:
            server.stop()
    if not (out / "stats_stats.csv").is_file():
        raise ConfigError(f"locust wrote no statistics (exit {locust.returncode}); see its output above")
    title = (f"nmtserve loadtest {cfg.scenario} over {cfg.protocol}: peak {cfg.peak_users} users, {cfg.seconds:g} s, "
             f"{cfg.decoding} decoding, "
             f"against {models or target}\n{host(machine_info())}")
    plot(out / "stats_stats_history.csv", out / "chart.png", title)
    stats = slo_check.read_stats(out / "stats_stats.csv")
    print(summary(stats))
    lines, met = slo_check.verdict(objectives, stats)
    print("\n".join(lines))
    if before is not None and after is not None:
        print(bottleneck(before, after, stats, met))
    failures = sum(row["Failure Count"] for row in stats.values())
    status = 0
    if not any(row["Request Count"] for name, row in stats.items() if slo_check.split_entry(name)[0] in slo_check.CALLS):
        print("nmtserve loadtest: no call completed")
        status = 1
    if failures:
        print(f"nmtserve loadtest: {failures:.0f} unexpected failures (see {out / 'stats_failures.csv'})")
        status = 1
    status = status or (0 if met else 1)
    print(f"results in {out}: stats_stats.csv, report.html, chart.png")
    return status


class _Worker:
    """A locust worker process for the run's length: it ends when the master does (or is stopped then)."""

    def __init__(self, cmd: list[str], env: dict | None):
        self.process = subprocess.Popen(cmd, env=env)

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _sentence_files(cfg: LoadTestConfig) -> dict[str, str]:
    """--sentences, completed with each bundle's test split for the models it names no file for (the
    text of a single bundle goes to any model, as to a --server started elsewhere)."""
    files = sentence_files(cfg.sentences)
    if "" not in files:
        specs = model_specs(ServerConfig.from_flags(bundle=cfg.bundle))
        for spec in specs:
            if spec.id not in files:
                files[spec.id if len(specs) > 1 else ""] = str(default_sentence_file(spec.bundle))
    return files


# the server's series that say where a sentence's time went, summed over models and modes (workload.scrape)
TIMES = {"nmtserve_request_queue_seconds_sum": "queue_s", "nmtserve_request_queue_seconds_count": "queued",
         "nmtserve_request_duration_seconds_sum": "total_s", "nmtserve_request_duration_seconds_count": "sentences"}


def served_models(metrics_url: str) -> str:
    """"en-fr (int8 on cpu), fr-en (fp32 on cpu)": the models a server serves, from its nmtserve_model_info."""
    return ", ".join(f"{s.labels['model']} ({s.labels.get('variant', '?')} on {s.labels.get('device', '?')})"
                     for family in metric_families(metrics_url) if family.name == "nmtserve_model" for s in family.samples)


def bottleneck(before: dict, after: dict, stats: dict, met: bool) -> str:
    """Where a call's time went in the run, from the server's metrics before and after it and locust's mean call
    latency: waiting for room in the running batch, decoding, or outside the server (the client's own process and
    the network, as a saturated load generator shows). The largest share is the bottleneck."""
    sentences = after["sentences"] - before["sentences"]
    calls = [row for name, row in stats.items() if slo_check.split_entry(name)[0] == "Translate"]
    count = sum(row["Request Count"] for row in calls)
    if sentences <= 0 or not count:
        return "where the time went: the server finished no sentence, or locust completed no Translate call"
    queue = 1000 * (after["queue_s"] - before["queue_s"]) / max(1.0, after["queued"] - before["queued"])
    total = 1000 * (after["total_s"] - before["total_s"]) / sentences
    call = sum(row["Average Response Time"] * row["Request Count"] for row in calls) / count
    shares = {"waiting for room in the running batch (more replicas or --max-running-rows)": queue,
              "decoding (a faster variant such as int8, more threads or engines)": max(0.0, total - queue),
              "outside the server: the load generator or the network (more locust workers)": max(0.0, call - total)}
    worst = max(shares, key=shares.get)
    verdict = "the SLO failed; the bottleneck: " if not met else "the largest share: "
    return (f"where the time went, per Translate call of {call:.1f} ms on average: queue {queue:.1f} ms, decoding "
            f"{max(0.0, total - queue):.1f} ms, outside the server {max(0.0, call - total):.1f} ms; {verdict}{worst}")


def summary(stats: dict) -> str:
    """Locust's entries (a model's and a decoding mode's own when tagged), then each tag's measured objectives."""
    lines = [f"{'entry':<48}{'count':>8}{'fail':>6}{'req/s':>8}{'p50 ms':>8}{'p95 ms':>8}{'p99 ms':>8}"]
    for name, row in sorted(stats.items(), key=lambda item: slo_check.split_entry(item[0])[::-1]):
        lines.append(f"{name:<48}{row['Request Count']:>8.0f}{row['Failure Count']:>6.0f}{row['Requests/s']:>8.1f}"
                     f"{row['50%']:>8.0f}{row['95%']:>8.0f}{row['99%']:>8.0f}")
    for tag in slo_check.tags(stats):
        measured = slo_check.measure(stats, tag)
        lines.append(f"[{tag}] " + ", ".join(f"{k} {v:.4g}" for k, v in measured.items()))
    return "\n".join(lines)
