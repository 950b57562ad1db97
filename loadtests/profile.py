"""Where a server process's CPU goes: py-spy samples its Python stacks (every thread, without pausing it) while a
load runs, and the samples are summed by thread and by the function on top of each stack (`bench served
--profile`). The folded stacks are kept as py-spy writes them, for a flame graph (flamegraph.pl, speedscope)."""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

RATE = 100  # samples a second: py-spy's nonblocking sampling keeps up at it with the server busy on both cores
TOP = 15  # functions in a summary
_LINE = re.compile(r"^thread \(\d+\): (?P<thread>[^;]*);(?P<stack>.*) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^:()]*)(?::\d+)?\)$")


def py_spy() -> str | None:
    """The py-spy executable beside this Python's (the bench extra installs it), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Sampler:
    """py-spy recording process `pid` into `path` (folded stacks, one per line with its sample count) until stop()."""

    def __init__(self, pid: int, path: Path):
        self.path, self.error = path, None
        executable = py_spy()
        if executable is None:
            self.proc, self.error = None, "py-spy is not installed (pip install 'nmtserve[bench]')"
            return
        self.proc = subprocess.Popen([executable, "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw",
                                      "--threads", "--nonblocking", "--output", str(path)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> dict:
        """Stop sampling -> summarize's summary, or {"error": what py-spy said} (no permission to attach, say)."""
        if self.proc is None:
            return {"error": self.error}
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        try:
            said, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            said, _ = self.proc.communicate()
        if not self.path.exists():
            return {"error": " ".join(said.split())[-500:] or f"py-spy exited with {self.proc.returncode}"}
        return summarize(self.path)


def summarize(path: Path, top: int = TOP) -> dict:
    """A folded-stack file's samples: each thread's share, and the functions on top of most stacks (their own
    time, where the thread was running them and not a function they called; a C call counts as its caller's), each
    with its share of all samples."""
    threads: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for line in path.read_text(encoding="utf-8").splitlines():
        found = _LINE.match(line)
        if not found:
            continue
        count = int(found["count"])
        threads[found["thread"] or "?"] += count
        frame = _FRAME.match(found["stack"].rsplit(";", 1)[-1])
        own[f"{frame['function']} ({frame['file']})" if frame else found["stack"].rsplit(";", 1)[-1]] += count
    total = sum(threads.values())
    if not total:
        return {"error": f"{path}: no samples", "file": str(path)}
    return {"file": str(path), "samples": total, "rate": RATE,
            "threads": {name: round(n / total, 4) for name, n in threads.most_common()},
            "top_own": [[name, round(n / total, 4)] for name, n in own.most_common(top)]}
