"""A PNG chart of a locust run: throughput and latency percentiles over time and over users.

Reads locust's `OUT/stats_stats_history.csv` (written with --csv-full-history): one row per entry
every few seconds, with the current requests/s and the percentiles of the last 10 seconds. With
tagged entries (several models, --decoding mixed), latency lines are those of the slowest tag at
each point, and calls/s are also drawn per tag.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from nmtserve.loadtests.slo import CALLS, REJECTED_SUFFIX, number, split_entry


def read_history(path: str | Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return [row for row in csv.DictReader(f) if row.get("Type") == "grpc"]


def series(rows: list[dict]) -> dict[str, list[float]]:
    """Per timestamp: users, calls/s, rejected/s, failures/s, Translate p50/p95, TTFT p95 (the slowest
    tag's), and with tagged entries "calls_per_s [TAG]" for each."""
    by_time: dict[int, dict] = defaultdict(lambda: defaultdict(float))
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
        if kind == "Translate":
            point["p50_ms"] = max(point["p50_ms"], number(row["50%"]))
            point["p95_ms"] = max(point["p95_ms"], number(row["95%"]))
        if kind == "TranslateStream TTFT":
            point["ttft_p95_ms"] = max(point["ttft_p95_ms"], number(row["95%"]))
    times = sorted(by_time)
    start = times[0] if times else 0
    keys = ("users", "calls_per_s", "rejected_per_s", "failures_per_s", "p50_ms", "p95_ms", "ttft_p95_ms",
            *(f"calls_per_s [{tag}]" for tag in sorted(tags)))
    out = {"seconds": [t - start for t in times]}
    out.update({k: [by_time[t].get(k, 0.0) for t in times] for k in keys})
    return out


def plot(history_csv: str | Path, png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = series(read_history(history_csv))
    fig, (ax_rate, ax_lat, ax_users) = plt.subplots(3, 1, figsize=(9, 10))
    ax_rate.plot(s["seconds"], s["calls_per_s"], label="calls/s (" + " + ".join(CALLS) + ")")
    for key in (k for k in s if k.startswith("calls_per_s [")):
        ax_rate.plot(s["seconds"], s[key], linestyle=":", label=key.replace("calls_per_s", "calls/s"))
    ax_rate.plot(s["seconds"], s["rejected_per_s"], label="RESOURCE_EXHAUSTED/s")
    ax_rate.plot(s["seconds"], s["failures_per_s"], label="failures/s")
    twin = ax_rate.twinx()
    twin.plot(s["seconds"], s["users"], color="grey", linestyle="--", label="users")
    twin.set_ylabel("users")
    ax_rate.set_ylabel("per second")
    ax_rate.set_title(title or "throughput over time")
    ax_rate.legend(loc="upper left", fontsize=8)
    ax_lat.plot(s["seconds"], s["p50_ms"], label="Translate p50")
    ax_lat.plot(s["seconds"], s["p95_ms"], label="Translate p95")
    ax_lat.plot(s["seconds"], s["ttft_p95_ms"], label="TranslateStream TTFT p95")
    ax_lat.set_xlabel("seconds")
    ax_lat.set_ylabel("ms (last 10 s)")
    ax_lat.set_title("latency percentiles over time")
    ax_lat.legend(loc="upper left", fontsize=8)
    by_users: dict[float, list[tuple[float, float]]] = defaultdict(list)
    for users, rate, p95 in zip(s["users"], s["calls_per_s"], s["p95_ms"]):
        if users:
            by_users[users].append((rate, p95))
    users = sorted(by_users)
    ax_users.plot(users, [max(r for r, _ in by_users[u]) for u in users], marker="o", label="calls/s (best interval)")
    ax_users.set_xlabel("users (requests in flight)")
    ax_users.set_ylabel("calls/s")
    twin = ax_users.twinx()
    twin.plot(users, [sorted(p for _, p in by_users[u])[len(by_users[u]) // 2] for u in users], marker="s",
              color="tab:red", label="Translate p95 ms (median interval)")
    twin.set_ylabel("p95 ms")
    ax_users.set_title("throughput and latency over users")
    ax_users.legend(loc="upper left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return Path(png)
