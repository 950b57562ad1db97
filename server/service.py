"""The gRPC servicer: protobuf -> engine requests -> protobuf. It never touches tensors.

Errors map to status codes in this module only, side by side: `_status_of` for project exceptions
raised while a call is validated and submitted, `_EARLY_FINISH` for requests the engine ended early.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

import grpc

from nmtserve.errors import NmtserveError
from nmtserve.export.runtime.engine import EngineOverloaded, EngineStopped
from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.logs import REQUEST_ID
from nmtserve.server import markup
from nmtserve.server.auth import ApiKeys, PermissionDenied, Unauthenticated, bearer
from nmtserve.server.bridge import Inbox, Wakeups
from nmtserve.server.config import ServerConfig
from nmtserve.server.convert import CallOptions, InvalidRequest, ModelNotFound, translation
from nmtserve.server.documents import MIME_TYPES as PLAIN_TYPES
from nmtserve.server.documents import TextJob, piece_text
from nmtserve.server.language_id import AUTO, detect
from nmtserve.server.metrics import ServerMetrics
from nmtserve.server.models import ServedModel, route
from nmtserve.server.quotas import ClientQuota, QuotaExceeded
from nmtserve.server.tracing import Tracing
from nmtserve.tokenizer import StreamDecoder
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc

log = logging.getLogger("nmtserve.server")
access_log = logging.getLogger("nmtserve.access")  # a line per RPC (--access-log on) or per failed one (errors)
REQUEST_ID_KEY = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MIME_TYPES = (*PLAIN_TYPES, *markup.MIME_TYPES)  # what TranslateText takes
OVERLOADED_RETRY_SECONDS = 1  # retry-after with a full queue: a running batch frees rows every step


class ResponseTooLarge(NmtserveError):
    """A response message over --max-message-bytes: grpc's write of it would fail."""


_EARLY_FINISH = {FinishReason.ERROR: (grpc.StatusCode.INTERNAL, "failed in the engine"),
                 FinishReason.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, "passed its deadline"),
                 FinishReason.CANCELLED: (grpc.StatusCode.CANCELLED, "was cancelled")}


def _status_of(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, EngineOverloaded | ResponseTooLarge | QuotaExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


@dataclass
class _Call:
    """One RPC as its metrics and its log line count it."""
    rpc: str
    model: str = ""  # the served model's id, once the call is routed to one
    mode: str = ""  # its decoding mode, once its options are read
    requests: list[Request] = field(default_factory=list)  # its engine requests, as submitted
    started: float = field(default_factory=time.monotonic)
    client: str = ""  # the API key's client, where the server has keys
    request_id: str = ""  # the client's x-request-id, or one made for it
    code: str = ""  # its status, once it has one
    trace_parent: object = None  # with --tracing: the context it started in (its RPC's server span)
    resumed: float | None = None  # when a unary call's handler resumed, its sentences decoded (Timings.resumed_ns)
    quota: ClientQuota | None = None  # its client's, while the call holds one of the client's slots
    charged: int = 0  # characters taken from the client's quota
    source_language: str = ""  # the request's, or what source_language "auto" detected
    detected: pb.DetectedLanguage | None = None  # with source_language "auto"

    def cancel(self) -> None:
        """Free the call's rows at the engine's next step."""
        for r in self.requests:
            r.cancel()

    def leave(self) -> None:
        """The call is over: its slot in its client's quota is free."""
        if self.quota is not None:
            self.quota.leave()
            self.quota = None


def _rpc(method):
    """A translation RPC's handler, given its _Call: however the call ends (answered, failed, cancelled, a stream
    closed early), the slot it holds in its client's quota is freed and its spans are written (_end)."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            call = self._call(name, context)
            try:
                async for item in method(self, call, request, context):
                    yield item
            finally:
                self._end(call)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        call = self._call(name, context)
        try:
            return await method(self, call, request, context)
        finally:
            self._end(call)
    return unary


def _retry_after(exc: Exception) -> int | None:
    """Seconds after which a RESOURCE_EXHAUSTED call may pass: a full queue's or the client's quota's."""
    if isinstance(exc, EngineOverloaded):
        return OVERLOADED_RETRY_SECONDS
    return exc.retry_after if isinstance(exc, QuotaExceeded) else None


def request_id_of(metadata) -> str:
    """The x-request-id among (key, value) pairs, if it is one (1 to 128 letters, digits and ._:-), else a new id."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and _VALID_REQUEST_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex


def _access_line(call: _Call, code: str, level: int = logging.INFO, logged: bool = True) -> None:
    """The access log: one record per RPC, its fields as the record's (nmtserve.logs): sizes, timings, status;
    none where not `logged` (a call that ended OK under --access-log errors)."""
    call.code = code
    if not logged or not access_log.isEnabledFor(level):
        return
    requests = call.requests
    access_log.log(level, "rpc", extra={
        "rpc": call.rpc, "model": call.model, "client": call.client, "mode": call.mode, "code": code,
        "ids": [r.id for r in requests], "sentences": len(requests),
        "input_tokens": sum(len(r.src_ids) for r in requests), "output_tokens": sum(len(r.tokens) for r in requests),
        "queue_ms": round(max(((r.admitted or r.arrived) - r.arrived) * 1e3 for r in requests), 2) if requests else None,
        "ttft_ms": round(max(((r.first_token or r.arrived) - r.arrived) * 1e3 for r in requests), 2) if requests else None,
        "total_ms": round((time.monotonic() - call.started) * 1e3, 2)})


class TranslationServicer(pb_grpc.TranslationServiceServicer):
    """Thin: routes to a model, validates, submits one engine Request per sentence to that model's
    engine, awaits them, converts back."""

    def __init__(self, models: dict[str, ServedModel], config: ServerConfig, metrics: ServerMetrics,
                 keys: ApiKeys | None = None, tracing: Tracing | None = None):
        self.models, self.config, self.metrics, self.keys, self.tracing = models, config, metrics, keys, tracing
        self.accepting = True
        self.last_arrival = time.monotonic()  # when the latest call arrived (the drain waits for a quiet moment)
        self.wakeups = Wakeups(asyncio.get_running_loop())  # made on the loop that serves it (start_server)

    def _call(self, rpc: str, context) -> _Call:
        """The call, under its request id: the client's x-request-id where it sent a valid one, else a new one; in
        every log line written while it is handled (nmtserve.logs) and in the x-request-id trailer of its answer."""
        self.last_arrival = time.monotonic()
        call = _Call(rpc, request_id=request_id_of(context.invocation_metadata()))
        REQUEST_ID.set(call.request_id)
        context.set_trailing_metadata(((REQUEST_ID_KEY, call.request_id),))
        if self.tracing is not None:
            call.trace_parent = self.tracing.current()
        return call

    def _end(self, call: _Call) -> None:
        """However the call ended: its quota slot is free, and its spans are written (with --tracing)."""
        call.leave()
        if self.tracing is not None:
            self.tracing.record(call, call.trace_parent)

    async def _model(self, call: _Call, request, context, texts: list[str]) -> ServedModel:
        """The model a call asks for, once its client may use it (an API key, where the server has them); with
        source_language "auto", the source language detected in the call's texts first (once the key is known)."""
        call.source_language = request.source_language
        if request.source_language == AUTO:
            self._allow(call, context, None)
            call.source_language = await self._detect(call, request, texts)
        model = route(self.models, request.model, call.source_language, request.target_language)
        call.model = model.id
        self._allow(call, context, model.id)
        return model

    async def _detect(self, call: _Call, request, texts: list[str]) -> str:
        """The language of the texts among the source languages of the models that could serve the call (the
        one named; else those of its target language, or all): one language is taken as it is; none, and the
        call is routed as if it named none. Off the event loop: the first detection reads the detector's model."""
        if request.model:
            models = [self.models[request.model]] if request.model in self.models else []
        else:
            models = [m for m in self.models.values()
                      if not request.target_language or request.target_language in m.target_languages]
        candidates = list(dict.fromkeys(code for m in models for code in m.source_languages))
        if len(candidates) <= 1:
            code, confidence = (candidates[0], 1.0) if candidates else ("", 0.0)
        else:
            code, confidence = await asyncio.to_thread(detect, texts, candidates)
        if code:
            call.detected = pb.DetectedLanguage(language=code, confidence=confidence)
        return code

    def _allow(self, call: _Call, context, model: str | None) -> None:
        """Unauthenticated or PermissionDenied unless the call's key is a client's that may use the model (any
        model: None); then a translation call takes a slot of its client's quota (QuotaExceeded where none is
        free). Nothing on a server without keys."""
        if self.keys is not None:
            client = self.keys.client(bearer(context.invocation_metadata()))
            call.client = client.name
            if model is not None:
                self.keys.allow(client, model)
                quota = self.keys.quota(client)
                quota.enter()
                call.quota = quota

    @staticmethod
    def _charge(call: _Call, chars: int) -> None:
        """Take the call's source characters from its client's quota, before any of it is submitted."""
        if call.quota is not None:
            call.quota.charge(chars)
            call.charged = chars

    @staticmethod
    def _options(call: _Call, model: ServedModel, request) -> CallOptions:
        max_tokens, search = model.options(request.options)
        call.mode = search.mode
        return CallOptions(max_tokens, search, request.options.return_scores, request.options.return_attention)

    # -- engine round trip
    def _request(self, call: _Call, ids: list[int], options: CallOptions, context,
                 prefix: tuple[int, ...] = (), on_token=None, on_done=None, given: list[int] = ()):
        """The engine request of one sentence and the future it resolves; `given`: its target_prefix's tokens,
        forced after `prefix` (its output then begins with them), or favoured (prefix_bias_beta)."""
        wakeups = self.wakeups
        future = wakeups.loop.create_future()
        remaining = context.time_remaining()

        def on_finish(r: Request) -> None:  # engine thread
            self.metrics.sentence(call.model, call.rpc, r)
            wakeups.call(_resolve, future, r, busy=self.models[call.model].engine.busy())
            if on_done:
                on_done()

        forced, favoured = ([], list(given)) if options.search.prefix_bias_beta else (list(given), [])
        request = Request(ids, max_decoding_length=options.max_tokens, options=options.search, on_token=on_token,
                          on_finish=on_finish, scored=options.scored, attention=options.attention,
                          deadline=None if remaining is None else time.monotonic() + remaining,
                          prefix=[*prefix, *forced], shown_prefix=forced, favoured=favoured)
        return request, future

    async def _fail(self, call: _Call, context, exc: Exception, rejected: bool = True):
        """End the call with exc's status; `rejected`: refused while it was checked and submitted,
        before any work (its submitted requests are cancelled)."""
        call.cancel()
        if rejected and call.charged:
            call.quota.refund(call.charged)
        code = _status_of(exc)
        self.metrics.rpc(call.model, call.mode, call.rpc, code.name, call.client,
                         rejected=rejected and not isinstance(exc, QuotaExceeded))
        if isinstance(exc, QuotaExceeded):  # counted; logged at DEBUG: a client's flood would be a line a refusal
            self.metrics.over_quota(call.client, exc.quota)
        _access_line(call, code.name, logging.DEBUG if isinstance(exc, QuotaExceeded) else logging.INFO)
        retry_after = _retry_after(exc)
        await context.abort(code, str(exc), ((REQUEST_ID_KEY, call.request_id),)
                            + (() if retry_after is None else (("retry-after", str(retry_after)),)))

    def _cancelled(self, call: _Call) -> None:
        """The client went away: free the rows at the next step."""
        call.cancel()
        call.code = "CANCELLED"
        self.metrics.rpc(call.model, call.mode, call.rpc, "CANCELLED", call.client)

    async def _fit(self, call: _Call, message, context):
        """The message, if grpc can send it: a write over the message size limit fails inside grpc, after
        the call was counted OK; this fails the call first (freeing its rows if a stream's delta is too
        large while it still decodes), with the sizes, and counts what it got."""
        size, limit = message.ByteSize(), self.config.network.max_message_bytes
        if size > limit:
            await self._fail(call, context, ResponseTooLarge(
                f"response: {size} bytes, over the server's message limit of {limit} (--max-message-bytes)"),
                rejected=False)
        return message

    def _succeed(self, call: _Call) -> None:
        self.metrics.rpc(call.model, call.mode, call.rpc, "OK", call.client, call.charged)
        _access_line(call, "OK", logged=self.config.observability.access_log == "on")

    def _submit(self, call: _Call, model: ServedModel, request: Request) -> None:
        if not self.accepting:
            raise EngineStopped("the server is draining; retry on another replica")
        model.engine.submit(request)
        call.requests.append(request)

    @staticmethod
    def _translation(call: _Call, model: ServedModel, request: Request, return_scores: bool) -> pb.Translation:
        return translation(request, model.tokenizer, call.started, call.resumed, return_scores)

    async def _check_finished(self, call: _Call, requests: list[Request], context) -> None:
        for request in requests:
            if request.finish not in _EARLY_FINISH:
                continue
            if request.finish is FinishReason.ERROR:
                log.error("request %s failed in the engine: %s", request.id, request.error)
            code, what = _EARLY_FINISH[request.finish]
            message = f"request {request.id} {what}"
            self.metrics.rpc(call.model, call.mode, call.rpc, code.name, call.client)
            _access_line(call, code.name)
            if request.finish is not FinishReason.ERROR and getattr(context, "ends_late_calls", True):
                # the client's own deadline or cancellation already gave it this status, and gRPC may
                # have ended the call: a status written now fails inside grpc (ExecuteBatchError, logged
                # with a traceback; 1 in 17,596 calls of a 10-minute soak). End the handler quietly.
                raise asyncio.CancelledError(message)
            await context.abort(code, message)

    # -- RPCs
    @_rpc
    async def Translate(self, call: _Call, request: pb.TranslateRequest, context) -> pb.TranslateResponse:
        try:
            model = await self._model(call, request, context, request.sentences)
            n = len(request.sentences)
            if not 1 <= n <= self.config.limits.max_sentences:
                raise InvalidRequest(f"sentences: {n} given, between 1 and {self.config.limits.max_sentences} accepted")
            self._charge(call, sum(len(s) for s in request.sentences))  # first: a refusal is cheap
            options = self._options(call, model, request)
            languages = model.languages(call.source_language, request.target_language)
            sources = [model.source(f"sentences[{i}]", s, languages) for i, s in enumerate(request.sentences)]
            given = model.target_prefixes(request.target_prefix, sources, options, languages)
            each = model.with_glossary(options, request.glossary, request.sentences)
            pairs = [self._request(call, ids, own, context, languages.prefix, given=prefix)
                     for ids, prefix, own in zip(sources, given, each)]
            for engine_request, _ in pairs:
                self._submit(call, model, engine_request)
            # one sentence (most calls) awaits its future itself: gather's own future is one more event-loop hop
            done = [await pairs[0][1]] if len(pairs) == 1 else await asyncio.gather(*(f for _, f in pairs))
            call.resumed = time.monotonic()
        except NmtserveError as e:
            await self._fail(call, context, e)
        except asyncio.CancelledError:
            self._cancelled(call)
            raise
        await self._check_finished(call, done, context)
        response = pb.TranslateResponse(translations=[self._translation(call, model, r, request.options.return_scores)
                                                      for r in done], detected_language=call.detected)
        response = await self._fit(call, response, context)
        self._succeed(call)
        return response

    @_rpc
    async def TranslateStream(self, call: _Call, request: pb.TranslateStreamRequest, context):
        tokens = Inbox(self.wakeups)
        try:
            model = await self._model(call, request, context, [request.sentence])
            self._charge(call, len(request.sentence))
            options = self._options(call, model, request)
            languages = model.languages(call.source_language, request.target_language)
            ids = model.source("sentence", request.sentence, languages)
            [given] = model.target_prefixes([request.target_prefix] if request.target_prefix else [], [ids], options,
                                            languages)
            [options] = model.with_glossary(options, request.glossary, [request.sentence])
            engine_request, future = self._request(call, ids, options, context, languages.prefix,
                                                   on_token=lambda r, t: tokens.put(t),
                                                   on_done=lambda: tokens.put(None),  # after the last token
                                                   given=given)
            self._submit(call, model, engine_request)
        except NmtserveError as e:
            await self._fail(call, context, e)
        # a target_prefix's tokens are the stream's first (its final text begins with them)
        emitted, text, held, finished = "", StreamDecoder(model.tokenizer.decode), list(engine_request.shown_prefix), False
        try:
            while not finished:
                # everything the engine has decided since the last wake-up becomes one delta (a busy event
                # loop sends fewer, larger deltas instead of falling behind), once --stream-interval tokens
                # have come; what is held at the end comes with the final text
                items = await tokens.take()
                finished = items[-1] is None
                held += [t for t in items if t is not None]
                if len(held) >= self.config.limits.stream_interval:
                    delta, held = text.add(held), []
                    if delta:
                        yield await self._fit(call, pb.TranslateStreamResponse(delta=delta), context)
                        emitted += delta
            await future
        except asyncio.CancelledError:
            self._cancelled(call)
            raise
        await self._check_finished(call, [engine_request], context)
        final = self._translation(call, model, engine_request, request.options.return_scores)
        if final.text != emitted:
            if not final.text.startswith(emitted):
                log.error("request %s: streamed text is not a prefix of the final text", engine_request.id)
                await context.abort(grpc.StatusCode.INTERNAL, f"request {engine_request.id}: stream diverged")
            yield await self._fit(call, pb.TranslateStreamResponse(delta=final.text[len(emitted):]), context)
        last = await self._fit(call, pb.TranslateStreamResponse(final=final, detected_language=call.detected), context)
        self._succeed(call)
        yield last

    # -- whole texts: one engine request per sentence, rejoined around the source's whitespace (or markup)
    def _text_requests(self, call: _Call, model: ServedModel, texts: list[tuple[str, str]], request,
                       context) -> list[TextJob]:
        """Split and submit each (field, text): per text its units (the text, or an HTML or XML document's runs), per
        unit its sentences' spans, and per span the engine request and its future, or None where the span is kept as it
        is. A failure part-way (a full queue) fails the call, whose _fail cancels what was submitted: no text is
        translated in part."""
        mime_type = request.mime_type or "text/plain"
        if mime_type not in MIME_TYPES:
            raise InvalidRequest(f"mime_type {request.mime_type!r}: not supported; send {', '.join(MIME_TYPES)}")
        if request.options.return_attention:
            raise InvalidRequest("options.return_attention: Translate and TranslateStream give a sentence's attention; "
                                 "TranslateText gives none")
        for name, text in texts:
            model.check_text(name, text)
        try:
            documents = [markup.parse(text, mime_type, name) if mime_type in markup.MIME_TYPES else None
                         for name, text in texts]
        except markup.MarkupError as e:
            raise InvalidRequest(str(e)) from None
        if any(run.inlines for d in documents if d is not None for run in d.runs):
            model.require_aligner(f"mime_type {mime_type!r} with inline tags: ")  # placed by the attention
        self._charge(call, sum(len(text) for _, text in texts))
        options = self._options(call, model, request)
        languages = model.languages(call.source_language, request.target_language)
        jobs = []
        for (name, text), document in zip(texts, documents):
            units = [(text, False)] if document is None else [(run.text, bool(run.inlines)) for run in document.runs
                                                               if not run.blank]
            job = TextJob(document, [])
            for unit, aligned in units:
                # markup's line breaks are spaces: a sentence written over two lines is one sentence
                spans, ids = model.text_pieces(name, unit if document is None else unit.replace("\n", " "), languages)
                pairs = [self._request(call, piece, options._replace(attention=aligned), context, languages.prefix)
                         if piece else None for piece in ids]
                job.units.append((unit, spans, pairs))
            jobs.append(job)
        for job in jobs:
            for engine_request, _future in job.submitted():
                self._submit(call, model, engine_request)
        return jobs

    @_rpc
    async def TranslateText(self, call: _Call, request: pb.TranslateTextRequest, context) -> pb.TranslateTextResponse:
        try:
            model = await self._model(call, request, context, request.texts)
            n, chars = len(request.texts), sum(len(t) for t in request.texts)
            if not 1 <= n <= self.config.limits.max_sentences:
                raise InvalidRequest(f"texts: {n} given, between 1 and {self.config.limits.max_sentences} accepted")
            if chars > self.config.limits.max_call_chars:
                raise InvalidRequest(f"texts: {chars} characters in all, the limit is {self.config.limits.max_call_chars}")
            if request.return_alignment and request.mime_type in markup.MIME_TYPES:
                raise InvalidRequest(f"return_alignment: text/plain only, not {request.mime_type}")
            jobs = self._text_requests(call, model, [(f"texts[{i}]", t) for i, t in enumerate(request.texts)],
                                       request, context)
            await asyncio.gather(*(future for job in jobs for _, future in job.submitted()))
        except NmtserveError as e:  # a full queue, say: none of the texts is translated
            await self._fail(call, context, e)
        except asyncio.CancelledError:
            self._cancelled(call)
            raise
        await self._check_finished(call, call.requests, context)
        translations = []
        for job in jobs:
            joined, alignment = job.written(model.tokenizer)
            done = [request for request, _ in job.submitted()]
            translations.append(pb.TextTranslation(
                text=joined, sentences=sum(len(spans) for _, spans, _ in job.units),
                input_tokens=sum(len(r.src_ids) for r in done), output_tokens=sum(len(r.tokens) for r in done),
                alignment=[pb.SentenceAlignment(source_start=a, source_end=b, target_start=c, target_end=d)
                           for a, b, c, d in alignment] if request.return_alignment else []))
        response = await self._fit(call, pb.TranslateTextResponse(translations=translations,
                                                                   detected_language=call.detected), context)
        self._succeed(call)
        return response

    @_rpc
    async def TranslateTextStream(self, call: _Call, request: pb.TranslateTextStreamRequest, context):
        try:
            model = await self._model(call, request, context, [request.text])
            [job] = self._text_requests(call, model, [("text", request.text)], request, context)
        except NmtserveError as e:
            await self._fail(call, context, e)
        stream = self._markup_deltas(call, model, job, context) if job.document is not None else \
            self._text_deltas(call, model, request.text, job, context)
        first = True
        try:
            async for message in stream:
                if first and call.detected is not None:  # told once, on the first message
                    message.detected_language.CopyFrom(call.detected)
                first = False
                yield await self._fit(call, message, context)
        except asyncio.CancelledError:
            self._cancelled(call)
            raise
        self._succeed(call)

    async def _text_deltas(self, call: _Call, model: ServedModel, text: str, job: TextJob, context):
        """A plain text's messages: per sentence, in order, the source's whitespace before it and its translation,
        with its alignment; then the text after the last sentence."""
        [(_, spans, pairs)] = job.units
        position, length = 0, 0
        for span, pair in zip(spans, pairs):
            if pair:
                await pair[1]
                await self._check_finished(call, [pair[0]], context)
            translation = piece_text(model.tokenizer, text, span, pair)
            delta = text[position:span[0]] + translation
            target_start = length + span[0] - position
            yield pb.TranslateTextStreamResponse(delta=delta, alignment=pb.SentenceAlignment(
                source_start=span[0], source_end=span[1], target_start=target_start,
                target_end=target_start + len(translation)))
            position, length = span[1], length + len(delta)
        yield pb.TranslateTextStreamResponse(delta=text[position:])

    async def _markup_deltas(self, call: _Call, model: ServedModel, job: TextJob, context):
        """An HTML or XML document's messages: per run that holds text, in order, the markup before it and its
        translation with its tags placed; then the markup after the last one."""
        held, units = [], iter(job.units)
        for piece in job.document.pieces:
            if isinstance(piece, str) or piece.blank:
                held.append(piece if isinstance(piece, str) else markup.unchanged(piece))
                continue
            unit = next(units)
            requests = [pair[0] for pair in unit[2] if pair]
            await asyncio.gather(*(pair[1] for pair in unit[2] if pair))
            await self._check_finished(call, requests, context)
            yield pb.TranslateTextStreamResponse(delta="".join(held) + job.run_written(model.tokenizer, piece, unit))
            held = []
        yield pb.TranslateTextStreamResponse(delta="".join(held))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        call = self._call("GetModelInfo", context)
        try:
            self._allow(call, context, request.model or None)
        except NmtserveError as e:
            await self._fail(call, context, e)
        if request.model not in self.models and not (len(self.models) == 1 and not request.model):
            served = ", ".join(self.models)
            await context.abort(grpc.StatusCode.NOT_FOUND if request.model else grpc.StatusCode.INVALID_ARGUMENT,
                                f"model {request.model!r}: " + ("not served here" if request.model else "required")
                                + f"; this server serves {served}")
        return (self.models.get(request.model) or next(iter(self.models.values()))).info()

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        call = self._call("ListModels", context)
        try:
            self._allow(call, context, None)
        except NmtserveError as e:
            await self._fail(call, context, e)
        return pb.ListModelsResponse(models=[m.info() for m in self.models.values()])


def _resolve(future: asyncio.Future, request: Request) -> None:
    if not future.done():
        future.set_result(request)

