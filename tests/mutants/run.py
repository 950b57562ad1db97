"""make mutations: each mutant of mutants.py applied (sitecustomize.py, in every process the tests start), and the tests
that guard against it run: each must fail. Prints a line per mutant and test; exit 1 if a mutant survives a test.
Run also without a mutant first: the same tests must pass on the code as it is.

    .venv/bin/python tests/mutants/run.py [MUTANT ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from mutants import MUTANTS  # noqa: E402


def pytest(tests: list[str], mutant: str | None) -> tuple[int, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("NMTSERVE_MUTANT", None)
    if mutant:
        env["NMTSERVE_MUTANT"] = mutant
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], env=env,
                          cwd=HERE.parents[1], capture_output=True, text=True)
    return done.returncode, time.monotonic() - started


def main(names: list[str]) -> int:
    names = names or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        print(f"unknown mutants: {', '.join(unknown)}; choose from {', '.join(MUTANTS)}")
        return 2
    survived = 0
    for name in names:
        for test in MUTANTS[name]["tests"]:
            clean, _ = pytest([test], None)
            broken, seconds = pytest([test], name)
            if clean != 0:
                print(f"{name}: {test} fails on the code as it is (exit {clean}): fix it first")
                survived += 1
            elif broken == 0:
                print(f"{name}: SURVIVED {test}")
                survived += 1
            else:
                print(f"{name}: caught by {test} ({seconds:.0f} s)")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
