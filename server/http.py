"""The HTTP/JSON front, beside gRPC: the service's RPCs as JSON, streams as server-sent events, LibreTranslate's
/translate and /languages, and the OpenAPI document (server/openapi.py). It runs in the gRPC server's process and
event loop and calls the same servicer, so both fronts share the engines, the limits and the error messages; it
never touches an engine itself.

Starlette on uvicorn: an ASGI app runs in the asyncio loop grpc.aio already runs, and a JSON body becomes the
request message through protobuf's own JSON mapping (json_format: field names, enums and errors as every protobuf
user knows them), with no second schema of the same messages (FastAPI would declare each as a pydantic model).

    POST /v1/translate             TranslateRequest           -> TranslateResponse
    POST /v1/translate:stream      TranslateStreamRequest     -> server-sent events, one TranslateStreamResponse each
    POST /v1/translateText         TranslateTextRequest       -> TranslateTextResponse
    POST /v1/translateText:stream  TranslateTextStreamRequest -> server-sent events
    GET  /v1/models                                           -> ListModelsResponse
    GET  /v1/models/{model}                                   -> ModelInfo
    POST /translate, GET /languages  LibreTranslate's API (libretranslate.py)
    GET  /livez, /readyz           liveness (200 while the process answers), readiness (503 from the drain's start)
    GET  /openapi.json
    GET  /                         a page to try the models (static/index.html: no build step, the routes above only)

Errors carry gRPC's status mapped to HTTP's (HTTP_STATUS) and a JSON body naming the field: {"error": {"code": 400,
"status": "INVALID_ARGUMENT", "message": "sentences[0]: empty sentence"}}; RESOURCE_EXHAUSTED adds Retry-After
when waiting helps (a full queue, a client's quota: the gRPC call's retry-after trailer).
A call's deadline is the X-Server-Timeout header (seconds), as Google's HTTP APIs take it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from pathlib import Path

import grpc
import uvicorn
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nmtserve.server import libretranslate
from nmtserve.server.http_status import HTTP_STATUS, Aborted, HttpContext, error_body, invalid
from nmtserve.server.openapi import openapi_document
from nmtserve.server.service import TranslationServicer
from nmtserve.v1 import translation_pb2 as pb

log = logging.getLogger("nmtserve.server")
TIMEOUT_HEADER = "x-server-timeout"
BODY_SECONDS = 10.0  # a request body not received in full within this is a 400: a slow client holds no handler longer


def error_response(aborted: Aborted, body: dict | None = None) -> JSONResponse:
    """The status's HTTP response: its JSON error body (error_body, unless `body` is given), and its trailers as
    headers (Retry-After, X-Request-Id)."""
    return JSONResponse(error_body(aborted.code, aborted.details) if body is None else body,
                        HTTP_STATUS.get(aborted.code, 500), headers=aborted.trailers)


async def _within_limits(request: Request, max_bytes: int, read):
    """await read(), the body's reading: Aborted with INVALID_ARGUMENT when the body declares more than max_bytes or is
    not received in full within BODY_SECONDS."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise invalid(f"body: {declared} bytes, the limit is {max_bytes}")
    try:
        async with asyncio.timeout(BODY_SECONDS):
            return await read()
    except TimeoutError:
        raise invalid(f"body: not received in full within {BODY_SECONDS:g} s") from None


async def read_json(request: Request, max_bytes: int):
    """The request's body as JSON: Aborted with INVALID_ARGUMENT naming the problem (too large, too slow, not UTF-8,
    not JSON)."""
    async def read() -> bytearray:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise invalid(f"body: over {max_bytes} bytes, the limit")
        return body
    body = await _within_limits(request, max_bytes, read)
    try:
        return json.loads(body.decode("utf-8")) if body.strip() else {}
    except UnicodeDecodeError as e:
        raise invalid(f"body: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise invalid(f"body: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


async def read_form(request: Request, max_bytes: int):
    """The request's form fields, with read_json's limits on size and time."""
    return await _within_limits(request, max_bytes, lambda: request.form(max_part_size=max_bytes))


def timeout_of(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < float("inf"):
        raise invalid(f"{TIMEOUT_HEADER} header {raw!r}: must be a number of seconds above 0")
    return timeout


def context_of(request: Request, api_key: str | None = None) -> HttpContext:
    """The servicer's context for a request: its deadline, its key (the authorization header, else `api_key`) and
    its X-Request-Id."""
    authorization = request.headers.get("authorization") or (f"Bearer {api_key}" if api_key else None)
    return HttpContext(timeout_of(request), authorization, request.headers.get("x-request-id"))


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class HttpFront:
    """The routes, each on the servicer."""

    def __init__(self, servicer: TranslationServicer):
        self.servicer = servicer
        self.max_bytes = servicer.config.network.max_message_bytes
        unary = [("/v1/translate", "Translate", pb.TranslateRequest),
                 ("/v1/translateText", "TranslateText", pb.TranslateTextRequest)]
        streams = [("/v1/translate:stream", "TranslateStream", pb.TranslateStreamRequest),
                   ("/v1/translateText:stream", "TranslateTextStream", pb.TranslateTextStreamRequest)]
        self.app = Starlette(routes=[
            *(Route(path, self._unary(rpc, kind), methods=["POST"]) for path, rpc, kind in unary),
            *(Route(path, self._stream(rpc, kind), methods=["POST"]) for path, rpc, kind in streams),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model}", self._model_info, methods=["GET"]),
            Route("/translate", self._libretranslate, methods=["POST"]),
            Route("/languages", self._languages, methods=["GET"]),
            Route("/livez", self._livez, methods=["GET"]),
            Route("/readyz", self._readyz, methods=["GET"]),
            Route("/openapi.json", self._openapi, methods=["GET"]),
            Route("/", self._page, methods=["GET"]),
        ], exception_handlers={Exception: self._internal})
        self._document = openapi_document()
        self._page_html = (Path(__file__).parent / "static" / "index.html").read_text(encoding="utf-8")

    @staticmethod
    async def _internal(request: Request, exc: Exception) -> Response:
        """A failure of our own: logged with its traceback, and a JSON INTERNAL to the client (never a traceback)."""
        log.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(Aborted(grpc.StatusCode.INTERNAL, f"{type(exc).__name__} in the server (logged)"))

    async def _message(self, request: Request, kind):
        data = await read_json(request, self.max_bytes)
        if not isinstance(data, dict):
            raise invalid(f"body: a JSON object (a {kind.DESCRIPTOR.name}), not {type(data).__name__}")
        try:
            return json_format.ParseDict(data, kind())
        except (json_format.ParseError, TypeError, ValueError, AttributeError) as e:  # the parser's, on odd values
            raise invalid(f"body: {e}") from None

    def _unary(self, rpc: str, kind):
        method = getattr(self.servicer, rpc)

        async def endpoint(request: Request) -> Response:
            return await self._answer(request, lambda: self._message(request, kind), method)
        return endpoint

    def _stream(self, rpc: str, kind):
        method = getattr(self.servicer, rpc)

        async def endpoint(request: Request) -> Response:
            try:
                message = await self._message(request, kind)
                context = context_of(request)
                stream = method(message, context)
                first = await anext(stream, None)  # before the response starts: an early error keeps its status
            except Aborted as e:
                return error_response(e)

            async def events():
                try:
                    if first is not None:
                        yield sse(json_format.MessageToDict(first))
                    async for item in stream:
                        yield sse(json_format.MessageToDict(item))
                except Aborted as e:  # the status line is sent: the error is the stream's last event
                    yield sse(error_body(e.code, e.details), event="error")
                finally:
                    await stream.aclose()  # a client that leaves cancels its sentences' rows
            return StreamingResponse(events(), media_type="text/event-stream", headers=context.trailers)
        return endpoint

    @staticmethod
    async def _answer(request: Request, read, method) -> Response:
        """A unary RPC over HTTP: `await read()` gives its message, `method` answers it; the answer as JSON with the
        call's trailers as headers (X-Request-Id), or its error."""
        try:
            message = await read()
            context = context_of(request)
            response = await method(message, context)
        except Aborted as e:
            return error_response(e)
        return JSONResponse(json_format.MessageToDict(response), headers=context.trailers)

    async def _models(self, request: Request) -> Response:
        async def read():
            return pb.ListModelsRequest()
        return await self._answer(request, read, self.servicer.ListModels)

    async def _model_info(self, request: Request) -> Response:
        async def read():
            return pb.GetModelInfoRequest(model=request.path_params["model"])
        return await self._answer(request, read, self.servicer.GetModelInfo)

    async def _libretranslate(self, request: Request) -> Response:
        try:
            if request.headers.get("content-type", "").startswith(("application/x-www-form-urlencoded",
                                                                   "multipart/form-data")):
                data = dict(await read_form(request, self.max_bytes))
            else:
                data = await read_json(request, self.max_bytes)
            api_key = data.get("api_key") if isinstance(data, dict) else None
            context = context_of(request, api_key if isinstance(api_key, str) else None)
            return JSONResponse(await libretranslate.translate(self.servicer, data, context), headers=context.trailers)
        except Aborted as e:  # LibreTranslate's clients read {"error": "…"}
            return error_response(e, {"error": e.details})

    async def _languages(self, request: Request) -> Response:
        return JSONResponse(libretranslate.languages(self.servicer.models))

    async def _livez(self, request: Request) -> Response:
        return JSONResponse({"status": "SERVING" if self.servicer.accepting else "NOT_SERVING"})

    async def _readyz(self, request: Request) -> Response:
        """As grpc.health.v1's check of the service: the front starts once the models are warm, and the drain
        turns it NOT_SERVING (503) while in-flight calls finish."""
        serving = self.servicer.accepting
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"}, 200 if serving else 503)

    async def _openapi(self, request: Request) -> Response:
        return JSONResponse(self._document)

    async def _page(self, request: Request) -> Response:
        return HTMLResponse(self._page_html)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in the gRPC server's event loop: the process's signals stay the drain's (app.serve)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The HTTP front on its port, started and stopped with the gRPC server (app.py)."""

    def __init__(self, servicer: TranslationServicer, host: str, port: int):
        # log_config None: uvicorn's records go through the process's handler (nmtserve.logs: JSON), not its own
        self._server = _EmbeddedServer(uvicorn.Config(HttpFront(servicer).app, log_level="warning", access_log=False,
                                                      lifespan="off", log_config=None))
        self._socket = bound_socket(host.strip("[]"), port)  # here, so that a port in use is an OSError of ours
        self.port = self._socket.getsockname()[1]
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP front on port {self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one); "::" takes IPv4 too, as gRPC's "[::]" does. Its protocol
    is named (IPPROTO_TCP), so that asyncio turns Nagle's algorithm off on each connection (TCP_NODELAY): with it on,
    a response's body waits behind its headers for the client's delayed ACK on a kept-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
