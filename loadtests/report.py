"""A PNG chart of a locust run: throughput and latency percentiles over time and over users.

Reads locust's `OUT/stats_stats_history.csv` (written with --csv-full-history): one row per entry
every few seconds, with the current requests/s and the percentiles of the last 10 seconds. With
tagged entries (several models, --decoding mixed), latency lines are those of the slowest tag at
each point, and calls/s are also drawn per tag. An interval where no call had completed is a gap in the
latency lines, and a user count that completed no call has no point over users.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

from nmtserve.loadtests.charts import gap, legend_outside, pyplot, save
from nmtserve.loadtests.slo import CALLS, REJECTED_SUFFIX, number, split_entry


def read_history(path: str | Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return [row for row in csv.DictReader(f) if row.get("Type") == "grpc"]


def _percentile(row: dict, column: str) -> float | None:
    """A latency percentile of the row's last interval, None where no call of the entry had completed yet
    (locust writes "N/A", or 0 before the first call)."""
    value = number(row[column])
    return value if value > 0 and number(row.get("Total Request Count", "1")) > 0 else None


def series(rows: list[dict]) -> dict[str, list[float]]:
    """Per timestamp: users, calls/s, rejected/s, failures/s, Translate p50/p95, TTFT p95 (the slowest tag's; NaN
    where no such call had completed: a gap, never 0), and with tagged entries "calls_per_s [TAG]" for each."""
    by_time: dict[int, dict] = defaultdict(lambda: defaultdict(float))
    latency: dict[int, dict[str, float]] = defaultdict(dict)
    tags = set()
    for row in rows:
        t, (kind, tag) = int(row["Timestamp"]), split_entry(row["Name"])
        point = by_time[t]
        point["users"] = number(row["User Count"])
        if kind in CALLS:
            point["calls_per_s"] += number(row["Requests/s"])
            point["failures_per_s"] += number(row["Failures/s"])
            if tag:
                tags.add(tag)
                point[f"calls_per_s [{tag}]"] += number(row["Requests/s"])
        if kind.endswith(REJECTED_SUFFIX):
            point["rejected_per_s"] += number(row["Requests/s"])
        for entry, column, key in (("Translate", "50%", "p50_ms"), ("Translate", "95%", "p95_ms"),
                                   ("TranslateStream TTFT", "95%", "ttft_p95_ms")):
            value = _percentile(row, column) if kind == entry else None
            if value is not None:
                latency[t][key] = max(latency[t].get(key, 0.0), value)
    times = sorted(by_time)
    start = times[0] if times else 0
    keys = ("users", "calls_per_s", "rejected_per_s", "failures_per_s", *(f"calls_per_s [{tag}]" for tag in sorted(tags)))
    out = {"seconds": [t - start for t in times]}
    out.update({k: [by_time[t].get(k, 0.0) for t in times] for k in keys})
    out.update({k: [gap(latency[t].get(k)) for t in times] for k in ("p50_ms", "p95_ms", "ttft_p95_ms")})
    return out


def by_users(s: dict[str, list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Each user count that ran with completed calls: the best calls/s of its intervals and the median of their
    Translate p95 (a ramp step that never completed a call is left out)."""
    intervals: dict[float, list[tuple[float, float]]] = defaultdict(list)
    for users, rate, p95 in zip(s["users"], s["calls_per_s"], s["p95_ms"]):
        if users and rate > 0 and not math.isnan(p95):
            intervals[users].append((rate, p95))
    users = sorted(intervals)
    return (users, [max(r for r, _ in intervals[u]) for u in users],
            [sorted(p for _, p in intervals[u])[len(intervals[u]) // 2] for u in users])


def figure(rows: list[dict], title: str):
    """Throughput, latency, and both over users, from locust's history rows; legends outside the axes."""
    s = series(rows)
    fig, (ax_rate, ax_lat, ax_calls, ax_p95) = pyplot().subplots(4, 1, figsize=(10, 13))
    fig.suptitle(title, fontsize=9)
    ax_rate.plot(s["seconds"], s["calls_per_s"], linewidth=2, label="calls/s (" + " + ".join(CALLS) + ")")
    for key in (k for k in s if k.startswith("calls_per_s [")):
        ax_rate.plot(s["seconds"], s[key], linestyle=":", label=key.replace("calls_per_s", "calls/s"))
    ax_rate.plot(s["seconds"], s["rejected_per_s"], linestyle="-.", label="RESOURCE_EXHAUSTED/s")
    ax_rate.plot(s["seconds"], s["failures_per_s"], linestyle="--", label="failures/s")
    twin = ax_rate.twinx()
    twin.plot(s["seconds"], s["users"], color="grey", linestyle="--", drawstyle="steps-post", label="users (right axis)")
    twin.set_ylabel("users")
    twin.set_ylim(bottom=0, top=max(s["users"] or [1]) * 1.1)
    ax_rate.set_ylim(bottom=0)
    ax_rate.set_ylabel("per second")
    ax_rate.set_title("throughput over time", fontsize=9)
    legend_outside(ax_rate, twin)
    for key, label, style in (("p50_ms", "Translate p50", "-"), ("p95_ms", "Translate p95", "--"),
                              ("ttft_p95_ms", "TranslateStream TTFT p95", ":")):
        ax_lat.plot(s["seconds"], s[key], linestyle=style, marker=".", label=label)
    ax_lat.set_ylim(bottom=0)
    ax_lat.set_ylabel("ms (last 10 s)")
    ax_lat.set_title("latency percentiles over time (gaps: no call completed)", fontsize=9)
    legend_outside(ax_lat)
    for ax in (ax_rate, ax_lat):
        ax.set_xlabel("seconds")
    users, rates, p95s = by_users(s)
    ax_calls.plot(users, rates, marker="o", label="calls/s (best interval)")
    ax_calls.set_ylabel("calls/s")
    ax_calls.set_ylim(bottom=0)
    ax_calls.set_title("throughput over users", fontsize=9)
    ax_p95.plot(users, p95s, marker="s", color="tab:red", label="Translate p95 (median interval)")
    ax_p95.set_ylabel("p95 ms")
    ax_p95.set_ylim(bottom=0)
    ax_p95.set_title("latency over users", fontsize=9)
    for ax in (ax_calls, ax_p95):
        ax.set_xlabel("users (requests in flight)")
        ax.set_xlim(left=0)
        legend_outside(ax)
    fig.tight_layout()
    return fig


def plot(history_csv: str | Path, png: str | Path, title: str) -> Path:
    return save(figure(read_history(history_csv), title), png)
