"""Who owns what a request stores, and what a refused write answers: shared by every route
that keeps state (stored responses, files, batches; :mod:`server.state`).

The owner is :func:`~server.state.owner_of` the API key the request presented, ``""`` on a
server without keys (every client is then the same owner). The key was checked before the
route ran (:mod:`server.http.auth`), so it is one of the configured keys; each key is its
own owner, and another key's objects are a 404 (the store's reads take the owner).
"""

from __future__ import annotations

from quart import request

from ..errors import ClientError, ServerError
from ..state import StoreFull, owner_of

__all__ = ["BatchQuotaExceeded", "InsufficientStorage", "QuotaExceeded", "current_owner",
           "request_owner", "store_error"]


class InsufficientStorage(ServerError):
    """The state store is at its size budget (``--state-max-bytes``): 507."""

    status = 507
    type = "insufficient_storage"
    code = "storage_full"


class QuotaExceeded(ClientError):
    """The key's stored objects are at its quota (``--state-max-bytes-per-key``): 413."""

    status = 413
    code = "storage_quota_exceeded"


class BatchQuotaExceeded(ClientError):
    """The key's unfinished batches are at its quota (``--max-batches-per-key``): 429, as
    OpenAI answers a batch past its queue's limit. The client's to solve: wait until one of
    its batches ends, or cancel one."""

    status = 429
    code = "batch_quota_exceeded"
    retryable = False  # (the openai SDK would retry a 429 twice, for nothing)


def request_owner(app, authorization: bytes | None) -> str:
    """The owner of what a request with this ``Authorization`` header stores: ``""``
    without API keys, else :func:`~server.state.owner_of` its bearer token."""
    if app.api_keys is None or authorization is None:
        return ""
    _, _, token = authorization.strip().partition(b" ")
    return owner_of(token.strip().decode("utf-8", "replace"))


def current_owner(app) -> str:
    """:func:`request_owner` of the Quart request being served (a route's handler)."""
    authorization = request.headers.get("authorization")
    return request_owner(app, None if authorization is None else authorization.encode("latin-1"))


def store_error(exc: StoreFull) -> ServerError:
    """What a write the store refused answers: 413 for the key's quota, 507 for the
    store's budget (the message says which)."""
    if exc.owner is not None:
        return QuotaExceeded(f"Not stored: {exc.message}")
    return InsufficientStorage(f"Not stored: {exc.message}")
