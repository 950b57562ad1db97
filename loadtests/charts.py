"""What every chart the project draws shares: the host in the title, legends outside the axes (they never cover
data), missing data as gaps (NaN, never 0), and one way to save. The charts themselves live beside the reports
they draw (report.py for load tests, soak.py, bench_offline.py, bench_served.py), each as a function that returns
its Figure (the tests read the plotted data back) and one that saves it."""

from __future__ import annotations

import math
from pathlib import Path

LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0, "fontsize": 8}


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def host(machine: dict | None) -> str:
    """"AMD EPYC (family 25, model 17), 2 cores, avx512f avx512_vnni": what a chart's title says of its host."""
    if not machine:
        return "host not recorded"
    family = f" ({machine['cpu_family']})" if machine.get("cpu_family") else ""
    cores = f", {machine['usable_cores']} cores" if machine.get("usable_cores") else ""
    flags = [f for f in machine.get("cpu_flags", []) if f in ("avx2", "avx512f", "avx512_vnni", "amx_int8")]
    gpu = f", {machine['gpu'].split(',')[0]}" if machine.get("gpu") else ""
    return f"{machine.get('cpu', '?')}{family}{cores}{gpu}" + (f", {' '.join(flags)}" if flags else "")


def legend_outside(*axes) -> None:
    """One legend for the given axes (twins share it), to the right of the first: it never covers data (past a
    twin's axis, its tick labels neither)."""
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        axes[0].legend(handles, labels, **{**LEGEND, "bbox_to_anchor": (1.12 if len(axes) > 1 else 1.01, 1.0)})


def gap(value: float | None) -> float:
    """A measured value, or NaN where nothing was measured (matplotlib leaves a gap there)."""
    return math.nan if value is None else float(value)


def save(fig, path: str | Path, dpi: int = 100) -> Path:
    """Write the figure (legends outside the axes included) and let go of it."""
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return Path(path)
