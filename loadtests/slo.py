"""Service-level objectives checked against a locust run's statistics (`OUT/stats_stats.csv`).

    nmtserve check-slo runs/loadtest/steady --slo loadtests/slo.toml

The SLO file is TOML with any of these keys (values in the units their names give):

    p95_latency_ms = 1500                 # Translate and TranslateStream end to end, each (and each model)
    p95_time_to_first_token_ms = 500      # TranslateStream TTFT
    max_error_rate = 0.01                 # failures / calls of every kind; RESOURCE_EXHAUSTED is counted apart
    min_throughput_rps = 5                # completed Translate + TranslateStream calls per second

Entries of a server with several models name the model, and those of a run with --decoding mixed
the decoding mode: "Translate [en-fr, beam]" (see `entry`); the objectives hold over all of them, and
`measure(stats, tag)` gives one tag's figures. Documents (TranslateText) count in the error rate only:
their latency grows with their length.
"""

from __future__ import annotations

import csv
import re
import tomllib
from pathlib import Path

from nmtserve.errors import ConfigError

OBJECTIVES = ("p95_latency_ms", "p95_time_to_first_token_ms", "max_error_rate", "min_throughput_rps")
SENTENCE_CALLS = ("Translate", "TranslateStream")  # latency and throughput objectives
CALLS = (*SENTENCE_CALLS, "TranslateText")  # every call a locust user makes
REJECTED_SUFFIX = " RESOURCE_EXHAUSTED"


def entry(kind: str, tag: str = "") -> str:
    """A locust entry's name: 'Translate', or with a tag (the model named, the decoding mode) 'Translate [en-fr, beam]'."""
    return f"{kind} [{tag}]" if tag else kind


def split_entry(name: str) -> tuple[str, str]:
    """'Translate RESOURCE_EXHAUSTED [en-fr, beam]' -> ('Translate RESOURCE_EXHAUSTED', 'en-fr, beam'); the
    inverse of entry."""
    kind, tag = re.fullmatch(r"(.*?)(?: \[(.+)\])?", name).groups()
    return kind, tag or ""


def tags(stats: dict[str, dict[str, float]]) -> list[str]:
    """The tags the entries carry (none for a one-model server decoding with its defaults)."""
    return sorted({split_entry(name)[1] for name in stats} - {""})


def load_slo(path: str | Path) -> dict[str, float]:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such SLO file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: not a TOML file ({e})") from None
    slo = {}
    for key, value in raw.items():
        if key not in OBJECTIVES:
            raise ConfigError(f"{path}: unknown objective {key!r}; choose from {', '.join(OBJECTIVES)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{path}: {key} = {value!r}: expected a non-negative number")
        slo[key] = float(value)
    if not slo:
        raise ConfigError(f"{path}: no objective in it; give any of {', '.join(OBJECTIVES)}")
    return slo


def stats_file(results: str | Path) -> Path:
    """A results directory of `nmtserve loadtest` (its stats_stats.csv) or the CSV itself."""
    path = Path(results)
    path = path / "stats_stats.csv" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{path}: no locust statistics here (expected a *_stats.csv file)")
    return path


def read_stats(path: str | Path) -> dict[str, dict[str, float]]:
    """name -> row of locust's per-entry statistics (numbers as floats): the calls' entries, over gRPC or HTTP (the
    Aggregated row left out)."""
    with open(stats_file(path), newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and ("Name" not in rows[0] or "95%" not in rows[0]):
        raise ConfigError(f"{path}: not a locust *_stats.csv file")
    out = {}
    for row in rows:
        if row.get("Type") in ("grpc", "http"):
            out[row["Name"]] = {k: number(v) for k, v in row.items() if k not in ("Type", "Name")}
    return out


def number(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return 0.0  # locust writes "N/A" for empty percentiles


def measure(stats: dict[str, dict[str, float]], tag: str | None = None) -> dict[str, float]:
    """The measured value of every objective (absent when the run had no such calls), over every
    entry or over the entries of one tag."""
    rows = [(split_entry(name), row) for name, row in stats.items()]
    rows = [(kind, row) for (kind, t), row in rows if (tag is None or t == tag) and row["Request Count"] > 0]
    calls = [row for kind, row in rows if kind in CALLS]
    sentence_calls = [row for kind, row in rows if kind in SENTENCE_CALLS]
    ttft = [row for kind, row in rows if kind == "TranslateStream TTFT"]
    rejected = sum(row["Request Count"] for kind, row in rows if kind.endswith(REJECTED_SUFFIX))
    measured = {}
    if sentence_calls:
        measured["p95_latency_ms"] = max(r["95%"] for r in sentence_calls)
        measured["min_throughput_rps"] = sum(r["Requests/s"] - r["Failures/s"] for r in sentence_calls)
    if calls:
        total = sum(r["Request Count"] for r in calls)
        measured["max_error_rate"] = sum(r["Failure Count"] for r in calls) / (total + rejected)
    if ttft:
        measured["p95_time_to_first_token_ms"] = max(r["95%"] for r in ttft)
    return measured


def check(slo: dict[str, float], stats: dict[str, dict[str, float]]) -> list[str]:
    """One message per violated objective, naming it, the measured value and the bound."""
    measured = measure(stats)
    violations = []
    for key, bound in slo.items():
        if key not in measured:
            violations.append(f"{key}: not measured (the run has no such calls)")
            continue
        value = measured[key]
        broken = value < bound if key.startswith("min_") else value > bound
        if broken:
            relation = "below the minimum" if key.startswith("min_") else "above the limit"
            violations.append(f"{key}: measured {value:.4g}, {relation} {bound:g}")
    return violations


def verdict(slo: dict[str, float] | None, stats: dict[str, dict[str, float]]) -> tuple[list[str], bool]:
    """Printable lines (measured values, then one per violated objective) and whether all were met."""
    measured = measure(stats)
    lines = ["measured: " + ", ".join(f"{k} {v:.4g}" for k, v in measured.items())]
    violations = check(slo, stats) if slo else []
    lines += [f"SLO violated: {v}" for v in violations]
    return lines, not violations
