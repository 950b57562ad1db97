"""What load tests send and whom they send it to: sentences with a realistic length mix, and a
`nmtserve serve` subprocess on loopback. Torch-free (locust workers import it).
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from nmtserve.errors import ConfigError

DEFAULT_BUNDLE = Path("bundles/default")  # where `make demo` puts it, relative to the working directory

# (end of stage as a share of --scenario-seconds, users as a share of --peak-users)
SCENARIOS = {
    "steady": [(1.0, 1.0)],
    "step": [(0.25, 0.25), (0.5, 0.5), (0.75, 0.75), (1.0, 1.0)],
    "spike": [(0.4, 0.25), (0.6, 1.0), (1.0, 0.25)],
    "overload": [(0.2, 1.0), (1.0, 4.0)],  # 4× the peak: past the server's queue, RESOURCE_EXHAUSTED expected
}


def read_sentences(path: str | Path) -> list[str]:
    """Source sentences: the first column of a .tsv file, or every line of any other text file."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such sentence file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    column = (lambda line: line.split("\t", 1)[0]) if path.suffix == ".tsv" else (lambda line: line)
    sentences = [column(line).strip() for line in lines]
    sentences = [s for s in sentences if s]
    if not sentences:
        raise ConfigError(f"{path}: no sentence in it")
    return sentences


def sentence_files(value: str) -> dict[str, str]:
    """--sentences-file of the load tests: FILE (for every model, key "") or MODEL=FILE pairs, comma-separated."""
    files = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        model, _, path = item.rpartition("=")
        files[model.strip()] = path.strip()
    return files


def default_sentence_file(bundle: str | Path) -> Path:
    """The test split of the data the bundle was trained on (recorded in its manifest)."""
    manifest_path = Path(bundle) / "manifest.json"
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))["source"].get("data")
    except (OSError, ValueError, KeyError):
        raise ConfigError(f"{manifest_path}: not a readable bundle manifest; give a sentence file") from None
    if not data or not (Path(data) / "test.tsv").is_file():
        raise ConfigError(f"{bundle}: its training data's test.tsv is not here ({data}); give a sentence file")
    return Path(data) / "test.tsv"


# the decoding mix of `--decoding mixed` (load tests and the served benchmark): DecodingOptions
# fields of each mode and its share of the calls; the sampled tenth half from the top 10, half by top-p
# over the whole vocabulary (whose rows the step returns whole: docs/performance-journal.md, "A sampler of the
# whole vocabulary in a shared step")
DECODING_MIX = (("greedy", {"beam_size": 1}, 0.5), ("beam", {"beam_size": 4}, 0.4),
                ("sampling", {"sampling_topk": 10}, 0.05), ("top-p", {"sampling_topk": 0, "sampling_topp": 0.9}, 0.05))


def draw_decoding(rng: random.Random) -> tuple[str, dict]:
    """A decoding mode of DECODING_MIX, drawn by its share: (mode, its DecodingOptions fields)."""
    mode, fields, _ = rng.choices(DECODING_MIX, weights=[share for *_, share in DECODING_MIX])[0]
    return mode, fields


def mixed(sentences: list[str], n: int, seed: int = 0) -> list[str]:
    """n sentences drawn (seeded) so that short, medium and long ones arrive interleaved as in traffic."""
    rng = random.Random(seed)
    return [rng.choice(sentences) for _ in range(n)]


def metric_families(url: str) -> list:
    """The metric families of one /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return list(text_string_to_metric_families(response.read().decode("utf-8")))


def scrape(url: str, wanted: dict[str, str]) -> dict[str, float]:
    """From one /metrics page, each wanted series' samples summed over their labels (models, codes, …):
    {wanted[series name]: sum}, 0 for a series the page lacks."""
    values = dict.fromkeys(wanted.values(), 0.0)
    for family in metric_families(url):
        for s in family.samples:
            if s.name in wanted:
                values[wanted[s.name]] += s.value
    return values


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for servers that cannot bind port 0 themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`nmtserve serve BUNDLE --port 0` on 127.0.0.1; `.target` once it prints its port (and `.http_port`, with
    --http-port); SIGTERM on exit."""

    def __init__(self, bundle: str | Path, *flags: str, log: str | Path | None = None, start_timeout: float = 120,
                 cwd: str | Path | None = None):
        self.log_path = Path(log) if log else None
        self.log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        cmd = [sys.executable, "-m", "nmtserve.cli", "serve", str(bundle), "--host", "127.0.0.1", "--port", "0",
               *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=cwd)
        deadline = time.monotonic() + start_timeout
        self.port, self.http_port = None, None
        while self.port is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.proc.stdout], [], [], remaining)[0]:
                self.stop()
                raise ConfigError(f"nmtserve serve {bundle}: not serving after {start_timeout:.0f} s")
            line = self.proc.stdout.readline()
            if not line:
                raise ConfigError(f"nmtserve serve {bundle} exited with {self.stop()} before serving{self._last_words()}")
            match = re.match(r"nmtserve: serving on port (\d+)(?:, HTTP on port (\d+))?", line)
            if match:
                self.port = int(match.group(1))
                self.http_port = match.group(2) and int(match.group(2))
        self.target = f"127.0.0.1:{self.port}"

    def _last_words(self) -> str:
        """The server's last line on stderr (its error), from the log: a caller's log may lie in a temporary
        folder that is gone by the time anyone reads the message."""
        lines = self.log_path.read_text(errors="replace").split("\n") if self.log_path else []
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return f": {last} (log {self.log_path})" if last else ""

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_path:
            self.log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
