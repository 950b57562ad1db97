"""ServerConfig: every `nmtserve serve` flag, also settable as an NMTSERVE_* environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from nmtserve.errors import ConfigError


@dataclass
class ServerConfig:
    bundle: str = ""  # one or more bundle directories (NMTSERVE_BUNDLE: comma-separated)
    models: str = ""  # a TOML file naming the models to serve (server/models.py)
    host: str = "[::]"
    port: int = 50051
    metrics_port: int = 9090  # Prometheus /metrics on its own HTTP port; -1 turns it off
    batching: str = "continuous"  # or "static", for comparison
    variant: str = ""  # "": fp32 on cpu, fp16 on cuda (default_variant)
    device: str = "cpu"
    io_binding: str = "auto"  # on: K/V caches stay on the device as OrtValues (IOBinding); auto = on for cuda
    attention_kernel: str = "auto"  # nmtserve's decoding kernels (export/runtime/kernels.py); auto: on a CPU when built
    threads: int = 2  # ONNX Runtime intra-op threads (sessions never spin): the deployment's CPU request
    inter_threads: int = 1  # running batches per model (engines), each on a thread of its own with `threads` intra-op threads
    max_running_rows: int = 64
    admit_rows: int = 8  # continuous batching: newcomers join once this many of their rows wait and are free (≤ 1/8 of the rows) …
    admit_steps: int = 4  # … or this many decoder steps after the latest admission
    max_burst_steps: int = 16  # greedy steps run at once in nmtserve's library when no one joins (1: one at a time)
    max_batch_tokens: int = 16384
    max_waiting: int = 256
    max_sentences: int = 64
    max_sentence_chars: int = 1000
    max_text_chars: int = 20000  # one text of TranslateText(Stream): split into sentences by the server
    max_call_chars: int = 100000  # all texts of one TranslateText call
    max_output_tokens: int = 256
    stream_interval: int = 1  # TranslateStream: a delta once this many tokens have come since the last one
    max_beam_size: int = 8  # a beam takes beam_size rows of the running batch: lowered to max_running_rows
    drain_timeout: float = 30.0
    max_message_bytes: int = 4 * 1024 * 1024
    tls_cert: str = ""  # PEM certificate chain; with tls_key, the port speaks TLS
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM roots; when set, clients must present a certificate they sign (mutual TLS)


def env_name(field_name: str) -> str:
    return "NMTSERVE_" + field_name.upper()


def defaults_from_env(environ=os.environ) -> dict:
    """Field values given as NMTSERVE_* variables, converted to the field's type."""
    values = {}
    for f in fields(ServerConfig):
        raw = environ.get(env_name(f.name))
        if raw is None:
            continue
        kind = type(getattr(ServerConfig(), f.name))
        try:
            values[f.name] = kind(raw)
        except ValueError:
            raise ConfigError(f"{env_name(f.name)}={raw!r}: expected {kind.__name__}") from None
    return values
