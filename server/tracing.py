"""OpenTelemetry tracing (the `otel` extra; `--tracing otlp`): each call a span, with its sentences' queueing,
encoder admission and decoding as child spans, under the RPC's server span that opentelemetry-instrumentation-grpc
makes from the client's traceparent (HTTP calls: a root span of their own). Spans go to an OTLP collector, configured
by OpenTelemetry's own variables (OTEL_EXPORTER_OTLP_ENDPOINT, default localhost:4317; OTEL_SERVICE_NAME, default
nmtserve).

A call's spans are written when it ends, from the times the engine recorded, so tracing adds nothing to the engine
thread and nothing to a call's path but one context lookup at its start. Without the extra or with `--tracing off`
none of this is imported."""

from __future__ import annotations

import os
import time

import nmtserve
from nmtserve.errors import ConfigError

MODES = ("off", "otlp")


class Tracing:
    """The server's tracer provider (its own, not OpenTelemetry's global one), its gRPC interceptor and the spans of
    finished calls."""

    def __init__(self, exporter, batch: bool):
        from opentelemetry import context
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({
            "service.name": os.environ.get("OTEL_SERVICE_NAME", "nmtserve"), "service.version": nmtserve.__version__}))
        # a collector gets the spans in batches, off the call's path; an exporter given (tests) each at once
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("nmtserve.server", nmtserve.__version__)
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()  # time.monotonic() -> the epoch's ns
        self._context = context  # read at every call's start

    def interceptors(self) -> list:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=self.provider)]

    def current(self):
        """The context a call starts in: its RPC's server span, where the interceptor made one."""
        return self._context.get_current()

    def _ns(self, monotonic: float) -> int:
        return int(monotonic * 1e9) + self._epoch_offset_ns

    def record(self, call, parent) -> None:
        """The finished call's span, and each of its sentences' queue, encode and decode spans."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        now = time.monotonic()
        span = self.tracer.start_span(f"nmtserve {call.rpc}", context=parent, start_time=self._ns(call.started),
                                      attributes={"nmtserve.request_id": call.request_id, "nmtserve.model": call.model,
                                                  "nmtserve.client": call.client, "nmtserve.mode": call.mode,
                                                  "nmtserve.code": call.code, "nmtserve.sentences": len(call.requests)})
        if call.code not in ("", "OK"):
            span.set_status(Status(StatusCode.ERROR, call.code))
        inside = trace.set_span_in_context(span)
        for request in call.requests:
            stages = (("queue", request.arrived, request.admitted), ("encode", request.admitted, request.encoded),
                      ("decode", request.encoded, request.finished))
            for stage, start, end in stages:
                if start is not None and end is not None:
                    self.tracer.start_span(
                        f"nmtserve {stage}", context=inside, start_time=self._ns(start),
                        attributes={"nmtserve.sentence": request.id, "nmtserve.input_tokens": len(request.src_ids),
                                    "nmtserve.output_tokens": len(request.tokens),
                                    "nmtserve.finish_reason": request.finish.value if request.finish else ""},
                    ).end(end_time=self._ns(end))
        span.end(end_time=self._ns(now))

    def shutdown(self) -> None:
        self.provider.shutdown()  # the batch processor sends what it holds


def start_tracing(mode: str, exporter=None) -> Tracing | None:
    """The tracing of `--tracing MODE`: None for off; for otlp an OTLP exporter unless `exporter` is given (tests:
    OpenTelemetry's in-memory one). Without the otel extra, a ConfigError that names it."""
    if mode not in MODES:
        raise ConfigError(f"--tracing {mode!r}: choose {' or '.join(MODES)}")
    if mode == "off":
        return None
    try:
        if exporter is not None:
            return Tracing(exporter, batch=False)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return Tracing(OTLPSpanExporter(), batch=True)
    except ModuleNotFoundError as e:
        raise ConfigError(f"--tracing {mode}: needs the 'otel' extra (no module named {e.name!r}): "
                          "pip install 'nmtserve[otel]'") from None
