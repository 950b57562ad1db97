"""Helpers shared by the tests (fixtures live in the conftest.py files and use these)."""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nmtserve.server.app import start_server
from nmtserve.server.config import ServerConfig
from nmtserve.server.metrics import ServerMetrics
from nmtserve.tokenizer import StreamDecoder
from nmtserve.training.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
# the device of the IOBinding tests: ONNX Runtime's CPU provider here; NMTSERVE_TEST_DEVICE=cuda on a GPU
# machine (onnxruntime-gpu), where they run the fp16 variant (the one CUDA serves) and tiny_bundle has it
TEST_DEVICE = os.environ.get("NMTSERVE_TEST_DEVICE", "cpu")
TEST_VARIANT = "fp16" if TEST_DEVICE == "cuda" else "fp32"
# how closely the host and IOBinding paths' scores agree (fp16 on CUDA: other attention kernels, fp16 sums)
TEST_SCORE_TOLERANCE = 1e-4 if TEST_VARIANT == "fp32" else 2e-2
# the installed entry point of this environment (pip puts it beside the interpreter)
NMTSERVE = shutil.which("nmtserve", path=str(Path(sys.executable).parent)) or "nmtserve"


def tiny_config(out: Path, data: Path | None, **overrides) -> TrainConfig:
    base = dict(out=str(out), data=str(data) if data else None, preset="tiny", vocab_size=400, max_tokens=1024, warmup=100,
                lr_factor=1.0, dropout=0.0, valid_every=100, valid_bleu_sentences=20, log_every=1, seed=3)
    return TrainConfig(**{**base, **overrides})


def wait_engine_idle(engine, seconds: float = 30) -> bool:
    """Poll until the engine has nothing waiting or running (rows are freed at its next step)."""
    deadline = time.monotonic() + seconds
    while not engine.idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.idle()


def run_cli(*args: str, stdin: str | None = None, env: dict | None = None, timeout: float = 300,
            cwd: str | Path | None = None):
    """Run the installed `nmtserve ARGS` as a user would, from a fresh temporary directory unless `cwd`
    is given (so nothing in the checkout is importable by accident); returns the CompletedProcess."""
    with tempfile.TemporaryDirectory(prefix="nmtserve-cli-") as tmp:
        return subprocess.run([NMTSERVE, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or tmp, env={**os.environ, **(env or {})})


_EACH = """
import contextlib, io, json, sys
from nmtserve.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results.append([argv, code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_cli_each(*argvs: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Each argv through the CLI's main() in turn, in one fresh Python process from a fresh temporary
    directory: what `nmtserve ARGV` returns and prints, at one import of torch for them all (~3 s each
    otherwise). For lists of refusals; a CompletedProcess per argv."""
    with tempfile.TemporaryDirectory(prefix="nmtserve-cli-") as tmp:
        done = subprocess.run([sys.executable, "-c", _EACH, json.dumps([list(a) for a in argvs])], capture_output=True,
                              text=True, timeout=timeout, cwd=tmp)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return [subprocess.CompletedProcess(*r) for r in json.loads(done.stdout)]


class ServerThread:
    """start_server() on a private event loop thread; `stop()` drains it like SIGTERM does."""

    def __init__(self, config: ServerConfig, **start):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start_server(config, **start), self.loop).result(120)
        self.target = f"localhost:{self.running.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stop(self, timeout: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.running.drain_and_stop(timeout), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# labels the Prometheus Operator adds to every scraped series (plus `le` of histogram buckets)
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint", "le"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",)}


def exported_series() -> set[str]:
    """Every series name the server's registry can expose, from the collectors' names and types."""
    return {family.name + suffix for family in ServerMetrics().registry.collect() for suffix in SUFFIXES[family.type]}


def scrape(port: int) -> list:
    """The samples of a server's /metrics page, fetched over HTTP and parsed."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric(samples: list, name: str, **labels: str) -> float:
    """The sum of name's samples whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression names: the server's own, its process collector's, and the limiter overlay's
    HAProxy's."""
    return set(re.findall(r"\b((?:nmtserve|process|haproxy)_[a-z_]+)\b", expr))


def stream_decoded(decode, ids: list[int], rng: random.Random) -> tuple[str, list[int]]:
    """ids fed to a StreamDecoder in random chunks of 1-3 -> the text it emitted, and the length of every
    window it decoded; after each chunk the text so far is a prefix of the whole text."""
    windows: list[int] = []

    def counted(x):
        windows.append(len(x))
        return decode(x)
    decoder, text, i = StreamDecoder(counted), "", 0
    while i < len(ids):
        n = rng.choice([1, 1, 2, 3])
        text += decoder.add(ids[i:i + n])
        i += n
        assert decode(ids).startswith(text), (ids, text)
    return text, windows


@functools.cache
def rank(eos_id: int):
    """The ranker graph's `rank` (export/build/ranker.py), as a decoder's of a model whose eos is `eos_id`: written
    once into a temporary folder."""
    from nmtserve.export.build.ranker import write_ranker
    from nmtserve.export.runtime.ranker import Ranker

    folder = Path(tempfile.mkdtemp(prefix="nmtserve-ranker-"))
    atexit.register(shutil.rmtree, folder, True)
    return Ranker(folder / write_ranker(folder), eos_id).rank


def top_candidates(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best tokens of each row (all of them if k is 0) and their log-probs, best first, ties by lower id:
    what the decoder graph's TopK head returns. log_probs (B, V) -> ids, scores (B, k)."""
    ids = np.argsort(-log_probs, axis=1, kind="stable")[:, :k or None]
    return ids, np.take_along_axis(log_probs, ids, axis=1)


# the system tools some tests run, and the Debian package each comes from (`make tools` installs them)
SYSTEM_TOOLS = {"promtool": "prometheus", "prometheus": "prometheus", "openssl": "openssl", "g++": "g++",
                "chromium": "chromium", "chromedriver": "chromium-driver", "haproxy": "haproxy"}


def system_tool(name: str) -> str:
    """The path of a system tool a test runs. Missing: a skip, in one line naming it, where make was told not to
    install Debian packages (SYSTEM_PACKAGES=no); else a failure naming the package that `make tools` installs."""
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("NMTSERVE_SYSTEM_PACKAGES") == "no":
        pytest.skip(f"{name} is not installed and make was told SYSTEM_PACKAGES=no (Debian's {SYSTEM_TOOLS[name]})")
    pytest.fail(f"{name} is missing: `make tools` installs Debian's {SYSTEM_TOOLS[name]} package")
