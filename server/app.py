"""Process lifecycle: load and warm each model's bundle, serve gRPC (+ health, reflection), drain on SIGTERM.

    nmtserve serve bundles/default --port 50051
    nmtserve serve bundles/en-fr bundles/fr-en      # one engine per model (server/models.py)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nmtserve.client import read_pem
from nmtserve.errors import ConfigError
from nmtserve.export.runtime.bundle import load_bundle
from nmtserve.export.runtime.engine import EnginePool
from nmtserve.export.runtime.request import Request
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.server import scheduling
from nmtserve.server.auth import ApiKeys
from nmtserve.server.config import ServerConfig
from nmtserve.server.metrics import ServerMetrics
from nmtserve.server.models import ModelSpec, ServedModel, model_specs
from nmtserve.server.service import TranslationServicer
from nmtserve.server.tracing import start_tracing
from nmtserve.v1 import translation_pb2, translation_pb2_grpc

if TYPE_CHECKING:
    from nmtserve.server.http import HttpServer

log = logging.getLogger("nmtserve.server")
QUIET_SECONDS = 0.5  # the drain stops the gRPC server once no call has arrived for this long
SERVICE_NAME = translation_pb2.DESCRIPTOR.services_by_name["TranslationService"].full_name
# the ServerConfig fields that must be at least 1 (start_server refuses less)
AT_LEAST_ONE = ("max_beam_size", "stream_interval", "max_burst_steps", "max_running_rows", "max_batch_tokens",
                "max_waiting", "max_sentences", "max_sentence_chars", "max_text_chars", "max_call_chars",
                "max_decoding_length", "max_message_bytes")
# seconds that must be above 0 (max_connection_age: 0 turns it off)
ABOVE_ZERO = ("keepalive_time", "keepalive_timeout", "max_connection_age_grace")
PING_FLOOR_SECONDS = 10.0


def server_options(network) -> list[tuple[str, int]]:
    """gRPC's channel arguments for the server: message limits, keepalive, and the connection age that lets
    clients find replicas added since they connected (gRPC's guidance for L7-less balancing)."""
    def ms(seconds: float) -> int:
        return int(seconds * 1000)

    options = [("grpc.max_receive_message_length", network.max_message_bytes),
               ("grpc.max_send_message_length", network.max_message_bytes),
               ("grpc.keepalive_time_ms", ms(network.keepalive_time)),
               ("grpc.keepalive_timeout_ms", ms(network.keepalive_timeout)),
               ("grpc.keepalive_permit_without_calls", 1),
               # a client's pings closer than this are an abuse (nmtserve.client pings every KEEPALIVE_SECONDS)
               ("grpc.http2.min_recv_ping_interval_without_data_ms", ms(PING_FLOOR_SECONDS)),
               ("grpc.http2.max_ping_strikes", 2)]
    if network.max_connection_age > 0:
        options += [("grpc.max_connection_age_ms", ms(network.max_connection_age)),
                    ("grpc.max_connection_age_grace_ms", ms(network.max_connection_age_grace))]
    return options


def health_names(models) -> list[str]:
    """grpc.health.v1 service names: the server as a whole (""), the service, and each model's."""
    return ["", SERVICE_NAME, *(f"{SERVICE_NAME}/{m}" for m in models)]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    models: dict[str, ServedModel]
    servicer: TranslationServicer
    health: health.aio.HealthServicer
    metrics_port: int | None = None
    http: HttpServer | None = None  # the HTTP/JSON front, when --http-port is given
    decoding_threads: frozenset[int] = frozenset()  # the ids of the threads the models started to decode

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    @property
    def engine(self) -> EnginePool:
        """The first model's engines (a one-model server's only ones)."""
        return next(iter(self.models.values())).engine

    def idle(self) -> bool:
        return all(m.engine.idle() for m in self.models.values())

    async def drain_and_stop(self, timeout: float) -> None:
        """NOT_SERVING, refuse new work (UNAVAILABLE), let in-flight calls finish within `timeout`, stop.

        The gRPC server keeps running until the engines are idle and no call has arrived for
        QUIET_SECONDS, so that a call arriving while the accepted ones finish meets the servicer's
        UNAVAILABLE. grpc's own shutdown ends a call it has received but not yet handed to a handler
        with CANCELLED (grpc/grpc#41785), which a client would not retry; waiting for a quiet moment
        leaves only calls arriving after QUIET_SECONDS of silence, in the moment of the stop, to meet it.
        """
        for name in health_names(self.models):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.servicer.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and (not self.idle()
                                           or time.monotonic() - self.servicer.last_arrival < QUIET_SECONDS):
            await asyncio.sleep(0.05)
        await self.server.stop(grace=max(0.0, deadline - loop.time()))
        if self.http is not None:
            await self.http.stop()
        for model in self.models.values():
            await loop.run_in_executor(None, model.engine.stop)
        self.servicer.wakeups.close()
        if self.servicer.tracing is not None:
            await loop.run_in_executor(None, self.servicer.tracing.shutdown)  # the spans it holds go out


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key (and --tls-client-ca for mutual TLS); None for plaintext."""
    if not (config.tls.tls_cert or config.tls.tls_key or config.tls.tls_client_ca):
        return None
    if not (config.tls.tls_cert and config.tls.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")
    pair = (read_pem("--tls-key", config.tls.tls_key), read_pem("--tls-cert", config.tls.tls_cert))
    client_ca = read_pem("--tls-client-ca", config.tls.tls_client_ca)
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def warm_up(pool: EnginePool) -> None:
    """One short translation through each engine, so the first user does not pay for lazy initialisation."""
    for engine in pool.engines:
        request = engine.submit(Request(engine.tr.tokenizer.encode("warm up") or [engine.tr.eos_id], max_decoding_length=4))
        request.done.wait(60)


def _switch(flag: str, value: str) -> bool | None:
    """An auto|on|off flag's value: None (auto), True or False."""
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"--{flag} {value!r}: choose auto, on or off")
    return {"auto": None, "on": True, "off": False}[value]


def load_model(spec: ModelSpec, config: ServerConfig, metrics: ServerMetrics, io_binding: bool | None = None,
               attention_kernel: bool | None = None) -> ServedModel:
    """The model's sessions and its own engines (their own threads: a flood on one model never waits for
    another's steps; the operating system shares the cores between the engines' threads)."""
    translator = OnnxTranslator(load_bundle(spec.bundle), device=spec.device, variant=spec.variant,
                                intra_op_threads=spec.threads, io_binding=io_binding, shared_cross=False,
                                attention_kernel=attention_kernel)
    engine = EnginePool(translator, spec.inter_threads, config.engine,
                        on_step=functools.partial(metrics.step, spec.id)).start()
    metrics.watch_engine(spec.id, engine)
    metrics.model.labels(spec.id).info({"bundle": spec.bundle, "variant": spec.variant, "device": spec.device,
                                        "io_binding": str(translator.io_binding).lower(), "batching": config.engine.batching,
                                        "attention_kernel": str(translator.attention_kernel).lower(),
                                        "graphs": ",".join(translator.graphs)})
    return ServedModel(spec, engine, config)


async def start_server(config: ServerConfig, span_exporter=None) -> RunningServer:
    """Load, warm up, bind (port 0 picks a free port) and start; health says SERVING only after warm-up.
    `span_exporter`: where --tracing's spans go in place of an OTLP collector (tests: OpenTelemetry's in-memory one)."""
    credentials = server_credentials(config)  # a bad certificate path fails before the model loads
    tracing = start_tracing(config.observability.tracing, span_exporter)  # so does tracing without its extra
    keys = ApiKeys(config.access.api_keys) if config.access.api_keys else None  # so does a bad key file
    io_binding = _switch("io-binding", config.runtime.io_binding)  # the switches are checked before any model loads
    if config.observability.access_log not in ("on", "errors", "off"):
        raise ConfigError(f"--access-log {config.observability.access_log!r}: choose on, errors or off")
    logging.getLogger("nmtserve.access").disabled = config.observability.access_log == "off"
    attention_kernel = _switch("attention-kernel", config.runtime.attention_kernel)
    flags = config.flat()
    for name in AT_LEAST_ONE:  # 0 rows or a queue of 0 would take no request, ever
        value = flags[name]
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    for name in ABOVE_ZERO:
        if not flags[name] > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {flags[name]}: must be above 0 seconds")
    if flags["max_connection_age"] < 0:
        raise ConfigError(f"--max-connection-age {flags['max_connection_age']}: 0 (never) or more seconds")
    specs = model_specs(config)
    metrics = ServerMetrics()
    models: dict[str, ServedModel] = {}
    present = scheduling.threads()
    try:
        for spec in specs:
            models[spec.id] = load_model(spec, config, metrics, io_binding, attention_kernel)
    except BaseException:
        for model in models.values():
            model.engine.stop()
        raise
    # the threads the models started decode (the engines', ONNX Runtime's), but the hand-back threads
    hand_backs = {e.hand_back.thread.native_id for m in models.values() for e in m.engine.engines if e.hand_back}
    decoding = frozenset(scheduling.threads() - present - hand_backs)
    metrics_port = metrics.serve(config.network.metrics_port, addr="127.0.0.1" if config.network.host.startswith("127.") else "0.0.0.0") \
        if config.network.metrics_port >= 0 else None
    server = grpc.aio.server(options=server_options(config.network),
                             interceptors=tracing.interceptors() if tracing is not None else None)
    servicer = TranslationServicer(models, config, metrics, keys, tracing)
    translation_pb2_grpc.add_TranslationServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in health_names(models):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.network.host}:{config.network.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    for model in models.values():
        await asyncio.get_running_loop().run_in_executor(None, warm_up, model.engine)
        await health_servicer.set(f"{SERVICE_NAME}/{model.id}", health_pb2.HealthCheckResponse.SERVING)
        tr = model.engine.tr
        log.info("model %s: %s (%s, %s%s, %s batching)", model.id, model.spec.bundle, tr.variant, tr.device,
                 " + IOBinding" if tr.io_binding else "", config.engine.batching)
    http = None
    if config.network.http_port >= 0:  # once the models are warm, as health's SERVING
        from nmtserve.server.http import HttpServer

        http = HttpServer(servicer, config.network.host, config.network.http_port)
        await http.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %d model(s) on port %d, HTTP on %s, metrics on %s", len(models), port,
             None if http is None else http.port, metrics_port)
    if keys is None:
        log.warning("no --api-keys: every client may call every model")
    else:
        log.info("--api-keys %s: %d client(s)", keys.path, len(keys.clients))
    return RunningServer(server, port, models, servicer, health_servicer, metrics_port, http, decoding)


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain; returns the exit status (0)."""
    running = await start_server(config)
    scheduling.yield_to(running.decoding_threads)  # the process is the server's: its other threads yield to them
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if running.servicer.keys is not None:
        loop.add_signal_handler(signal.SIGHUP, running.servicer.keys.reload)
    http = "" if running.http is None else f", HTTP on port {running.http.port}"
    print(f"nmtserve: serving on port {running.port}{http}", flush=True)
    await stop.wait()
    log.info("draining (up to %.0f s)", config.network.drain_timeout)
    await running.drain_and_stop(config.network.drain_timeout)
    return 0
