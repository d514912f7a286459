"""Request ids, log formats, and the one log line per finished request.

Request ids
-----------
Each HTTP request gets an id: the client's ``X-Request-Id`` when it is valid (1 to 128
characters of ``[A-Za-z0-9._:-]``), else a new one (32 hex digits; an invalid header is
replaced, not refused: an id is for finding log lines, not a reason to fail a request). The
app keeps it in a context variable for the request's task; Trio copies the context into
every task the request starts, so :class:`RequestIdFilter` stamps it as ``request_id`` on
every log record made while serving the request, whichever logger made it.

Formats
-------
``text`` (the default)::

    2024-05-01 12:00:00,123 INFO server.request [0f3c...]: request finished status=200 ...

``json``: one object per line, for Loki, Logstash and friends; the fields of an
:class:`Event` (the request line's) are top-level keys::

    {"time": "2024-05-01T12:00:00.123Z", "level": "INFO", "logger": "server.request",
     "message": "request finished", "request_id": "0f3c...", "status": 200, ...}

See docs/observability.md for the request line's fields.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import time
import uuid
from contextvars import ContextVar

from .record import RequestRecord, iso_utc

__all__ = [
    "Event",
    "JSONFormatter",
    "RequestIdFilter",
    "TextFormatter",
    "configure_logging",
    "current_request_id",
    "lean_log_records",
    "log_handler",
    "log_request",
    "new_request_id",
    "request_id_from_header",
    "request_id_var",
]

#: The id of the request the current task serves (None outside a request).
request_id_var: ContextVar[str | None] = ContextVar("trio_llm_request_id", default=None)

_VALID_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")

request_log = logging.getLogger("server.request")


def current_request_id() -> str | None:
    return request_id_var.get()


def new_request_id() -> str:
    """A fresh id: 32 hex digits."""
    return uuid.uuid4().hex


def request_id_from_header(value: bytes | None) -> tuple[str, bool]:
    """The request's id and whether it is the client's: the ``X-Request-Id`` header value if
    it is 1 to 128 characters of ``[A-Za-z0-9._:-]``, else a new id."""
    if value is not None and _VALID_ID.fullmatch(value):
        return value.decode("ascii"), True
    return new_request_id(), False


# -- records ---------------------------------------------------------------------------------


class Event:
    """A log message with structured fields, rendered only if a handler emits it.

    ``str(event)`` is ``message k=v k=v ...`` (text logs, and any foreign formatter); the JSON
    formatter writes the fields as keys of their own.
    """

    __slots__ = ("message", "fields")

    def __init__(self, message: str, fields: dict) -> None:
        self.message = message
        self.fields = fields

    def __str__(self) -> str:
        parts = [self.message]
        for key, value in self.fields.items():
            kind = type(value)
            if kind is int or kind is float:
                parts.append(f"{key}={value}")
            elif value is None or value == [] or key == "request_id":
                continue  # the request id is on the line already (see TextFormatter)
            else:
                parts.append(f"{key}={_text_value(value)}")
        return " ".join(parts)


#: A text value written as it is; anything else (spaces, quotes, ``=``, control
#: characters, the empty string) is written as a JSON string.
_PLAIN = re.compile(r'[^\s"=\\\x00-\x1f\x7f]+')


def _text_value(value) -> str:
    kind = type(value)
    if kind is str:
        return value if _PLAIN.fullmatch(value) else json.dumps(value, ensure_ascii=False)
    if kind is bool:
        return "true" if value else "false"
    if kind is list or kind is tuple:
        return ",".join("-" if v is None else str(v) for v in value)
    return str(value)


class RequestIdFilter(logging.Filter):
    """Stamps ``record.request_id`` with the current request's id (or None). Install it on
    handlers: a logger's filters do not see records of its child loggers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [request id]: message`` (the id only on a request's lines)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.request_tag = f" [{rid}]" if rid else ""
        return super().format(record)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """``logging``'s own time (local, milliseconds after a comma), its part up to the
        second formatted once a second: there is a line per request."""
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return "%s,%03d" % (_local_second(int(record.created)), record.msecs)


@functools.lru_cache(maxsize=2)
def _local_second(seconds: int) -> str:
    """``2024-05-01 12:00:00``, local time, as ``logging.Formatter`` writes it."""
    return time.strftime(logging.Formatter.default_time_format, time.localtime(seconds))


class JSONFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback goes into ``exc``, escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.msg
        obj = {
            "time": iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
        }
        if isinstance(msg, Event) and not record.args:
            obj["message"] = msg.message
            fields = msg.fields
        else:
            obj["message"] = record.getMessage()
            fields = None
        rid = getattr(record, "request_id", None)
        if rid is not None:
            obj["request_id"] = rid
        if fields:  # after the keys above, which keep their values (one C call each)
            head = obj
            obj = dict(head)
            obj.update(fields)
            obj.update(head)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc"] = record.exc_text
        return json.dumps(obj, ensure_ascii=False, default=str)


# -- setup -----------------------------------------------------------------------------------

FORMATS = ("text", "json")


def log_handler(fmt: str = "text", stream=None) -> logging.Handler:
    """A stream handler (stderr by default) in format ``fmt``, with the request id filter."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    return handler


#: The root handler :func:`configure_logging` added last (the one it replaces).
_configured: logging.Handler | None = None


def configure_logging(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Make the root logger write ``fmt`` lines at ``level`` and above: adds a
    :func:`log_handler` to it (replacing the one an earlier call added) and sets its level.
    Other handlers and the ``logging`` module's settings stay as they are; an embedding
    program may as well add :func:`log_handler` to a logger of its choice. The CLI, which
    owns its process, also clears the root's handlers and calls :func:`lean_log_records`.
    """
    global _configured
    handler = log_handler(fmt, stream)
    root = logging.getLogger()
    if _configured is not None:
        root.removeHandler(_configured)
    _configured = handler
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def lean_log_records() -> None:
    """Turn off, process-wide, what no line of ours shows and every record pays for (the
    caller's file and line, thread and process names), as the logging HOWTO's
    "Optimization" section says: a third less CPU per line, and there is one line per
    request. For a program that owns its process (the CLI); it changes every logger's
    records, not only ours."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


# -- the request line ------------------------------------------------------------------------


def log_request(record: RequestRecord) -> None:
    """Log the one line of a finished generation request: INFO, or WARNING when the server
    failed it (an engine failure or an internal error)."""
    reason = record.finish_reason
    failed = record.failed_by_server
    level = logging.WARNING if failed else logging.INFO
    if not request_log.isEnabledFor(level):
        return
    if failed:
        message = "request failed"
    elif record.rejected:
        message = "request rejected"
    elif reason is None:
        message = "request aborted" if record.client_disconnected else "request rejected"
    elif reason == "abort":
        message = "request aborted"
    else:
        message = "request finished"
    request_log.log(level, Event(message, record.fields()), extra={"request_id": record.request_id})
