"""What ``POST /v1/responses`` reads from and writes to the state store
(``app.state_store``, :mod:`server.state`): the earlier turn a ``previous_response_id``
names, and the finished response of a request with ``store``.

Theory of operation
-------------------
A stored response is one record of kind ``response`` (its id the response's, its owner the
request's key: :mod:`server.http.owners`) whose body holds the final Response object and
its input items (:mod:`server.openai.responses_items`), and whose events are the stream's
events, one per ``sequence_number`` (a non-streaming answer's too: the same machine made
them), for ``GET /v1/responses/{id}?stream=true`` to replay. The bytes its image URLs
gave are a record beside it (:mod:`server.http.responses_images`), written after it.

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
from .responses_images import has_web_images, images_record, read_kept

__all__ = ["KEEP_TIMEOUT", "KIND", "images_before", "keep_response", "not_found",
           "previous_context", "put_images", "state_store"]

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


async def previous_context(store: StateStore, owner: str, response_id: str
                           ) -> tuple[list[dict], int, list[tuple[bytes, str] | None]]:
    """The items a turn continuing ``response_id`` starts from (its input items, then its
    output), their size in bytes (about), and the images it kept for them
    (:mod:`server.http.responses_images`); a 404 naming ``previous_response_id`` when it
    is not there for ``owner``."""
    record = await store.get(KIND, owner, response_id)
    if record is None:
        raise not_found(response_id, "previous_response_id")
    context = await off_loop(len(record.body), context_of, record.body)
    kept = await read_kept(store, owner, response_id) if has_web_images(context) else []
    return context, len(record.body), kept


async def put_images(store: StateStore, images: Record) -> None:
    """Store a response's kept images (:mod:`server.http.responses_images`), its record
    stored already; when the store refuses them, delete the response too and raise."""
    try:
        await store.put(images)
    except Exception:
        try:
            await store.delete(KIND, images.owner, images.id)
        except Exception:
            log.exception("deleting %s, whose images were not stored, failed", images.id)
        raise


async def images_before(store: StateStore, images: Record | None, start):
    """``await start()`` (a background response's first write and its job), its kept
    ``images`` stored first: deleted again when ``start`` fails. Raises the store's error
    (413, 507) when they do not fit."""
    if images is None:
        return await start()
    try:
        await store.put(images)
    except StoreFull as exc:
        raise store_error(exc) from None
    try:
        return await start()
    except BaseException:
        with trio.move_on_after(KEEP_TIMEOUT, shield=True):
            try:
                await store.delete(images.kind, images.owner, images.id)
            except Exception:
                log.exception("deleting the images of %s, not started, failed", images.id)
        raise


async def keep_response(store: StateStore, req: ResponsesRequest, response: dict,
                        stream: bytes) -> ServerError | None:
    """Store the finished ``response`` of ``req``, its items and ``stream`` (its events);
    the error to answer when the store refused it, else None."""
    body = await off_loop(len(stream), record_body, response, req.items)
    record = Record(kind=KIND, id=response["id"], owner=req.owner,
                    created_at=response["created_at"],
                    meta={"status": response["status"]}, body=body)
    images = images_record(req.items, req.prompts, req.owner, record.id, record.created_at)
    with trio.move_on_after(KEEP_TIMEOUT, shield=True) as scope:
        try:  # (the record and its events in one operation: both or neither)
            await store.put(record, events=split_events(stream))
            if images is not None:
                await put_images(store, images)
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
