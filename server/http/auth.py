"""API keys: ``Authorization: Bearer <key>`` on the ``/v1/*`` routes. Sans-IO.

With keys configured (``--api-key`` or ``TRIO_LLM_API_KEY``, and ``--api-key-file``), every
request must carry one of them; otherwise it is answered 401 with an OpenAI-style body and
``WWW-Authenticate: Bearer``. Only the exact paths in :data:`OPEN_PATHS` (``/health``,
``/ready``, ``/metrics``) stay open: probes and scrapers do not carry keys (keep them on a
private network). A CORS preflight (``OPTIONS``) carries no key either and is answered
before this check (see :mod:`server.http.cors`).

Why everything but an exact list: the router merges slashes and takes absolute-form targets
(``//v1/models``, ``http://host/v1/models``), so a check on the raw path's prefix can miss a
route that will run. An allow-list of exact spellings cannot: any other spelling of an open
route needs a key, which errs on the safe side.

The comparison takes the same time whichever key matches and however much of a key is
right: the SHA-256 digest of the presented key is compared with the digest of *every*
configured key with :func:`hmac.compare_digest`, without stopping at a match (digests, so
that the lengths compared are always equal and the time tells nothing of a key's length).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

from ..errors import Unauthorized

__all__ = ["APIKeys", "OPEN_PATHS", "is_protected"]

#: The only paths served without a key when keys are configured (exact match).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

_BEARER = b"bearer"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def is_protected(path: str) -> bool:
    """True for every path that needs a key: all but the exact :data:`OPEN_PATHS`."""
    return path not in OPEN_PATHS


class APIKeys:
    """The accepted keys. Check a request's ``Authorization`` header with :meth:`check`."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Iterable[str], *, allow_none: bool = False) -> None:
        """``allow_none``: no key is accepted then, and every request refused (the keys of
        key files none of which could be read: server.http.key_files)."""
        self._keys = tuple(_digest(k.encode()) for k in keys if k)
        if not self._keys and not allow_none:
            raise ValueError("APIKeys needs at least one non-empty key")

    def __len__(self) -> int:
        return len(self._keys)

    def verify(self, authorization: bytes | None) -> bool:
        """True if ``authorization`` is ``Bearer <one of the keys>`` (scheme case-insensitive)."""
        presented = b""
        scheme_ok = False
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(b" ")
            scheme_ok = scheme.lower() == _BEARER
            presented = token.strip()
        presented = _digest(presented)
        matched = False
        for key in self._keys:  # every key, always: no early exit on a match
            matched |= hmac.compare_digest(key, presented)
        return matched and scheme_ok

    def check(self, authorization: bytes | None) -> None:
        """Raise :class:`~server.errors.Unauthorized` unless :meth:`verify` passes."""
        if not self.verify(authorization):
            if authorization is None:
                message = (
                    "You didn't provide an API key. Send it in the Authorization header: "
                    "'Authorization: Bearer YOUR_KEY'."
                )
            else:
                message = "Incorrect API key provided."
            raise Unauthorized(message)
