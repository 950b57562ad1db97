"""gRPC's statuses on the HTTP front (server/http.py, server/libretranslate.py): their HTTP codes, the JSON error body,
and the context a call over HTTP gives the servicer in place of gRPC's."""

from __future__ import annotations

import time

import grpc

# the statuses the servicer answers with (docs/api.md), as HTTP's codes (google.rpc.Code's mapping); any other: 500
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}


class Aborted(Exception):
    """A call the servicer ended with a status (HttpContext.abort); `trailers`: the gRPC call's trailing metadata
    (retry-after, x-request-id), which the HTTP answer carries as headers."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: dict | None = None):
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers or {}


class HttpContext:
    """What the servicer asks of a gRPC context, for a call that came over HTTP: the time left before its deadline
    (None: no deadline), its metadata (the authorization and x-request-id headers), its trailing metadata (the
    answer's headers) and abort, which ends the call with a status. Unlike gRPC, HTTP does not end a call whose
    deadline has passed by itself: the servicer answers it (DEADLINE_EXCEEDED)."""

    ends_late_calls = False

    def __init__(self, timeout: float | None, authorization: str | None = None, request_id: str | None = None):
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._metadata = tuple((key, value) for key, value in (("authorization", authorization),
                                                               ("x-request-id", request_id)) if value is not None)
        self.trailers: dict[str, str] = {}

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailers = dict(metadata)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata=()):
        raise Aborted(code, details, dict(trailing_metadata) if trailing_metadata else self.trailers)


def error_body(code: grpc.StatusCode, message: str) -> dict:
    return {"error": {"code": HTTP_STATUS.get(code, 500), "status": code.name, "message": message}}


def invalid(message: str) -> Aborted:
    return Aborted(grpc.StatusCode.INVALID_ARGUMENT, message)
