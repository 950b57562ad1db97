"""`nmtserve loadtest`: start a server on loopback (unless --server is given), run one scenario
headless with locust for a bounded time, and write its results:

    OUT/stats_stats.csv, stats_stats_history.csv, stats_failures.csv, stats_exceptions.csv   locust's CSV
    OUT/report.html                                                                           locust's report
    OUT/chart.png                            throughput and latency percentiles over time and over users
    OUT/server.log                           the started server's log (one JSON line per RPC)

Exit status 1 when a call failed unexpectedly (RESOURCE_EXHAUSTED is expected and counted apart)
or, with --slo, when an objective is violated.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.errors import ConfigError, NmtserveError
from nmtserve.loadtests import slo as slo_check
from nmtserve.loadtests.report import plot
from nmtserve.loadtests.workload import DEFAULT_BUNDLE, SCENARIOS, ServerProcess, default_sentence_file, sentence_files
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


def run_loadtest(cfg: LoadTestConfig) -> int:
    if cfg.scenario not in SCENARIOS:
        raise ConfigError(f"--scenario {cfg.scenario!r}: choose from {', '.join(SCENARIOS)}")
    if cfg.peak_users < 1 or cfg.seconds <= 0:
        raise ConfigError(f"--peak-users {cfg.peak_users} / --seconds {cfg.seconds}: must be positive")
    objectives = slo_check.load_slo(cfg.slo) if cfg.slo else None  # a bad SLO file fails before the run
    out = Path(cfg.out or Path("runs") / "loadtest" / cfg.scenario)
    out.mkdir(parents=True, exist_ok=True)
    sentences = ",".join(f"{model}={path}" if model else path for model, path in _sentence_files(cfg).items())
    server = None
    if not cfg.server:
        flags = ["--metrics-port", "-1"] + (OVERLOAD_SERVER_FLAGS if cfg.scenario == "overload" else []) + cfg.server_flags
        server = ServerProcess(cfg.bundle, *flags, log=out / "server.log")
    target = cfg.server or server.target
    try:
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", target,
               "--scenario", cfg.scenario, "--peak-users", str(cfg.peak_users), "--scenario-seconds", str(cfg.seconds),
               "--sentences-file", sentences, "--think-time", str(cfg.think_time),
               "--decoding", cfg.decoding,
               "--csv", str(out / "stats"), "--csv-full-history", "--html", str(out / "report.html"),
               "--stop-timeout", "10", "--only-summary",  # the shape ends the run; the timeout below bounds it
               "--loglevel", "WARNING"]
        print(f"nmtserve loadtest: {cfg.scenario} against {target}, peak {cfg.peak_users} users, {cfg.seconds:g} s",
              flush=True)
        with subprocess.Popen(cmd) as locust, \
                Progress(f"loadtest {cfg.scenario}", total=round(cfg.seconds), unit="second") as progress:
            started = time.monotonic()
            while locust.poll() is None:
                if time.monotonic() - started > cfg.seconds + 120:
                    locust.kill()
                    raise NmtserveError(f"locust did not end {cfg.seconds + 120:g} s after it started; see its output above")
                time.sleep(1.0)
                progress.update(min(round(cfg.seconds), round(time.monotonic() - started)) - progress.done)
    finally:
        if server is not None:
            server.stop()
    if not (out / "stats_stats.csv").is_file():
        raise ConfigError(f"locust wrote no statistics (exit {locust.returncode}); see its output above")
    plot(out / "stats_stats_history.csv", out / "chart.png", title=f"{cfg.scenario}: throughput over time")
    stats = slo_check.read_stats(out / "stats_stats.csv")
    print(summary(stats))
    lines, met = slo_check.verdict(objectives, stats)
    print("\n".join(lines))
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
