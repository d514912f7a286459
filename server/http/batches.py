"""The Batch API, as OpenAI's (the openai SDK's ``client.batches``; docs/batches.md).

    POST /v1/batches              create (``input_file_id``, ``endpoint``,
                                  ``completion_window``, ``metadata``)
    GET  /v1/batches              list (``after``, ``limit``), newest first
    GET  /v1/batches/{id}         the Batch object
    POST /v1/batches/{id}/cancel  cancel: ``cancelling``, then ``cancelled``

``/v1/batches`` is a raw route (:mod:`server.http.routes`) for both its methods, as
``/v1/files`` is: the create reads a JSON body. A batch belongs to the API key that made
it: another key's is the same 404 as a missing one. With ``--max-batches-per-key N`` a key
holds at most N unfinished batches (:data:`~server.batches.objects.ACTIVE`), counted in the
store by the create's own write transaction: exact however many frontends create at once
(a create past it is a 429, and stores nothing). A key already at its quota is refused
before its input file is read (``StateStore.check``: a read that can race; the put decides).
The runner (:mod:`server.batches.runner`) does the work; these only read and write the
record.
"""

from __future__ import annotations

import json
import time
from urllib.parse import parse_qs

from quart import Response

from ..batches.objects import (
    ACTIVE, KIND, BatchCreate, batch_object, new_batch_id, parse_create, parse_list_query,
)
from ..errors import ClientError, MethodNotAllowed, NotFound, ServiceUnavailable, printable
from ..openai.batch_input import batch_lines
from ..openai.encode import dumps
from ..state import AtMost, Record, StateStore, StoreFull, TooMany
from . import file_store
from .asgi import CLOSE, discard_body, header, send_error, send_json
from .listing import list_body, read_page
from .owners import BatchQuotaExceeded, current_owner, request_owner, store_error
from .post import off_loop, read_json_post, refusal

__all__ = ["cancel_batch", "retrieve_batch", "serve_batches"]

_ALLOW = [(b"allow", b"GET, POST")]
#: Tries of a cancel's compare-and-set against the runner's lease renewals.
_CANCEL_TRIES = 8


class Conflict(ClientError):
    """The batch is past where a cancel can stop it: 409."""

    status = 409
    code = "batch_not_cancellable"


def _store(app) -> StateStore:
    store = app.state_store
    if store is None or app.batches is None:
        raise ServiceUnavailable("The state store is not open.")
    return store


def _not_found(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {printable(batch_id)}", param="id")


# -- /v1/batches: create and list (raw) ----------------------------------------------------


async def serve_batches(app, path: str, scope: dict, receive, send, headers: list,
                        request_id: str) -> None:
    """``/v1/batches``: POST creates, GET lists; never raises into the ASGI server (but
    Cancelled)."""
    method = scope["method"]
    if method not in ("GET", "POST"):
        config = app.server_config
        whole = await discard_body(scope, receive, config.max_body_bytes, config.read_timeout)
        wrong = MethodNotAllowed(f"Method {method} is not allowed; use GET or POST.")
        await send_error(send, wrong, headers + _ALLOW + ([] if whole else [CLOSE]))
        return
    try:
        if method == "GET":
            if app.api_keys is not None:
                app.api_keys.check(header(scope, b"authorization"))
            store = _store(app)
            owner = request_owner(app, header(scope, b"authorization"))
            body = await _list(store, owner, scope)
        else:
            raw = await read_json_post(app, scope, receive)
            if raw is None:
                return  # the client went away
            store = _store(app)
            owner = request_owner(app, header(scope, b"authorization"))
            try:
                data = json.loads(raw)
            except ValueError:
                raise ClientError("The body is not valid JSON.") from None
            body = await _create(app, store, owner, parse_create(data))
    except Exception as exc:
        refused = store_error(exc) if isinstance(exc, StoreFull) else exc
        error, extra = await refusal(refused, scope, receive, app.server_config,
                                     "in /v1/batches")
        await send_error(send, error, headers + extra)
        return
    await send_json(send, 200, body, headers)


def _count_lines(content: bytes, endpoint: str) -> int:
    """The input file's requests, each of which must call the batch's endpoint."""
    count = 0
    for line in batch_lines(content):
        if line.url != endpoint:
            raise ClientError(f"Line {line.number} of the input file calls '{line.url}'; "
                              f"every line of this batch must call '{endpoint}'.",
                              param="input_file_id", code="invalid_url")
        count += 1
    return count


def _quota_exceeded(exc: TooMany) -> BatchQuotaExceeded:
    return BatchQuotaExceeded(
        f"This API key has {exc.held} unfinished batch(es), and may have at most "
        f"{exc.bound.most} (--max-batches-per-key): create this one once one of them has "
        "ended, or cancel one.")


async def _create(app, store: StateStore, owner: str, create: BatchCreate) -> bytes:
    most = app.server_config.max_batches_per_key
    bound = AtMost(most, ACTIVE) if most else None
    if bound is not None:
        try:  # (a key at its quota is refused before its input file is read and parsed)
            await store.check(KIND, owner, bound)
        except TooMany as exc:
            raise _quota_exceeded(exc) from None
    file = await file_store.find_file(store, owner, create.input_file_id)
    if file is None:
        raise NotFound(f"No such File object: {printable(create.input_file_id)}",
                       param="input_file_id")
    if file.meta["purpose"] != "batch":
        raise ClientError("The input file's purpose must be 'batch'.", param="input_file_id")
    content = await file_store.file_content(store, owner, create.input_file_id)
    if content is None:
        raise NotFound(f"No such File object: {printable(create.input_file_id)}",
                       param="input_file_id")
    total = await off_loop(len(content), _count_lines, content, create.endpoint)
    meta = {"status": "validating", "endpoint": create.endpoint,
            "input_file_id": create.input_file_id, "metadata": create.metadata,
            "request_counts": {"total": total, "completed": 0, "failed": 0},
            "holder": None, "lease_until_ms": None}
    record = Record(KIND, new_batch_id(), owner, int(time.time()), meta, b"")
    try:  # (the exact check: the early one can race another create)
        await store.put(record, at_most=bound)
    except TooMany as exc:
        raise _quota_exceeded(exc) from None
    app.batches.poke()
    return dumps(batch_object(record.id, record.created_at, meta))


async def _list(store: StateStore, owner: str, scope: dict) -> bytes:
    query = parse_list_query(parse_qs(scope["query_string"].decode("latin-1"),
                                      keep_blank_values=True))
    records, more = await read_page(store, KIND, owner, after=query.after, limit=query.limit)
    return list_body([batch_object(r.id, r.created_at, r.meta) for r in records], more)


# -- /v1/batches/{id}, /cancel (Quart) -----------------------------------------------------


def _json(body: dict) -> Response:
    return Response(dumps(body), status=200, content_type="application/json")


async def retrieve_batch(app, batch_id: str) -> Response:
    """``GET /v1/batches/{id}``: the Batch object."""
    record = await _store(app).get(KIND, current_owner(app), batch_id)
    if record is None:
        raise _not_found(batch_id)
    return _json(batch_object(record.id, record.created_at, record.meta))


async def cancel_batch(app, batch_id: str) -> Response:
    """``POST /v1/batches/{id}/cancel``: a batch not yet finalizing becomes ``cancelling``
    (its holder stops it and writes what finished); one cancelled or cancelling is answered
    as it is; one past that is a 409."""
    store, owner = _store(app), current_owner(app)
    for _ in range(_CANCEL_TRIES):
        record = await store.get(KIND, owner, batch_id)
        if record is None:
            raise _not_found(batch_id)
        status = record.meta["status"]
        if status in ("cancelling", "cancelled"):
            return _json(batch_object(record.id, record.created_at, record.meta))
        if status not in ("validating", "in_progress"):
            raise Conflict(f"The batch is {status}: it can no longer be cancelled.",
                           param="id")
        meta = {**record.meta, "status": "cancelling", "cancelling_at": int(time.time())}
        expect = {k: record.meta.get(k) for k in ("status", "holder", "lease_until_ms")}
        if await store.update(KIND, owner, batch_id, meta=meta, expect=expect):
            app.batches.nudge(batch_id)
            return _json(batch_object(record.id, record.created_at, meta))
    raise ServiceUnavailable("The batch is busy; retry the cancel.")
