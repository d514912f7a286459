"""What ``POST /v1/responses`` reads from and writes to the state store
(``app.state_store``, :mod:`server.state`): the earlier turn a ``previous_response_id``
names, and the finished response of a request with ``store``.

Theory of operation
-------------------
A stored response is one record of kind ``response`` (its id the response's, its owner the
request's key: :mod:`server.http.owners`) whose body holds the final Response object and
its input items (:mod:`server.openai.responses_items`), and whose events are the stream's
events, one per ``sequence_number`` (a non-streaming answer's too: the same machine made
them), for ``GET /v1/responses/{id}?stream=true`` to replay.

A response is stored when it ends (``completed``, ``incomplete``, or ``failed``), before
its last byte goes out, so that a client that read it can retrieve it at once; a client
that goes away before then leaves nothing (the answer was cancelled, not finished). The
write is shielded from that cancellation once started, within :data:`KEEP_TIMEOUT`, so a
record is never left without its events. A write the store refuses (its budget, the key's
quota) is answered: the non-streaming request with that error (413 or 507), the stream
with a last ``error`` event; the record is then not kept.
"""

from __future__ import annotations

import logging

import trio

from ..errors import NotFound, ServerError, printable
from ..openai.responses import ResponsesRequest
from ..openai.responses_events import split_events
from ..openai.responses_items import context_of, record_body
from ..state import Record, StateStore, StoreFull
from .owners import store_error
from .post import off_loop

__all__ = ["KEEP_TIMEOUT", "KIND", "keep_response", "not_found", "previous_context",
           "state_store"]

log = logging.getLogger("server.http")

#: The records' kind.
KIND = "response"
#: Seconds a finished response's write may take once the request was cancelled.
KEEP_TIMEOUT = 30.0


def state_store(app) -> StateStore | None:
    """The app's state store, None when it runs without one."""
    return getattr(app, "state_store", None)


def not_found(response_id: str, param: str | None = None) -> NotFound:
    """The 404 of a response that is not there for this key (missing, expired, deleted,
    stored with ``store: false``, or another key's: the same answer, no existence oracle)."""
    return NotFound(f"No response with id '{printable(response_id)}' was found.",
                    param=param)


async def previous_context(store: StateStore, owner: str,
                           response_id: str) -> tuple[list[dict], int]:
    """The items a turn continuing ``response_id`` starts from (its input items, then its
    output), and their size in bytes (about); a 404 naming ``previous_response_id`` when it
    is not there for ``owner``."""
    record = await store.get(KIND, owner, response_id)
    if record is None:
        raise not_found(response_id, "previous_response_id")
    return await off_loop(len(record.body), context_of, record.body), len(record.body)


async def keep_response(store: StateStore, req: ResponsesRequest, response: dict,
                        stream: bytes) -> ServerError | None:
    """Store the finished ``response`` of ``req``, its items and ``stream`` (its events);
    the error to answer when the store refused it, else None."""
    body = await off_loop(len(stream), record_body, response, req.items)
    record = Record(kind=KIND, id=response["id"], owner=req.owner,
                    created_at=response["created_at"],
                    meta={"status": response["status"]}, body=body)
    with trio.move_on_after(KEEP_TIMEOUT, shield=True) as scope:
        try:  # (the record and its events in one operation: both or neither)
            await store.put(record, events=split_events(stream))
        except Exception as exc:
            if not isinstance(exc, StoreFull):
                log.exception("storing %s failed", record.id)
            if isinstance(exc, StoreFull):
                return store_error(exc)
            return ServerError("The response could not be stored.")
    if scope.cancelled_caught:
        log.warning("storing %s took longer than %g s", record.id, KEEP_TIMEOUT)
        return ServerError("The response could not be stored in time.")
    return None
