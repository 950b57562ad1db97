"""The server's configuration, one dataclass per concern, each field in one place. Every field is a `nmtserve
serve` flag of the same name (--max-running-rows for max_running_rows) and an NMTSERVE_* environment variable
(NMTSERVE_MAX_RUNNING_ROWS); `ServerConfig.from_flags` takes them flat, as the command line gives them."""

from __future__ import annotations

import os
from dataclasses import Field, dataclass, field, fields

from nmtserve.errors import ConfigError
from nmtserve.export.runtime.engine import EngineConfig


@dataclass
class RuntimeConfig:
    """Which models are served, and how their graphs run."""
    bundle: str = ""  # one or more bundle directories (NMTSERVE_BUNDLE: comma-separated)
    models: str = ""  # a TOML file naming the models to serve (server/models.py)
    variant: str = ""  # "": fp32 on cpu, fp16 on cuda (default_variant)
    device: str = "cpu"
    io_binding: str = "auto"  # on: K/V caches stay on the device as OrtValues (IOBinding); auto = on for cuda
    attention_kernel: str = "auto"  # the bundle's graphs on nmtserve's kernels; auto: where the library runs
    threads: int = 2  # ONNX Runtime intra-op threads (sessions never spin): the deployment's CPU request
    inter_threads: int = 1  # running batches per model (engines), each on a thread of its own with `threads` intra-op threads


@dataclass
class LimitsConfig:
    """What one call may ask; beyond it, INVALID_ARGUMENT naming the field and the limit."""
    max_sentences: int = 64
    max_sentence_chars: int = 1000
    max_text_chars: int = 20000  # one text of TranslateText(Stream): split into sentences by the server
    max_call_chars: int = 100000  # all texts of one TranslateText call
    max_decoding_length: int = 256
    max_beam_size: int = 8  # a beam takes beam_size rows of the running batch: lowered to max_running_rows
    stream_interval: int = 1  # TranslateStream: a delta once this many tokens have come since the last one


@dataclass
class NetworkConfig:
    """Where the server listens, and how it stops."""
    host: str = "[::]"
    port: int = 50051
    metrics_port: int = 8002  # Prometheus /metrics on its own HTTP port (Triton's; not 9090, Prometheus' own); -1: off
    http_port: int = -1  # the HTTP/JSON front (server/http.py) on this port; -1: off; 0: a free one
    max_message_bytes: int = 4 * 1024 * 1024
    drain_timeout: float = 30.0
    # a connection older than this (±10%, gRPC's jitter) is asked to go away (GOAWAY) once its calls end, so that
    # clients connect again, resolve the name again and spread over replicas added since; 0: never
    max_connection_age: float = 30.0
    max_connection_age_grace: float = 30.0  # then calls still running on it are ended (as the drain's timeout)
    keepalive_time: float = 60.0  # the server pings an idle connection this often; the client's pings: at most every 10 s
    keepalive_timeout: float = 20.0  # a ping unanswered this long closes the connection (a vanished client)


@dataclass
class TlsConfig:
    """TLS and mutual TLS on the gRPC port (off when every field is empty)."""
    tls_cert: str = ""  # PEM certificate chain; with tls_key, the port speaks TLS
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM roots; when set, clients must present a certificate they sign (mutual TLS)


@dataclass
class AccessConfig:
    """Who may call the TranslationService (server/auth.py); health, reflection and /metrics stay open."""
    api_keys: str = ""  # a TOML file of clients, each a name, its key's SHA-256 and the models it may use; "": open


@dataclass
class ObservabilityConfig:
    """What the server says about each call besides its metrics (--log-level and --log-format are every command's)."""
    # errors: a line on the nmtserve.access logger (nmtserve.logs) for each RPC that did not end OK; on: for every
    # RPC (Python work on the event loop for each call, which a small model's calls feel); off: none
    access_log: str = "errors"
    tracing: str = "off"  # otlp: OpenTelemetry spans of each call to an OTLP collector (server/tracing.py)


SECTIONS = {"runtime": RuntimeConfig, "engine": EngineConfig, "limits": LimitsConfig, "network": NetworkConfig,
            "tls": TlsConfig, "access": AccessConfig, "observability": ObservabilityConfig}


@dataclass
class ServerConfig:
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    @classmethod
    def from_flags(cls, **values) -> ServerConfig:
        """A config from flat field names (the flags' and NMTSERVE_* variables'); an unknown name is a TypeError."""
        unknown = set(values) - {f.name for _, f in flag_fields()}
        if unknown:
            raise TypeError(f"unknown server config fields: {', '.join(sorted(unknown))}")
        return cls(**{name: kind(**{f.name: values[f.name] for f in fields(kind) if f.name in values})
                      for name, kind in SECTIONS.items()})

    def flat(self) -> dict:
        """Every field by its flat name, as from_flags takes them."""
        return {f.name: getattr(getattr(self, section), f.name) for section, f in flag_fields()}


def flag_fields() -> list[tuple[str, Field]]:
    """(section, field) of every flag, in the order --help lists them."""
    return [(name, f) for name, kind in SECTIONS.items() for f in fields(kind)]


def env_name(field_name: str) -> str:
    return "NMTSERVE_" + field_name.upper()


def defaults_from_env(environ=os.environ) -> dict:
    """Field values given as NMTSERVE_* variables, converted to the field's type."""
    values = {}
    for section, f in flag_fields():
        raw = environ.get(env_name(f.name))
        if raw is None:
            continue
        kind = type(getattr(SECTIONS[section](), f.name))
        try:
            values[f.name] = kind(raw)
        except ValueError:
            raise ConfigError(f"{env_name(f.name)}={raw!r}: expected {kind.__name__}") from None
    return values
