"""Every Prometheus collector of the server, in one place, with units in names and explicit buckets.

The engine and the servicer report plain numbers through ServerMetrics' methods; nothing else
touches prometheus_client. Each server has its own registry (tests run several in one process).
Every request and engine series carries the `model` label: the id of a served model, so its values are
bounded by the models served; empty for a call refused before it could be routed to one. Request
series also carry `mode`, the decoding mode (greedy, beam, sampling; empty for a call refused before
its options were read); engine steps mix modes, so step series have none. RPC series carry `client` too: the name
of the API key's client (server/auth.py; never the key), so bounded by the key file; empty on a server without
keys and for a call without a known key.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PER_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)


def _labelled(cache: dict, key, make) -> tuple:
    """The labelled children `make()` gives for key, made once: `labels()` costs about what an observation
    does, and step() and sentence() run for every engine iteration and every sentence."""
    children = cache.get(key)
    if children is None:
        children = cache[key] = make()
    return children


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.request_duration = Histogram("nmtserve_request_duration_seconds", "Arrival to end of decoding, per sentence",
                                          ["model", "mode", "rpc"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("nmtserve_request_queue_seconds", "Arrival to admission into the running batch", ["model", "mode"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("nmtserve_time_to_first_token_seconds", "Arrival to the first target token", ["model", "mode"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("nmtserve_time_per_output_token_seconds", "Mean time between target tokens of a sentence", ["model", "mode"],
                              buckets=PER_TOKEN_BUCKETS, registry=r)
        self.step_duration = Histogram("nmtserve_step_duration_seconds", "One decoder step: an engine iteration (encode + steps) over the steps it ran", ["model"],
                                       buckets=STEP_BUCKETS, registry=r)
        self.step_rows = Histogram("nmtserve_step_rows", "Rows in the decoder batch per step", ["model"], buckets=ROW_BUCKETS, registry=r)
        self.step_tokens = Histogram("nmtserve_step_cache_tokens", "Valid self-attention cache slots per step, all rows", ["model"],
                                     buckets=TOKEN_BUCKETS, registry=r)
        self._step_children: dict[str, tuple] = {}  # step(): each model's three, labelled
        self._sentence_children: dict[tuple, tuple] = {}  # sentence(): by (model, mode, rpc, finish reason)
        self.input_tokens = Counter("nmtserve_input_tokens", "Source tokens of finished sentences", ["model", "mode"], registry=r)
        self.output_tokens = Counter("nmtserve_output_tokens", "Target tokens produced", ["model", "mode"], registry=r)
        self.requests = Counter("nmtserve_requests", "Finished RPCs by status code", ["model", "mode", "rpc", "code", "client"],
                                registry=r)
        self.sentences = Counter("nmtserve_sentences", "Finished sentences by finish reason", ["model", "mode", "finish_reason"], registry=r)
        self.cancelled = Counter("nmtserve_cancelled_sentences", "Sentences dropped by client cancellation or deadline",
                                 ["model", "mode", "reason"], registry=r)
        self.rejected = Counter("nmtserve_rejected_requests", "RPCs refused before any work, by status code",
                                ["model", "mode", "code", "client"], registry=r)
        self.quota_rejections = Counter("nmtserve_quota_rejections", "Calls refused for a client over its quota, by "
                                        "quota (concurrency, characters)", ["client", "quota"], registry=r)
        self.client_characters = Counter("nmtserve_client_characters", "Source characters of a client's answered "
                                         "translation calls", ["client"], registry=r)
        self.running = Gauge("nmtserve_requests_running", "Requests (sentences) in the running batch", ["model"], registry=r)
        self.waiting = Gauge("nmtserve_requests_waiting", "Requests waiting for admission", ["model"], registry=r)
        self.model = Info("nmtserve_model", "The bundles being served, one series per model", ["model"], registry=r)
        Info("nmtserve_build", "The versions of nmtserve and of the libraries it serves with",
             registry=r).info(build_versions())
        r.register(_MemoryLimit(memory_limit_bytes()))
        self._engines: dict[str, object] = {}  # each model's engine, read at each scrape (watch_engine)
        r.register(_Admissions(self._engines))
        # process_resident_memory_bytes, process_open_fds, process_cpu_seconds_total, … (Linux /proc)
        ProcessCollector(registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Expose /metrics on its own HTTP port; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port

    # -- reported by the engine
    def watch_engine(self, model: str, engine) -> None:
        """The model's running rows, waiting requests and admissions, read from its engine at each scrape."""
        self.running.labels(model).set_function(lambda: engine.stats()["running"])
        self.waiting.labels(model).set_function(lambda: engine.stats()["waiting"])
        self._engines[model] = engine

    def step(self, model: str, rows: int, cache_tokens: int, seconds: float) -> None:
        """After every engine iteration (the engine thread)."""
        step_rows, step_tokens, step_duration = _labelled(self._step_children, model, lambda: (
            self.step_rows.labels(model), self.step_tokens.labels(model), self.step_duration.labels(model)))
        step_rows.observe(rows)
        step_tokens.observe(cache_tokens)
        step_duration.observe(seconds)

    # -- reported by the servicer
    def sentence(self, model: str, rpc: str, request) -> None:
        """One finished engine request (a sentence)."""
        reason = request.finish.value if request.finish else "unknown"
        mode = request.options.mode
        if reason in ("cancelled", "deadline"):
            self.cancelled.labels(model, mode, reason).inc()
            return
        sentences, input_tokens, output_tokens, queue_time, ttft, tpot, duration = _labelled(
            self._sentence_children, (model, mode, rpc, reason), lambda: (
                self.sentences.labels(model, mode, reason), self.input_tokens.labels(model, mode),
                self.output_tokens.labels(model, mode), self.queue_time.labels(model, mode),
                self.ttft.labels(model, mode), self.tpot.labels(model, mode), self.request_duration.labels(model, mode, rpc)))
        sentences.inc()
        input_tokens.inc(len(request.src_ids))
        output_tokens.inc(len(request.tokens))
        if request.admitted is not None:
            queue_time.observe(request.admitted - request.arrived)
        if request.first_token is not None:
            ttft.observe(request.first_token - request.arrived)
            if len(request.tokens) > 1 and request.finished is not None:
                tpot.observe((request.finished - request.first_token) / (len(request.tokens) - 1))
        if request.finished is not None:
            duration.observe(request.finished - request.arrived)

    def rpc(self, model: str, mode: str, rpc: str, code: str, client: str, characters: int = 0,
            rejected: bool = False) -> None:
        """A finished RPC; `characters`: the source characters of an answered one."""
        self.requests.labels(model, mode, rpc, code, client).inc()
        if characters:
            self.client_characters.labels(client).inc(characters)
        if rejected:
            self.rejected.labels(model, mode, code, client).inc()

    def over_quota(self, client: str, quota: str) -> None:
        self.quota_rejections.labels(client, quota).inc()


def build_versions() -> dict[str, str]:
    """nmtserve's version, Python's, and those of the libraries a call passes through."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import nmtserve

    versions = {"version": nmtserve.__version__, "python": platform.python_version()}
    for package in ("onnxruntime", "onnxruntime-gpu", "grpcio", "protobuf"):
        try:
            versions[package.replace("-", "_")] = version(package)
        except PackageNotFoundError:
            pass
    return versions


# cgroup v2, then v1: the container's memory limit; v1 writes a huge number for none
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit_bytes(paths=CGROUP_MEMORY_LIMITS) -> int | None:
    """The process's cgroup memory limit in bytes, None where it has none (or it cannot be read)."""
    for path in paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
        return None  # "max", or v1's "unlimited"
    return None


class _MemoryLimit:
    """nmtserve_memory_limit_bytes: the container's memory limit, beside process_resident_memory_bytes (the alert
    on memory near the limit divides one by the other); the family has no sample where there is no limit."""

    def __init__(self, limit: int | None):
        self.limit = limit

    def collect(self):
        family = GaugeMetricFamily("nmtserve_memory_limit_bytes", "The memory limit of the server's container "
                                   "(its cgroup's), where it has one")
        if self.limit is not None:
            family.add_metric([], self.limit)
        yield family


class _Admissions:
    """nmtserve_admissions_total{model}: groups of newcomers encoded together and joined to the running batch,
    each one encoder call that every running row waits for; with nmtserve_sentences_total, the sentences per
    call (README, "Admission to a running batch": --admit-rows, --admit-steps). Read from the engines."""

    def __init__(self, engines: dict):
        self.engines = engines

    def collect(self):
        family = CounterMetricFamily("nmtserve_admissions", "Groups of newcomers encoded together (one encoder call "
                                     "each) and joined to the running batch", labels=["model"])
        for model, engine in self.engines.items():
            family.add_metric([model], engine.stats()["admissions"])
        yield family
