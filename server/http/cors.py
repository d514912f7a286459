"""CORS, for browsers calling the API from another origin. Off unless origins are given. Sans-IO.

With ``--allowed-origins`` (``*``, or a list such as ``https://app.example.com``):

* a *preflight* (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) from an
  allowed origin is answered 204 with the allowed methods and headers, before any route or
  API key check (browsers send no credentials on a preflight); from another origin, 403;
* every other response to a request with an allowed ``Origin`` gets
  ``Access-Control-Allow-Origin`` (the origin itself, or ``*`` when any is allowed) and
  ``Access-Control-Expose-Headers: X-Request-Id``; streaming responses too.

No ``Access-Control-Allow-Credentials``: API keys travel in the ``Authorization`` header,
which a page sets itself, not in cookies.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["CORSPolicy"]

_METHODS = b"GET, POST, OPTIONS"
_ALLOWED_HEADERS = b"authorization, content-type, x-request-id, openai-organization, openai-project"
_EXPOSED = b"x-request-id"


class CORSPolicy:
    """Which origins may call the API, and the headers that say so."""

    __slots__ = ("any_origin", "origins", "max_age")

    def __init__(self, origins: Iterable[str], *, max_age: int = 600) -> None:
        origins = [o.strip().rstrip("/") for o in origins if o.strip()]
        if not origins:
            raise ValueError("CORSPolicy needs at least one origin (or '*')")
        self.any_origin = "*" in origins
        self.origins = frozenset(o.encode() for o in origins if o != "*")
        self.max_age = max_age

    def allow_origin(self, origin: bytes | None) -> bytes | None:
        """The ``Access-Control-Allow-Origin`` value for ``origin``, or None if not allowed."""
        if origin is None:
            return None
        if self.any_origin:
            return b"*"
        return origin if origin in self.origins else None

    def response_headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """Headers for an ordinary (non-preflight) response to a request from ``origin``."""
        allowed = self.allow_origin(origin)
        headers = []
        if allowed is not None:
            headers.append((b"access-control-allow-origin", allowed))
            headers.append((b"access-control-expose-headers", _EXPOSED))
        if not self.any_origin:
            headers.append((b"vary", b"Origin"))  # the answer depends on the origin
        return headers

    @staticmethod
    def is_preflight(scope: dict, origin: bytes | None, request_method: bytes | None) -> bool:
        return scope["method"] == "OPTIONS" and origin is not None and request_method is not None

    def preflight_headers(
        self, origin: bytes | None, request_headers: bytes | None
    ) -> list[tuple[bytes, bytes]] | None:
        """Headers of the 204 answer to a preflight from ``origin``, or None (refuse it)."""
        allowed = self.allow_origin(origin)
        if allowed is None:
            return None
        headers = [
            (b"access-control-allow-origin", allowed),
            (b"access-control-allow-methods", _METHODS),
            (b"access-control-allow-headers", _allow_headers(request_headers)),
            (b"access-control-max-age", str(self.max_age).encode()),
        ]
        if not self.any_origin:
            headers.append((b"vary", b"Origin"))
        return headers


def _allow_headers(requested: bytes | None) -> bytes:
    """Echo what the browser asks for (the API reads no header it should not), at least the
    ones the OpenAI SDKs send."""
    if not requested:
        return _ALLOWED_HEADERS
    return _ALLOWED_HEADERS + b", " + requested.strip()
