"""Shared fixtures: a small built-in corpus and a tiny trained checkpoint, made once per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from training.corpus import generate_corpus
from training.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """400 train pairs from the built-in generator, seed 7."""
    out = tmp_path_factory.mktemp("corpus")
    generate_corpus(out, 400, seed=7, valid=40, test=40, novel=20, workers=2)
    return out


def tiny_config(out: Path, data: Path | None, **overrides) -> TrainConfig:
    base = dict(out=str(out), data=str(data) if data else None, preset="tiny", vocab_size=400, max_tokens=1024, warmup=100,
                lr_factor=1.0, dropout=0.0, valid_every=100, valid_bleu_sentences=20, log_every=1, seed=3)
    return TrainConfig(**{**base, **overrides})


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_corpus, tmp_path_factory) -> Path:
    """A tiny model trained for a few seconds: enough to exercise evaluate/translate, not to translate well."""
    out = tmp_path_factory.mktemp("run")
    train(tiny_config(out, tiny_corpus, max_steps=40, valid_every=20))
    return out / "best.pt"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for servers that cannot bind port 0 themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, stdin: str | None = None, env: dict | None = None, timeout: float = 300):
    """Run `python -m nmtserve.cli ARGS` as a user would; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "nmtserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint, tmp_path_factory) -> Path:
    """A bundle (fp32 and int8) exported from the tiny checkpoint."""
    from export.exporter import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("bundle")
    export_bundle(ExportConfig(str(tiny_checkpoint), str(out), ["fp32", "int8"]))
    return out
