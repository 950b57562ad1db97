"""The gRPC servicer: protobuf -> engine requests -> protobuf. It never touches tensors.

Errors map to status codes here and only here (`_abort`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

import grpc

from nmtserve.errors import NmtserveError
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from server.config import ServerConfig
from server.engine import Engine, EngineOverloaded, EngineStopped, FinishReason, Request

log = logging.getLogger("nmtserve.server")

_FINISH = {FinishReason.EOS: pb.FINISH_REASON_EOS, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}


class InvalidRequest(NmtserveError):
    """A request field is out of range; the message names the field, the value and the limit."""


def _status_of(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def _abort(context, exc: Exception):
    await context.abort(_status_of(exc), str(exc))


class TranslationServicer(pb_grpc.TranslationServiceServicer):
    """Thin: validates, submits one engine Request per sentence, awaits them, converts back."""

    def __init__(self, engine: Engine, config: ServerConfig, bundle_manifest_path):
        self.engine, self.config = engine, config
        self.tokenizer = engine.tr.tokenizer
        self.max_source_tokens = engine.tr.max_len
        self.manifest_path = bundle_manifest_path
        self.accepting = True

    # -- validation
    def _options(self, options: pb.DecodingOptions) -> int:
        limit = self.config.max_output_tokens
        if options.max_output_tokens > limit:
            raise InvalidRequest(f"options.max_output_tokens {options.max_output_tokens} exceeds the limit {limit}")
        return options.max_output_tokens or limit

    def _source(self, field: str, text: str) -> list[int]:
        if not text.strip():
            raise InvalidRequest(f"{field}: empty sentence")
        if len(text) > self.config.max_sentence_chars:
            raise InvalidRequest(f"{field}: {len(text)} characters, the limit is {self.config.max_sentence_chars}")
        ids = self.tokenizer.encode(text)
        if len(ids) > self.max_source_tokens:
            raise InvalidRequest(f"{field}: {len(ids)} tokens, the limit is {self.max_source_tokens}")
        return ids

    # -- engine round trip
    def _request(self, ids: list[int], max_tokens: int, context, on_token=None) -> tuple[Request, asyncio.Future]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        remaining = context.time_remaining()
        request = Request(ids, max_decoding_length=max_tokens, on_token=on_token,
                          deadline=None if remaining is None else time.monotonic() + remaining,
                          on_finish=lambda r: loop.call_soon_threadsafe(_resolve, future, r))
        return request, future

    def _submit(self, request: Request) -> None:
        if not self.accepting:
            raise EngineStopped("the server is draining; retry on another replica")
        self.engine.submit(request)

    def _translation(self, request: Request, return_scores: bool) -> pb.Translation:
        arrived = request.arrived
        timings = pb.Timings(queue_ns=_ns((request.admitted or arrived) - arrived),
                             time_to_first_token_ns=_ns((request.first_token or arrived) - arrived),
                             total_ns=_ns((request.finished or arrived) - arrived))
        return pb.Translation(text=self.tokenizer.decode(request.tokens), input_tokens=len(request.src_ids),
                              output_tokens=len(request.tokens), score=request.score if return_scores else 0.0,
                              finish_reason=_FINISH.get(request.finish, pb.FINISH_REASON_UNSPECIFIED), timings=timings)

    async def _check_finished(self, request: Request, context) -> None:
        if request.finish is FinishReason.ERROR:
            log.error("request %s failed in the engine: %s", request.id, request.error)
            await context.abort(grpc.StatusCode.INTERNAL, f"request {request.id} failed in the engine")
        if request.finish is FinishReason.DEADLINE:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {request.id} passed its deadline")
        if request.finish is FinishReason.CANCELLED:
            await context.abort(grpc.StatusCode.CANCELLED, f"request {request.id} was cancelled")

    # -- RPCs
    async def Translate(self, request: pb.TranslateRequest, context) -> pb.TranslateResponse:
        submitted: list[Request] = []
        try:
            n = len(request.sentences)
            if not 1 <= n <= self.config.max_sentences:
                raise InvalidRequest(f"sentences: {n} given, between 1 and {self.config.max_sentences} accepted")
            max_tokens = self._options(request.options)
            sources = [self._source(f"sentences[{i}]", s) for i, s in enumerate(request.sentences)]
            pairs = [self._request(ids, max_tokens, context) for ids in sources]
            for engine_request, _ in pairs:
                self._submit(engine_request)
                submitted.append(engine_request)
            done = await asyncio.gather(*(f for _, f in pairs))
        except NmtserveError as e:
            for r in submitted:
                r.cancel()
            await _abort(context, e)
        except asyncio.CancelledError:  # the client went away: free the rows at the next step
            for r in submitted:
                r.cancel()
            raise
        for r in done:
            await self._check_finished(r, context)
        return pb.TranslateResponse(translations=[self._translation(r, request.options.return_scores) for r in done])

    async def TranslateStream(self, request: pb.TranslateStreamRequest, context):
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        engine_request = None
        try:
            max_tokens = self._options(request.options)
            ids = self._source("sentence", request.sentence)
            engine_request, future = self._request(
                ids, max_tokens, context, on_token=lambda r, t: loop.call_soon_threadsafe(tokens.put_nowait, t))
            self._submit(engine_request)
        except NmtserveError as e:
            await _abort(context, e)
        emitted, seen = "", []
        try:
            while not (future.done() and tokens.empty()):
                getter = asyncio.ensure_future(tokens.get())
                await asyncio.wait([getter, future], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                seen.append(getter.result())
                text = self.tokenizer.decode(seen)
                if text.startswith(emitted) and len(text) > len(emitted):  # pieces may re-segment; wait if so
                    yield pb.TranslateStreamResponse(delta=text[len(emitted):])
                    emitted = text
            await future
        except asyncio.CancelledError:
            engine_request.cancel()
            raise
        await self._check_finished(engine_request, context)
        final = self._translation(engine_request, request.options.return_scores)
        if final.text != emitted:
            if not final.text.startswith(emitted):
                log.error("request %s: streamed text is not a prefix of the final text", engine_request.id)
                await context.abort(grpc.StatusCode.INTERNAL, f"request {engine_request.id}: stream diverged")
            yield pb.TranslateStreamResponse(delta=final.text[len(emitted):])
        yield pb.TranslateStreamResponse(final=final)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        languages = manifest.get("languages", {})
        return pb.ModelInfo(
            source_language=languages.get("source", ""), target_language=languages.get("target", ""),
            bundle_id=hashlib.sha256(self.manifest_path.read_bytes()).hexdigest(), variant=self.engine.tr.variant,
            device=self.engine.tr.device, model_json=json.dumps(manifest["model"], sort_keys=True),
            limits=pb.Limits(max_sentences=self.config.max_sentences, max_sentence_chars=self.config.max_sentence_chars,
                             max_source_tokens=self.max_source_tokens, max_output_tokens=self.config.max_output_tokens))


def _resolve(future: asyncio.Future, request: Request) -> None:
    if not future.done():
        future.set_result(request)


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))
