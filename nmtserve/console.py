"""What commands print for people and machines: JSON results, and the progress of long jobs.

Progress goes to stderr: on a terminal a tqdm bar (elapsed time, rate and, where the total is known, the time
left); in CI and pipes one line when a job starts (with its first work) and one when it ends, so logs stay short.
A job that fails prints nothing more: its error is the one line that follows.

    with Progress("evaluate", total=len(pairs), unit="sentence") as bar:
        for chunk in chunks:
            ...
            bar.update(len(chunk))
"""

from __future__ import annotations

import json
import sys
import time


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def on_terminal() -> bool:
    return sys.stderr.isatty()


def duration(seconds: float) -> str:
    """4.2 s, 3 min 05 s, 1 h 02 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


class Progress:
    """A long job's progress on stderr (module docstring). `update(n)` counts work done; `note(text)` says what
    runs now (a bar shows it beside itself; lines print it, with the elapsed time and the estimate left);
    `stage(text)` does both for a job counted in stages."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", lines: bool | None = None):
        self.desc, self.total, self.unit, self.done = desc, total, unit, 0
        self.staged = False  # stage() was called: close() counts the last stage done
        self.started = time.monotonic()
        self.bar, self.announced = None, False  # lines: the start line is printed with the first work
        if (not on_terminal()) if lines is None else lines:
            return
        try:
            from tqdm import tqdm
        except ModuleNotFoundError:  # an install without tqdm prints lines
            return
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    def expect(self, total: int) -> None:
        """The total, once the job knows it."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def _announce(self) -> None:
        if self.bar is None and not self.announced:
            self.announced = True
            print(f"{self.desc}: started" + (f" ({self.total:,} {self.unit}s)" if self.total else ""), file=sys.stderr,
                  flush=True)

    def update(self, n: int = 1) -> None:
        self._announce()
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def reach(self, done: int) -> None:
        """For a job that knows how far it is rather than how much it just did: `done` in all."""
        self.update(done - self.done)

    def left(self) -> str:
        """The elapsed time, and the time left at the rate so far where the total is known."""
        elapsed = time.monotonic() - self.started
        if not (self.total and self.done):
            return duration(elapsed)
        return f"{duration(elapsed)}, about {duration(elapsed * (self.total - self.done) / self.done)} left"

    def note(self, text: str) -> None:
        self._announce()
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        else:
            print(f"{self.desc} [{self.done}/{self.total or '?'}, {self.left()}]: {text}", file=sys.stderr, flush=True)

    def stage(self, text: str) -> None:
        """For a job of stages (total: their number): the previous stage is done and `text` starts."""
        if self.staged:
            self.update()
        self.staged = True
        self.note(text)

    def close(self, failed: bool = False) -> None:
        """The end: the last stage counted and, in lines, the end line; after a failure nothing (its error follows)."""
        if self.staged and not failed:
            self.update()
        if self.bar is not None:
            self.bar.close()
        elif not failed:
            self._announce()
            print(f"{self.desc}: done, {self.done:,} {self.unit}s in {duration(time.monotonic() - self.started)}",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(failed=kind is not None)



