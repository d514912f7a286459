"""Reading the JSON body of a POST to one of the raw-ASGI routes (generation, tokenize,
embeddings), and what a refusal before the response answers. Shared so that every such route
checks the same things in the same order (API key, method, content type, then the body
within its limits) and answers each failure the same way (:func:`refusal`)."""

from __future__ import annotations

import logging

import trio

from ..errors import (
    BodyTimeout,
    MethodNotAllowed,
    PayloadTooLarge,
    ServerError,
    Unauthorized,
    UnsupportedMediaType,
)
from ..thread_limits import run_limiter
from .asgi import CLOSE, discard_body, header, is_json, read_body

__all__ = [
    "BEFORE_BODY", "BIG_BODY", "UNREAD_BODY", "off_loop", "read_json_post", "refusal",
    "refusal_headers",
]

log = logging.getLogger("server.http")

#: Refusals before the body is read (it is then read and dropped, to keep the connection).
BEFORE_BODY = (Unauthorized, MethodNotAllowed, UnsupportedMediaType)
#: Refusals that leave the body unread: the connection must close (``CLOSE``).
UNREAD_BODY = (PayloadTooLarge, BodyTimeout)


async def read_json_post(app, scope: dict, receive) -> bytes | None:
    """The body of a JSON POST, or None when the client went away; raises the refusals of
    :data:`BEFORE_BODY` and :data:`UNREAD_BODY`."""
    config = app.server_config
    if app.api_keys is not None:
        app.api_keys.check(header(scope, b"authorization"))
    if scope["method"] != "POST":
        raise MethodNotAllowed(f"Method {scope['method']} is not allowed; use POST.")
    if not is_json(header(scope, b"content-type")):
        # A form or text/plain POST is a "simple" cross-site request a browser sends
        # without a CORS preflight: any web page could otherwise start generations.
        raise UnsupportedMediaType(
            "The request body must be JSON, sent with 'Content-Type: application/json'.",
            param="content-type",
        )
    return await read_body(scope, receive, config.max_body_bytes, config.read_timeout)


async def refusal_headers(exc: Exception, scope: dict, receive, config) -> list:
    """The extra headers of a :data:`BEFORE_BODY` refusal, after reading the body away
    (``Connection: close`` when it could not be)."""
    extra = [(b"www-authenticate", b"Bearer")] if isinstance(exc, Unauthorized) else [
        (b"allow", b"POST")
    ]
    if not await discard_body(scope, receive, config.max_body_bytes, config.read_timeout):
        extra.append(CLOSE)
    return extra


async def refusal(
    exc: Exception, scope: dict, receive, config, where: str
) -> tuple[ServerError, list]:
    """What to answer for ``exc``, raised while a route read, checked or dispatched a
    request, before its response started: the error, and the headers it adds. A refusal of
    :data:`BEFORE_BODY` reads the body away first (:func:`refusal_headers`); one of
    :data:`UNREAD_BODY` closes the connection; another :class:`~server.errors.ServerError`
    is answered as itself; anything else is a bug of ours, logged (``where`` it happened)
    and answered as a 500 without its details."""
    if isinstance(exc, BEFORE_BODY):
        return exc, await refusal_headers(exc, scope, receive, config)
    if isinstance(exc, UNREAD_BODY):  # the rest of the body is not read
        return exc, [CLOSE]
    if isinstance(exc, ServerError):
        return exc, []
    log.error("internal error %s", where, exc_info=exc)
    return ServerError("Internal server error."), []


#: Bodies (and answers) at least this large are parsed (built) in a worker thread:
#: validating a body walks it in Python bytecode, during which the thread gives the event
#: loop (every other stream) its turn every few milliseconds. Smaller ones take less than
#: a millisecond, less than a thread's round trip.
BIG_BODY = 256 * 1024
#: Threads parsing or building at once, all requests together: a flood of big bodies
#: waits its turn rather than taking every thread of Trio's pool.
_THREADS = 2


async def off_loop(size: int, fn, *args):
    """``fn(*args)``, in a worker thread when ``size`` (bytes of its input or output) is at
    least :data:`BIG_BODY`, else here. ``fn`` must be sans-IO (it runs without the loop)."""
    if size < BIG_BODY:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=run_limiter("parse", _THREADS))
