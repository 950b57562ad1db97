"""Client side of the gRPC service: channels (plaintext, TLS, mutual TLS) and waiting for SERVING.

Used by `nmtserve translate --server`, the served benchmark and the locust users.

    channel = open_channel("dns:///nmtserve.default.svc:50051", tls=TlsFiles(ca="ca.pem"))
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmtserve.errors import ConfigError, NmtserveError

SERVICE = "nmtserve.v1.TranslationService"
KEEPALIVE_SECONDS = 30  # the client pings an idle connection this often (the server accepts down to 10 s)
# gRPC's service config: dns:///host:port resolves every address of a headless Service and round_robin spreads
# calls over them, skipping a replica whose health service says NOT_SERVING (it does from the start of its drain:
# healthCheckConfig, each connection watching grpc.health.v1); a call refused with UNAVAILABLE all the same (the
# moment before the watch tells, or a replica gone) is sent again to another, up to maxAttempts in all (gRFC A6),
# and retryThrottling is the retry budget: once more than half of its tokens are spent (each failure takes one,
# each success gives back tokenRatio), calls are no longer retried. Every RPC of the service is idempotent; a
# stream is retried only before its first message has come.
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": SERVICE},
    "methodConfig": [{"name": [{"service": SERVICE}],
                      "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                                      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}],
    "retryThrottling": {"maxTokens": 100, "tokenRatio": 0.1},
}
# a name is resolved again when a connection goes away (the server's max-connection-age), at most this often:
# gRPC's default is 30 s; with the server's 30 s age, a new replica then gets calls within about 45 s, not 65
RESOLVE_AT_MOST_EVERY_MS = 10_000
CHANNEL_OPTIONS = [("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1),
                   ("grpc.dns_min_time_between_resolutions_ms", RESOLVE_AT_MOST_EVERY_MS),
                   ("grpc.keepalive_time_ms", KEEPALIVE_SECONDS * 1000), ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.keepalive_permit_without_calls", 1)]


@dataclass
class TlsFiles:
    """PEM files. ca: roots that sign the server's certificate; cert + key: this side's certificate."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key)


def read_pem(flag: str, path: str) -> bytes | None:
    """The file's bytes (None for an empty path); a missing or non-PEM file names the flag and the path."""
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file")
    return data


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    if bool(tls.cert) != bool(tls.key):
        raise ConfigError("--tls-cert and --tls-key go together (the client certificate for mutual TLS)")
    return grpc.ssl_channel_credentials(root_certificates=read_pem("--tls-ca", tls.ca),
                                        private_key=read_pem("--tls-key", tls.key),
                                        certificate_chain=read_pem("--tls-cert", tls.cert))


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Sends `authorization: Bearer KEY` with every call (a server with --api-keys asks for it)."""

    def __init__(self, key: str):
        self.entry = ("authorization", f"Bearer {key}")

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.entry])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def open_channel(target: str, tls: TlsFiles | None = None, aio: bool = False, options: list | None = None,
                 api_key: str = ""):
    """A plaintext or TLS channel (grpc.aio when aio=True) with SERVICE_CONFIG: round_robin over every address of
    the target, retries of UNAVAILABLE within a budget, keepalive; with api_key (blocking channels), every call
    sends it as `authorization: Bearer KEY`."""
    options = CHANNEL_OPTIONS + list(options or [])
    api = grpc.aio if aio else grpc
    if tls is not None and tls.enabled:
        channel = api.secure_channel(target, channel_credentials(tls), options=options)
    else:
        channel = api.insecure_channel(target, options=options)
    if api_key and aio:
        raise ConfigError("api_key: for blocking channels only")
    return grpc.intercept_channel(channel, _Bearer(api_key)) if api_key else channel


def wait_serving(channel: grpc.Channel, target: str, seconds: float) -> None:
    """Poll grpc.health.v1 until the server says SERVING (it does so only after warm-up)."""
    stub, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + seconds
    while True:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise NmtserveError(f"{target}: not SERVING after {seconds:.0f} s")
        time.sleep(0.5)
