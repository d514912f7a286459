"""The exception hierarchy: every error says who is at fault and which HTTP status it maps to.

    ServerError                 base; status 500
    ├── ClientError             the request is wrong; status 400 unless a subclass says otherwise
    │   ├── NotFound            404 (unknown route, LoRA adapter)
    │   │   └── ModelNotFound   404, code model_not_found (a model or adapter not served)
    │   ├── MethodNotAllowed    405
    │   ├── PayloadTooLarge     413
    │   ├── UnsupportedMediaType 415 (a generation body not declared application/json)
    │   ├── BodyTimeout         408 (the body did not arrive within the read timeout)
    │   └── Unauthorized        401
    ├── EngineError             the engine failed the request; status 500
    │   └── WorkerDied          the worker process holding the request went away
    ├── RequestTimeout          the request ran past the server's request timeout; 504
    └── ServiceUnavailable      no capacity right now (starting, draining, overloaded); 503

The HTTP layer turns any of these into an OpenAI-style body with :func:`error_body`; anything
else is an internal error and is answered with a generic message (never a traceback).

Only the *kind* travels over the worker pipe (see :data:`WIRE_KINDS`), never a pickled
exception, so a worker can blame the client ("prompt too long") or itself.
"""

from __future__ import annotations

import re

__all__ = [
    "ServerError",
    "ClientError",
    "NotFound",
    "ModelNotFound",
    "MethodNotAllowed",
    "PayloadTooLarge",
    "UnsupportedMediaType",
    "BodyTimeout",
    "Unauthorized",
    "EngineError",
    "WorkerDied",
    "ServiceUnavailable",
    "RequestTimeout",
    "clip",
    "printable",
    "error_from_wire",
    "error_body",
]


#: The longest message an error carries (into a response body and a log line): values a
#: client sent are quoted in messages, and must not make either larger than this.
MAX_MESSAGE_CHARS = 1024


def clip(value: str, limit: int = 256) -> str:
    """``value`` for quoting in a message: at most ``limit`` characters, marked when cut."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} characters)"


#: Control characters (C0, DEL, C1) and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def printable(value: str, limit: int = 256) -> str:
    """A name the client chose (a field name, a path through its body) for an error body or
    a log line: :func:`clip`-ped to ``limit`` characters, and with control characters
    written as escapes (``\\n``), so that it cannot start a forged log line."""
    return _CONTROL.sub(_escape, clip(value, limit))


class ServerError(Exception):
    """Base class. ``status`` is the HTTP status, ``type``/``code``/``param`` fill OpenAI's body."""

    status = 500
    type = "internal_error"
    code: str | None = None
    #: For the error of a failed request raised from a stream: the output that carried it
    #: (a :class:`~server.outputs.RequestOutput`).
    output: object = None
    #: False: retrying soon cannot help (a quota), though the status is one that clients
    #: retry (429, 5xx); said in ``x-should-retry: false``, which the openai SDKs obey.
    retryable = True

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        #: The field at fault: a path through the client's body, so bounded and escaped.
        self.param = None if param is None else printable(param)
        if code is not None:
            self.code = code


class ClientError(ServerError):
    """The client sent something we will not serve. Never retried; never the engine's fault."""

    status = 400
    type = "invalid_request_error"


class NotFound(ClientError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    """The request names a model (or LoRA adapter) this server does not serve."""

    code = "model_not_found"


class MethodNotAllowed(ClientError):
    status = 405
    code = "method_not_allowed"


class PayloadTooLarge(ClientError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(ClientError):
    """A generation request whose body is not declared JSON (``Content-Type``)."""

    status = 415
    code = "unsupported_media_type"


class BodyTimeout(ClientError):
    """The client did not send its whole request body in time."""

    status = 408
    code = "request_body_timeout"


class Unauthorized(ClientError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class EngineError(ServerError):
    """The engine failed while serving an accepted request."""

    status = 500
    type = "engine_error"


class WorkerDied(EngineError):
    """The worker process that held the request exited, hung or broke its pipe."""

    code = "worker_died"


class RequestTimeout(ServerError):
    """The server gave up on the request after its request timeout."""

    status = 504
    type = "timeout"
    code = "request_timeout"


class ServiceUnavailable(ServerError):
    """We cannot take work now; ``retry_after`` (seconds) goes into the Retry-After header."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None):
        super().__init__(message, code=code)
        self.retry_after = retry_after


def error_headers(exc: ServerError) -> list[tuple[bytes, bytes]]:
    """The headers an error's response carries besides its body: ``retry-after`` for a
    503, ``x-should-retry: false`` for an error that a retry cannot mend."""
    headers = []
    if isinstance(exc, ServiceUnavailable):
        headers.append((b"retry-after", str(exc.retry_after).encode()))
    if not exc.retryable:
        headers.append((b"x-should-retry", b"false"))
    return headers


# Error kinds as they travel on the worker pipe: [kind, message] (or [kind, message, param]).
WIRE_KINDS: dict[str, type[ServerError]] = {
    "invalid_request": ClientError,
    "not_found": NotFound,
    "model_not_found": ModelNotFound,
    "engine_error": EngineError,
    "worker_died": WorkerDied,
    "unavailable": ServiceUnavailable,
    # a SUBMIT a stopping listening worker refused: the frontend sends it elsewhere, and
    # answers 503 only when no other worker can take it
    "leaving": ServiceUnavailable,
}


def error_from_wire(kind: str, message: str, param: str | None = None) -> ServerError:
    """Build the exception for a wire error kind (unknown kinds are engine errors), naming
    ``param``, the client's field the worker refused (None: it named none)."""
    exc = WIRE_KINDS.get(kind, EngineError)(message)
    if param is not None:
        exc.param = printable(param)
    return exc


def error_body(exc: ServerError) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }
