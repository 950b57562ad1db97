"""What the benchmarks share: a measurement in a process of its own (only one engine's library loaded, the math
libraries on the layout's threads), the offline worker's run, layout names and percentiles."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from nmtserve.errors import NmtserveError

CT2_ISA = "CT2_FORCE_CPU_ISA"  # CTranslate2's code path for its own kernels; unset: AVX2 on any x86 CPU that has it
CT2_LOGGED = ("Selected ISA", "Use Intel MKL", "SGEMM backend", "GEMM_S8 backend")  # its CT2_VERBOSE lines we keep


def layout_name(inter: int, intra: int, isa: str = "") -> str:
    return f"{inter}x{intra}" + (f"+{isa.lower()}" if isa else "")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def run_worker(engine: str, inter: int, threads: int, spec_path: Path, isa: str = "") -> dict:
    """`measure` in a process of its own (only `engine`'s library loaded), on the spec written at spec_path.
    A CTranslate2 worker runs at `isa` (CT2_FORCE_CPU_ISA; "" leaves the choice to CTranslate2, whatever this
    process's environment says), and its result has `ct2_logged`: what it logged of the code it chose."""
    env = {"CT2_VERBOSE": "1", CT2_ISA: isa} if engine.startswith("ct2_") else {}
    result, stderr = run_measure(["nmtserve.loadtests.bench_offline", "worker", engine], inter, threads, spec_path,
                                 f"bench worker {engine}", env)
    if env:
        result["ct2_logged"] = {key: value.strip() for key, value in re.findall(r"\] +- ([^:\n]+): (.*)", stderr)
                                if key in CT2_LOGGED}
    return result


def run_measure(module_and_args: list[str], inter: int, threads: int, spec_path: Path, what: str,
                env: dict[str, str] | None = None) -> tuple[dict, str]:
    """`python -m MODULE ARGS… INTER THREADS SPEC` in a process of its own (the math libraries on `threads`
    threads; `env` set over this process's environment, a name set to "" removed), whose last line of output
    is its JSON result: that result and its stderr; NmtserveError with the end of its stderr if it fails."""
    env = {**os.environ, **{v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
           **(env or {})}
    done = subprocess.run([sys.executable, "-m", *module_and_args, str(inter), str(threads), str(spec_path)],
                          capture_output=True, text=True, env={k: v for k, v in env.items() if v}, timeout=3600)
    if done.returncode != 0:
        raise NmtserveError(f"{what} ({layout_name(inter, threads)} threads) failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr
