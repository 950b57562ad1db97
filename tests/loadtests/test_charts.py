"""Every chart the project draws, rendered from a small fixture (a locust history written here, a soak report, the
committed benchmark reports), and its plotted data read back: no point where nothing was measured, axes that start
at 0, legends outside the axes (they cover no data), and a title naming what ran and where."""

import json
import math

import pytest
from matplotlib.transforms import Bbox

from nmtserve.loadtests import bench_offline, bench_served, report, soak
from tests.helpers import ROOT

HISTORY_HEADER = ("Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,"
                  "99.99%,100%,Total Request Count,Total Failure Count")


def _row(t: int, users: int, name: str, rate: float, p50: str, p95: str, total: int) -> str:
    return f"{t},{users},grpc,{name},{rate},0,{p50},0,0,0,0,{p95},0,0,0,0,0,{total},0"


@pytest.fixture
def history(tmp_path):
    """A ramp of 8 then 16 users: at t=0 no call has completed (locust writes N/A, or 0 with a count of 0), the
    8-user step never completes one either, then calls complete at 16 users."""
    rows = [_row(100, 0, "Translate", 0, "N/A", "N/A", 0),
            _row(101, 8, "Translate", 0, "0", "0", 0), _row(102, 8, "TranslateStream TTFT", 0, "N/A", "N/A", 0),
            _row(103, 16, "Translate", 40, "12", "30", 90), _row(104, 16, "Translate", 50, "11", "25", 140),
            _row(104, 16, "TranslateStream TTFT", 10, "3", "8", 20)]
    path = tmp_path / "stats_stats_history.csv"
    path.write_text(HISTORY_HEADER + "\n" + "\n".join(rows) + "\n")
    return report.read_history(path)


def _legends_outside(fig) -> None:
    """Each legend's box meets no axes' box: it covers no data."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends, "the chart has no legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not Bbox.intersection(box, ax.get_window_extent(renderer)), "a legend covers an axes"


def _line(ax, label: str):
    return next(line for line in ax.get_lines() if line.get_label() == label)


def test_the_load_test_chart_leaves_gaps_where_no_call_completed(history):
    fig = report.figure(history, "nmtserve loadtest steady: peak 16 users, 5 s, default decoding, against en-fr "
                                 "(fp32 on cpu)\nAMD EPYC (family 25, model 17), 2 cores")
    ax_rate, twin, ax_lat, ax_calls, ax_p95 = fig.axes[0], fig.axes[4], fig.axes[1], fig.axes[2], fig.axes[3]
    p50 = _line(ax_lat, "Translate p50").get_ydata()
    assert [math.isnan(v) for v in p50] == [True, True, True, False, False]  # t=0, the 8-user step: gaps, never 0
    assert list(p50[3:]) == [12, 11]
    assert list(_line(ax_lat, "TranslateStream TTFT p95").get_ydata()[:3]) != [0, 0, 0]
    calls = _line(ax_calls, "calls/s (best interval)")
    assert list(calls.get_xdata()) == [16] and list(calls.get_ydata()) == [50]  # no point at 8 users: nothing ran
    assert list(_line(ax_p95, "Translate p95 (median interval)").get_xdata()) == [16]
    assert twin.get_ylim()[0] == 0 and ax_rate.get_ylim()[0] == 0 and twin.get_ylabel() == "users"
    assert "peak 16 users" in fig._suptitle.get_text() and "family 25" in fig._suptitle.get_text()
    _legends_outside(fig)


def test_the_soak_chart_plots_what_was_sampled():
    samples = [[2.0, 120.0, 0, 0], [4.0, 150.5, 8, None], [6.0, 151.0, 8, 2]]  # a scrape without the gauge: a gap
    memory = {"measured": True, "warmup_seconds": 3, "first_third_median_mb": 150.5, "bound": 0.1}
    fig = soak.figure({"samples": samples, "memory": memory, "clients": 8, "seconds": 6, "server": "127.0.0.1:1",
                       "machine": {"cpu": "AMD EPYC", "cpu_family": "family 25, model 17", "usable_cores": 2}})
    ax, rows = fig.axes[0], fig.axes[1]
    assert list(_line(ax, "resident memory (MB)").get_ydata()) == [120.0, 150.5, 151.0]
    waiting = _line(rows, "waiting requests").get_ydata()
    assert waiting[0] == 0 and math.isnan(waiting[1]) and waiting[2] == 2
    assert "8 clients" in fig._suptitle.get_text() and "family 25" in fig._suptitle.get_text()
    _legends_outside(fig)


@pytest.mark.parametrize("module, name", [(bench_offline, "offline-greedy-cpu-zen5"),
                                          (bench_served, "served-greedy-int8-cpu-zen5")])
def test_the_benchmark_charts_draw_their_reports(module, name):
    """The committed reports, drawn again: every plotted value is one of the report's, and the legends sit outside."""
    data = json.loads((ROOT / "docs" / "bench" / f"{name}.json").read_text())
    fig = module.figure(data)
    title = (fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title())
    assert data["machine"]["cpu"] in title
    if module is bench_offline:
        line = fig.axes[0].get_lines()[0]
        engine = next(iter(data["best"]))
        assert list(line.get_ydata()) == [data["best"][engine][str(b)]["median"] for b in data["batch_sizes"]]
    else:
        continuous = _line(fig.axes[1], "continuous, steady state")
        cells = data["results"]["continuous"]
        assert list(continuous.get_ydata()) == [cells[c]["steady_tokens_per_s"] for c in cells]
    _legends_outside(fig)
