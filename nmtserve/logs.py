"""How every command logs: one record a line on stderr, as JSON (each line one object, what log collectors read:
python-json-logger) or as text for a terminal; and the id of the request being handled, in every line written
while it is.

    {"level": "INFO", "logger": "nmtserve.server", "message": "rpc",
     "rpc": "Translate", "model": "en-fr", "code": "OK", "total_ms": 7.2, …, "request_id": "5f0c…",
     "time": "2026-12-05T07:40:01.123456+00:00"}

A record's `extra` fields become keys of its object (as text: a JSON object after the message). The request id is
a context variable the server sets for each call (server/service.py): the call's own tasks see it, so every line
they write carries it. Nothing here imports the rest of nmtserve."""

from __future__ import annotations

import contextvars
import json
import logging
import sys

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

FORMATS = ("json", "text")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class _RequestId(logging.Filter):
    """Adds the request id of the call being handled, where there is one, to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


def _extras(record: logging.LogRecord) -> dict:
    return {k: v for k, v in record.__dict__.items() if k not in RESERVED_ATTRS and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, then the record's extra fields (the request id among them) as one JSON object."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if not extras:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the line
        return f"{head} {json.dumps(extras, ensure_ascii=False, default=str)}{sep}{tail}"


def json_formatter() -> JsonFormatter:
    """time (ISO 8601, UTC), level, logger, message, then the record's extra fields."""
    return JsonFormatter("%(levelname)s %(name)s %(message)s", timestamp="time",
                         rename_fields={"levelname": "level", "name": "logger"}, json_ensure_ascii=False)


def configure(level: str, fmt: str) -> None:
    """Every record at `level` or above, to stderr, as `fmt` (json or text). No record looks up the line that wrote
    it: neither format shows it, and the frame walk is a part of each access-log line's cost (the logging HOWTO's
    "Optimization")."""
    logging._srcfile = None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestId())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
