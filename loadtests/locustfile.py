"""Locust users for nmtserve's service, over gRPC or its HTTP/JSON front, and the load shapes of the named scenarios.

    nmtserve loadtest --scenario spike                   # starts a server on loopback, runs, reports
    nmtserve loadtest --protocol http                    # the same calls through the HTTP/JSON front
    locust -f loadtests/locustfile.py --host 127.0.0.1:50051 --scenario steady --peak-users 32 \
        --scenario-seconds 60 --headless --csv out/stats
    locust -f loadtests/locustfile.py --protocol http --host http://127.0.0.1:8080 …

Follows locust's gRPC pattern: grpc is patched for gevent, and a client interceptor fires
locust's request events. With `--protocol http` the users' stub is HttpStub: the same methods and
messages, sent as JSON to server/http.py's routes (streams as server-sent events), firing the same
events, so that both protocols have the same entries and the same SLO file checks either. Entries in
locust's statistics (request type "grpc" or "http"):

  Translate                        one unary call, 1..N sentences
  TranslateStream                  one streamed sentence, end to end
  TranslateStream TTFT             time to the first text delta
  TranslateStream inter-token      time between consecutive deltas (one per delta)
  TranslateText                    one document: 2..N sentences in one or two paragraphs
  <rpc> RESOURCE_EXHAUSTED         the server refused at once because its queue was full: expected
                                   under overload, so counted apart and never as a failure

Every other status is a failure. Users are closed-loop clients (`--think-time` 0 by default):
the number of users is the number of requests in flight. A server with --api-keys gets `--api-key`
(default: NMTSERVE_API_KEY) as `authorization: Bearer KEY` on every call of either protocol.

Several models: each user asks the server's ListModels and sends each call to a model picked at
random, naming it; entries then carry the model ("Translate [en-fr]"). `--sentences-file` gives one
file for every model, or MODEL=FILE pairs, comma-separated (models of different source languages).

`--decoding mixed` decodes 50% of calls greedily, 40% with beam 4 and 10% by sampling (half from the top 10,
half by top-p 0.9 over the whole vocabulary), and
entries carry the mode ("Translate [beam]", "Translate [en-fr, beam]"); the default sends no
decoding option, so each model decodes with its own defaults.
"""

from __future__ import annotations

import json
import os
import random
import time

import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent
import requests
from google.protobuf import json_format
from locust import LoadTestShape, User, events, task
from locust.exception import StopUser

from nmtserve.client import TlsFiles, open_channel
from nmtserve.errors import ConfigError
from nmtserve.loadtests.slo import REJECTED_SUFFIX, entry
from nmtserve.loadtests.workload import (
    DEFAULT_BUNDLE,
    SCENARIOS,
    default_sentence_file,
    draw_decoding,
    read_sentences,
    sentence_files,
)
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc

grpc_gevent.init_gevent()  # after locust's gevent monkey-patching, before any channel exists
# grpc under gevent waits for every completion-queue event (a unary reply, each streamed message)
# in a thread of gevent's hub threadpool, 10 threads by default: with more users than that, calls
# queue for a thread and a stream, which needs one per message, stalls between deltas, many times the
# server's interval between them. One thread per user.
THREADPOOL_SIZE = 1024
gevent.get_hub().threadpool.maxsize = THREADPOOL_SIZE

SENTENCES: dict[str, list[str]] = {}  # model ("": any model) -> source sentences


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="steady", help="load shape")
    parser.add_argument("--peak-users", type=int, default=32, help="users at the scenario's peak (1.0)")
    parser.add_argument("--scenario-seconds", type=float, default=60.0, help="length of the whole scenario")
    parser.add_argument("--sentences-file", default="", help="sentence file (.tsv: first column), or MODEL=FILE "
                        "pairs, comma-separated; default: the bundle's test split")
    parser.add_argument("--bundle", default=str(DEFAULT_BUNDLE), help="bundle whose test split is the default text")
    parser.add_argument("--max-sentences-per-request", type=int, default=4, help="Translate sends 1..N sentences")
    parser.add_argument("--max-sentences-per-document", type=int, default=6, help="TranslateText sends 2..N")
    parser.add_argument("--think-time", type=float, default=0.0, help="mean seconds a user waits between calls")
    parser.add_argument("--decoding", choices=("default", "mixed"), default="default",
                        help="mixed: 50%% greedy, 40%% beam 4, 10%% sampled calls")
    # locust's own --tls-cert/--tls-key belong to its web UI
    parser.add_argument("--grpc-tls-ca", default="", help="PEM roots of the server's certificate (turns TLS on)")
    parser.add_argument("--grpc-tls-cert", default="", help="client certificate for mutual TLS")
    parser.add_argument("--grpc-tls-key", default="", help="its private key")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                        help="http: the HTTP/JSON front (--host http://HOST:PORT)")
    parser.add_argument("--api-key", default=os.environ.get("NMTSERVE_API_KEY", ""), include_in_web_ui=False,
                        help="sent as `authorization: Bearer KEY` (default: NMTSERVE_API_KEY)")


@events.init.add_listener
def _load_sentences(environment, **_kwargs) -> None:
    options = environment.parsed_options
    if options is not None and not SENTENCES:
        files = sentence_files(options.sentences_file) or {"": str(default_sentence_file(options.bundle))}
        SENTENCES.update({model: read_sentences(path) for model, path in files.items()})


class Reporter:
    """Fires locust's request events of one protocol's calls, under the entries both protocols share."""

    def __init__(self, environment, request_type: str):
        self.events, self.request_type = environment.events, request_type
        self.tag_modes = environment.parsed_options.decoding == "mixed"

    def _tag(self, request) -> str:
        """The entry's tag: the model the request names, and its decoding mode when modes are mixed."""
        if not self.tag_modes:
            return request.model
        o = request.options
        mode = "sampling" if o.HasField("sampling_topk") and o.sampling_topk != 1 else "beam" if o.beam_size > 1 \
            else "greedy"
        return ", ".join(t for t in (request.model, mode) if t)

    def _fire(self, kind: str, tag: str, seconds: float, length: int = 0,
              exception: Exception | None = None) -> None:
        if isinstance(exception, grpc.RpcError) and exception.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            kind, exception = kind + REJECTED_SUFFIX, None
        self.events.request.fire(request_type=self.request_type, name=entry(kind, tag), response_time=seconds * 1000,
                                 response_length=length, exception=exception, context={})

    def _timed(self, rpc: str, tag: str, messages, started: float):
        """A stream's messages, passed on; its TTFT and inter-token events as its deltas arrive, and the whole
        call's event at its end."""
        last, length = None, 0
        try:
            for message in messages:
                now = time.perf_counter()
                length += message.ByteSize()
                if message.HasField("delta"):
                    if last is None:
                        self._fire(f"{rpc} TTFT", tag, now - started)
                    else:
                        self._fire(f"{rpc} inter-token", tag, now - last)
                    last = now
                yield message
        except grpc.RpcError as e:
            self._fire(rpc, tag, time.perf_counter() - started, exception=e)
            raise
        self._fire(rpc, tag, time.perf_counter() - started, length)


class LocustInterceptor(Reporter, grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Fires one locust request event per gRPC call (and TTFT / inter-token events for streams)."""

    def __init__(self, environment):
        super().__init__(environment, "grpc")

    def intercept_unary_unary(self, continuation, call_details, request):
        rpc, tag = call_details.method.rsplit("/", 1)[-1], self._tag(request)
        started = time.perf_counter()
        call = continuation(call_details, request)
        try:
            response = call.result()
            self._fire(rpc, tag, time.perf_counter() - started, response.ByteSize())
        except grpc.RpcError as e:
            self._fire(rpc, tag, time.perf_counter() - started, exception=e)
        return call

    def intercept_unary_stream(self, continuation, call_details, request):
        return self._timed(call_details.method.rsplit("/", 1)[-1], self._tag(request),
                           continuation(call_details, request), time.perf_counter())


class HttpCallError(grpc.RpcError):
    """An HTTP call's error as the gRPC status its JSON body names (server/http_status.py), so that users handle
    both protocols alike."""

    def __init__(self, status: int, body: str):
        try:
            error = json.loads(body)["error"]
            self._code, self._details = grpc.StatusCode[error["status"]], error["message"]
        except (ValueError, KeyError, TypeError):
            self._code, self._details = grpc.StatusCode.UNKNOWN, f"HTTP {status}: {body[:200]}"
        super().__init__(f"{self._code.name}: {self._details}")

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class HttpStub(Reporter):
    """The TranslationService's stub over the HTTP/JSON front: each method takes and returns the proto's messages
    (protobuf's JSON mapping on the wire) and reports its call to locust."""

    ROUTES = {"Translate": ("/v1/translate", pb.TranslateResponse),
              "TranslateText": ("/v1/translateText", pb.TranslateTextResponse),
              "TranslateStream": ("/v1/translate:stream", pb.TranslateStreamResponse)}

    def __init__(self, environment, base_url: str, api_key: str = ""):
        super().__init__(environment, "http")
        self.base_url, self.session = base_url.rstrip("/"), requests.Session()
        if api_key:
            self.session.headers["authorization"] = f"Bearer {api_key}"

    def _post(self, rpc: str, request, timeout: float, stream: bool = False) -> requests.Response:
        response = self.session.post(self.base_url + self.ROUTES[rpc][0], json=json_format.MessageToDict(request),
                                     timeout=timeout, stream=stream)
        if response.status_code != 200:
            raise HttpCallError(response.status_code, response.text)
        return response

    def _unary(self, rpc: str, request, timeout: float):
        tag, started = self._tag(request), time.perf_counter()
        try:
            response = self._post(rpc, request, timeout)
            message = json_format.Parse(response.content, self.ROUTES[rpc][1](), ignore_unknown_fields=True)
        except grpc.RpcError as e:
            self._fire(rpc, tag, time.perf_counter() - started, exception=e)
            raise
        self._fire(rpc, tag, time.perf_counter() - started, message.ByteSize())
        return message

    def Translate(self, request, timeout: float):
        return self._unary("Translate", request, timeout)

    def TranslateText(self, request, timeout: float):
        return self._unary("TranslateText", request, timeout)

    def TranslateStream(self, request, timeout: float):
        return self._timed("TranslateStream", self._tag(request), self._events("TranslateStream", request, timeout),
                           time.perf_counter())

    def _events(self, rpc: str, request, timeout: float):
        """The stream's messages, one per server-sent event as it arrives; an `error` event raises its status."""
        with self._post(rpc, request, timeout, stream=True) as response:
            event = ""
            for line in response.iter_lines(chunk_size=None, decode_unicode=True):
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    if event == "error":
                        raise HttpCallError(response.status_code, data)
                    yield json_format.Parse(data, self.ROUTES[rpc][1](), ignore_unknown_fields=True)

    def ListModels(self, request, timeout: float):
        response = self.session.get(f"{self.base_url}/v1/models", timeout=timeout)
        if response.status_code != 200:
            raise HttpCallError(response.status_code, response.text)
        return json_format.Parse(response.content, pb.ListModelsResponse(), ignore_unknown_fields=True)

    def close(self) -> None:
        self.session.close()


class GrpcUser(User):
    """A closed-loop client with its own channel (or, with --protocol http, its own HTTP session); the stub reports
    every call to locust."""

    abstract = True

    def wait_time(self) -> float:
        think = self.environment.parsed_options.think_time
        return random.expovariate(1 / think) if think > 0 else 0.0

    def on_start(self) -> None:
        o = self.environment.parsed_options
        if o.protocol == "http":
            self.channel = self.stub = HttpStub(self.environment, self.host, o.api_key)
            models = self.stub
        else:
            self.channel = open_channel(self.host, TlsFiles(o.grpc_tls_ca, o.grpc_tls_cert, o.grpc_tls_key),
                                        api_key=o.api_key)
            self.stub = pb_grpc.TranslationServiceStub(grpc.intercept_channel(self.channel,
                                                                              LocustInterceptor(self.environment)))
            models = pb_grpc.TranslationServiceStub(self.channel)
        try:
            served = models.ListModels(pb.ListModelsRequest(), timeout=30).models
        except grpc.RpcError as e:  # a failure of the run (a missing --api-key, say), reported; the user stops
            self.environment.events.request.fire(request_type=o.protocol, name="ListModels", response_time=0,
                                                 response_length=0, exception=e, context={})
            raise StopUser() from e
        self.models = [m.model for m in served]
        missing = [m for m in self.models if m not in SENTENCES and "" not in SENTENCES]
        if missing:
            raise ConfigError(f"--sentences-file names no file for model {missing[0]}: give {missing[0]}=FILE")

    def pick(self) -> tuple[str, list[str]]:
        """A served model, at random, and its sentences. A one-model server's is not named: its
        requests are those of any client that does not know about models."""
        model = random.choice(self.models)
        return (model if len(self.models) > 1 else ""), SENTENCES.get(model) or SENTENCES[""]

    def options(self) -> pb.DecodingOptions:
        """No option (the model's defaults), or with --decoding mixed: 50% greedy, 40% beam 4, 10% sampled."""
        if self.environment.parsed_options.decoding != "mixed":
            return pb.DecodingOptions()
        return pb.DecodingOptions(**draw_decoding(random)[1])

    def on_stop(self) -> None:
        self.channel.close()

    def backoff(self, error: grpc.RpcError) -> None:
        """After RESOURCE_EXHAUSTED a client backs off (jittered) instead of hammering a full server."""
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            time.sleep(random.uniform(0.05, 0.15))


class TranslateUser(GrpcUser):
    weight = 3

    @task
    def translate(self) -> None:
        limit = max(1, self.environment.parsed_options.max_sentences_per_request)
        n = 1 if limit == 1 or random.random() < 0.6 else random.randint(2, limit)
        model, sentences = self.pick()
        try:
            self.stub.Translate(pb.TranslateRequest(sentences=random.choices(sentences, k=n), model=model,
                                                    options=self.options()), timeout=60)
        except grpc.RpcError as e:  # already recorded by the interceptor
            self.backoff(e)


class StreamUser(GrpcUser):
    weight = 1

    @task
    def translate_stream(self) -> None:
        model, sentences = self.pick()
        try:
            for _ in self.stub.TranslateStream(pb.TranslateStreamRequest(sentence=random.choice(sentences), model=model,
                                                                         options=self.options()), timeout=60):
                pass
        except grpc.RpcError as e:
            self.backoff(e)


class DocumentUser(GrpcUser):
    """Whole texts: 2..N sentences in one or two paragraphs, which the server splits, translates as
    separate requests and rejoins."""

    weight = 1

    @task
    def translate_text(self) -> None:
        limit = max(2, self.environment.parsed_options.max_sentences_per_document)
        model, sentences = self.pick()
        picked = random.choices(sentences, k=random.randint(2, limit))
        cut = random.randint(1, len(picked))  # where the second paragraph starts, if it does
        text = "\n\n".join(" ".join(part) for part in (picked[:cut], picked[cut:]) if part)
        try:
            self.stub.TranslateText(pb.TranslateTextRequest(texts=[text], model=model, options=self.options()),
                                    timeout=120)
        except grpc.RpcError as e:
            self.backoff(e)


class ScenarioShape(LoadTestShape):
    """The stages of --scenario, scaled by --peak-users and --scenario-seconds; stops at the end."""

    def tick(self):
        o = self.runner.environment.parsed_options
        elapsed = self.get_run_time()
        for end, share in SCENARIOS[o.scenario]:
            if elapsed < end * o.scenario_seconds:
                users = max(1, round(share * o.peak_users))
                return users, max(1.0, users / 2.0)  # a stage is reached within about 2 s
        return None
