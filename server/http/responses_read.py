"""The stored responses' routes (Quart routes of :mod:`server.http.routes`, behind the API-key
check): ``GET /v1/responses/{id}`` (the Response object, or with ``stream=true`` its events
replayed from ``starting_after``, followed until it ends while a background response
runs), ``GET /v1/responses/{id}/input_items``, ``DELETE /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` (:mod:`server.http.responses_background`).

Every read takes the request's owner (:mod:`server.http.owners`): a response another key
stored, one stored with ``store: false`` (never kept), an expired or a deleted one are the
same 404, so a key cannot learn that another's id exists. A query parameter these routes
do not define, or one they do not honour (``include``, ``include_obfuscation=true``), is
a 400 naming it.
"""

from __future__ import annotations

from typing import cast

from quart import Response, request

from ..errors import ClientError, printable
from ..openai.encode import dumps
from ..openai.responses_items import items_page, response_of
from ..openai.responses_progress import response_so_far
from .asgi import header
from .owners import request_owner
from .post import off_loop
from .responses_images import IMAGES_KIND
from .responses_store import KIND, not_found, state_store

__all__ = ["cancel_response", "delete_response", "input_items", "retrieve_response"]

#: A background response's statuses while it runs: its output so far is in its events.
_RUNNING = ("queued", "in_progress")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: bytes) -> Response:
    return Response(body, status=200, content_type="application/json")


def _query(allowed: tuple[str, ...]) -> dict[str, str]:
    """The request's query parameters (the last value of each); a 400 naming one that is
    not in ``allowed`` (``include``: not honoured, any value)."""
    args = request.args
    for name in args:
        if name in ("include", "include[]"):
            raise ClientError("'include' is not supported: no extra outputs (logprobs, "
                              "encrypted reasoning) are made.", param="include",
                              code="unsupported_parameter")
        if name not in allowed:
            raise ClientError(f"Unknown parameter: '{printable(name)}'.", param=name,
                              code="unknown_parameter")
    return {name: args.getlist(name)[-1] for name in args}


def _owner(app) -> str:
    return request_owner(app, header(cast(dict, request.scope), b"authorization"))


async def _record(app, response_id: str):
    store = state_store(app)
    record = None if store is None else await store.get(KIND, _owner(app), response_id)
    if record is None:
        raise not_found(response_id)
    return record


async def _so_far(app, record, ticket: int) -> dict:
    """A running background response's object with its output so far: from this
    frontend's last fold on (app.background; ``ticket`` taken before the record was read),
    or from all its events while the service is not running (a server that is stopping)."""
    if app.background is not None:
        return (await app.background.so_far(record, ticket))[0]
    response, _ = await off_loop(len(record.body), response_of, record.body)
    events = await state_store(app).read_events(  # type: ignore[union-attr]
        KIND, record.owner, record.id)
    return await off_loop(sum(map(len, events)), response_so_far, response, events)


def _boolean(query: dict, name: str) -> bool:
    value = query.get(name, "false")
    if value not in ("true", "false"):
        raise ClientError(f"'{name}' must be true or false.", param=name)
    return value == "true"


async def retrieve_response(app, response_id: str) -> Response:
    """The stored Response object (a running background response's with the output so
    far); with ``stream=true`` its events (an SSE stream as the
    request's own was), those after ``starting_after`` (a sequence number) when given."""
    query = _query(("stream", "starting_after", "include_obfuscation"))
    if _boolean(query, "include_obfuscation"):
        raise ClientError("'include_obfuscation' is not supported: no obfuscation is added.",
                          param="include_obfuscation", code="unsupported_parameter")
    stream = _boolean(query, "stream")
    after = query.get("starting_after")
    if after is not None and not stream:
        raise ClientError("'starting_after' is for a stream: send it with stream=true.",
                          param="starting_after")
    if after is not None and not (after.isascii() and after.isdigit() and len(after) <= 18):
        raise ClientError("'starting_after' must be a sequence number (an integer >= 0).",
                          param="starting_after")
    background = app.background
    ticket = 0 if background is None else background.progress.ticket()
    record = await _record(app, response_id)
    if not stream:
        if record.meta.get("background") and record.meta.get("status") in _RUNNING:
            # (the output so far, from its events: server.openai.responses_progress)
            so_far = await _so_far(app, record, ticket)
        else:
            so_far, _ = await off_loop(len(record.body), response_of, record.body)
        return _json(dumps(so_far))
    start = -1 if after is None else int(after)
    if background is None or not record.meta.get("background"):
        events = await state_store(app).read_events(  # type: ignore[union-attr]
            KIND, record.owner, response_id, after=start)
        body = b"".join(events)
    else:  # (followed as it is made: on any frontend, through the store)
        body = background.follow(record, start)
    response = Response(body, status=200, headers=_SSE_HEADERS,
                        content_type="text/event-stream; charset=utf-8")
    if not isinstance(body, bytes):
        # (not Quart's RESPONSE_TIMEOUT, 60 s: a follow ends with its response, which
        # --request-timeout, a cancel or the sweep of a dead holder's ends)
        response.timeout = None
    return response


async def cancel_response(app, response_id: str) -> Response:
    """Cancel a queued or in-progress background response: the cancelled Response object
    (server.http.responses_background)."""
    _query(())
    if app.background is None:
        raise not_found(response_id)
    return _json(await app.background.cancel(_owner(app), response_id))


async def input_items(app, response_id: str) -> Response:
    """A page of the stored response's input items (OpenAI's list shape)."""
    query = _query(("after", "limit", "order"))
    record = await _record(app, response_id)
    _, items = await off_loop(len(record.body), response_of, record.body)
    return _json(dumps(items_page(items, after=query.get("after"), limit=query.get("limit"),
                                  order=query.get("order"))))


async def delete_response(app, response_id: str) -> Response:
    """Delete the stored response (its events and kept images too): OpenAI's deletion
    object. This frontend's fold of it goes too (a poll of it before the delete keeps
    nothing after)."""
    _query(())
    store = state_store(app)
    owner = _owner(app)
    if store is None or not await store.delete(KIND, owner, response_id):
        raise not_found(response_id)
    await store.delete(IMAGES_KIND, owner, response_id)  # (its kept images, if any)
    if app.background is not None:
        app.background.progress.end(owner, response_id)
    return _json(dumps({"id": response_id, "object": "response", "deleted": True}))
