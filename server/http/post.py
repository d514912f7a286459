"""Reading the JSON body of a POST to one of the raw-ASGI routes (generation, tokenize), and
the headers of a refusal before the body. Shared so that every such route checks the same
things in the same order: API key, method, content type, then the body within its limits."""

from __future__ import annotations

from ..errors import (
    BodyTimeout,
    MethodNotAllowed,
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from .asgi import CLOSE, discard_body, header, is_json, read_body

__all__ = ["BEFORE_BODY", "UNREAD_BODY", "read_json_post", "refusal_headers"]

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
