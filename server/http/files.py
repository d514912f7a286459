"""The Files API, as OpenAI's (the openai SDK's ``client.files``): the Batch API's input
files come in here, and its output files go out here.

    POST   /v1/files               upload (multipart/form-data: ``file``, ``purpose``)
    GET    /v1/files               list (``purpose``, ``limit``, ``after``, ``order``)
    GET    /v1/files/{id}          the file object
    GET    /v1/files/{id}/content  the file's bytes (application/octet-stream)
    DELETE /v1/files/{id}          {"id", "object": "file", "deleted": true}

``/v1/files`` is a raw route (:mod:`server.http.routes`) for both its methods: the upload
streams through :mod:`server.http.upload` within ``--max-file-bytes`` (a 413 at the first
byte over, the rest unread), which Quart's request body would buffer first; the rest are
Quart routes. Files live in the state store (:mod:`server.http.file_store`), each
belonging to the request's API key (:func:`server.state.owner_of`): another key's file is a
404, as a missing one (no existence oracle).

An upload of ``purpose: batch`` is checked whole before it is stored
(:func:`server.openai.batch_input.check_batch_file`): a 400 names its first bad line. A
store over its size budget refuses the upload: 413 ``storage_quota_exceeded`` when the
key's quota (``--state-max-bytes-per-key``) is full (the client's to solve: delete files),
507 ``storage_full`` when the whole store's (``--state-max-bytes``) is (the operator's).
"""

from __future__ import annotations

from urllib.parse import parse_qs

from quart import Response

from ..errors import ClientError, MethodNotAllowed, NotFound, ServiceUnavailable, printable
from ..openai.batch_input import check_batch_file
from ..openai.encode import dumps
from ..openai.files import file_object, parse_list_query, upload_purpose
from ..state import Record, StateStore, StoreFull
from . import file_store
from .asgi import CLOSE, discard_body, header, send_error, send_json
from .listing import list_body
from .owners import current_owner, request_owner, store_error
from .post import off_loop, refusal
from .upload import form_boundary, read_form

__all__ = ["delete_file", "file_content", "retrieve_file", "serve_files"]

_ALLOW = [(b"allow", b"GET, POST")]


def _store(app) -> StateStore:
    """The app's state store (it is open while the server serves: docs/state.md)."""
    store = app.state_store
    if store is None:
        raise ServiceUnavailable("The state store is not open.")
    return store


def _file_json(app, record: Record) -> dict:
    return file_object(record.id, record.created_at, record.meta, _retention_s(app))


def _retention_s(app) -> int:
    return app.state.config.retention_s


# -- /v1/files: upload and list (raw) -----------------------------------------------------


async def serve_files(app, path: str, scope: dict, receive, send, headers: list,
                      request_id: str) -> None:
    """``/v1/files``: POST uploads, GET lists (a route of :mod:`server.http.routes`); never
    raises into the ASGI server (but Cancelled)."""
    method = scope["method"]
    if method not in ("GET", "POST"):
        config = app.server_config
        whole = await discard_body(scope, receive, config.max_body_bytes, config.read_timeout)
        wrong = MethodNotAllowed(f"Method {method} is not allowed; use GET or POST.")
        await send_error(send, wrong, headers + _ALLOW + ([] if whole else [CLOSE]))
        return
    unread = False  # (a refusal while the body is read leaves the rest unread)
    try:
        if app.api_keys is not None:
            app.api_keys.check(header(scope, b"authorization"))
        store = _store(app)
        owner = request_owner(app, header(scope, b"authorization"))
        if method == "GET":
            body = await _list(app, store, owner, scope)
        else:
            boundary = form_boundary(scope)
            unread = True
            form = await read_form(scope, receive, boundary, file_field="file",
                                   file_limit=app.server_config.max_file_bytes,
                                   timeout=app.server_config.read_timeout)
            unread = False
            if form is None:
                return  # the client went away
            body = await _upload(app, store, owner, form)
    except Exception as exc:
        refused = store_error(exc) if isinstance(exc, StoreFull) else exc
        error, extra = await refusal(refused, scope, receive, app.server_config, "in /v1/files")
        if unread and CLOSE not in extra:
            extra.append(CLOSE)
        await send_error(send, error, headers + extra)
        return
    await send_json(send, 200, body, headers)


async def _upload(app, store, owner: str, form) -> bytes:
    purpose = upload_purpose(form.fields)
    if form.file_name is None:
        raise ClientError("'file' is missing (a part with a filename).", param="file",
                          code="missing_required_parameter")
    if purpose == "batch":
        await off_loop(len(form.content), check_batch_file, form.content)
    record = await file_store.store_file(store, owner, form.filename, purpose, form.content)
    return dumps(_file_json(app, record))


async def _list(app, store, owner: str, scope: dict) -> bytes:
    query = parse_list_query(parse_qs(scope["query_string"].decode("latin-1"),
                                      keep_blank_values=True))
    records, more = await file_store.list_files(store, owner, query)
    return list_body([_file_json(app, record) for record in records], more)


# -- /v1/files/{id}: retrieve, content, delete (Quart) -------------------------------------


def _not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {printable(file_id)}", param="id")


def _json(body: dict) -> Response:
    return Response(dumps(body), status=200, content_type="application/json")


async def retrieve_file(app, file_id: str) -> Response:
    """``GET /v1/files/{id}``: the file object."""
    record = await file_store.find_file(_store(app), current_owner(app), file_id)
    if record is None:
        raise _not_found(file_id)
    return _json(_file_json(app, record))


async def file_content(app, file_id: str) -> Response:
    """``GET /v1/files/{id}/content``: the file's bytes."""
    content = await file_store.file_content(_store(app), current_owner(app), file_id)
    if content is None:
        raise _not_found(file_id)
    return Response(content, status=200, content_type="application/octet-stream")


async def delete_file(app, file_id: str) -> Response:
    """``DELETE /v1/files/{id}``."""
    if not await file_store.delete_file(_store(app), current_owner(app), file_id):
        raise _not_found(file_id)
    return _json({"id": file_id, "object": "file", "deleted": True})
