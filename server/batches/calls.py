"""One batch line run as the HTTP request it stands for: the app's own ASGI callable,
called in process with the line's body, as a POST to the line's endpoint by the batch's
owner. Validation, the endpoint's limits and the answer's exact shape are the same code
as a client's request; only the socket is missing.

Why in process rather than over a socket: no port or TLS to know, and nothing of the
batch's traffic counts against the connection limits a client sees. Why through the app
rather than the engine: a line's body is checked and answered by the code that answers
clients, so a batch's output line is byte for byte what that request would have got.
"""

from __future__ import annotations

import json

import trio

from ..errors import ClientError, error_body
from ..manager.batch_priority import batch_work
from ..state import owner_of

__all__ = ["LineAnswer", "call_line", "owner_key", "refused_in_batch"]

#: Body fields that make sense only for a client that reads the answer as it comes.
_NOT_IN_BATCH = ("stream", "background")


class LineAnswer:
    """What the app answered: ``status``, ``request_id`` (its ``X-Request-Id``) and the
    body (parsed JSON; the raw text when it is not JSON)."""

    __slots__ = ("body", "request_id", "status")

    def __init__(self, status: int, request_id: str, body) -> None:
        self.status = status
        self.request_id = request_id
        self.body = body


def owner_key(api_keys: tuple[str, ...], owner: str) -> str | None:
    """The configured API key whose owner is ``owner`` (the store keeps only its digest);
    None when none is (the key was removed from the server)."""
    return next((key for key in api_keys if owner_of(key) == owner), None)


def refused_in_batch(body: dict, request_id: str) -> LineAnswer | None:
    """The 400 of a line asking for what a batch cannot give (a stream, a background
    response), else None: such a line is refused by name, not run some other way."""
    for name in _NOT_IN_BATCH:
        if body.get(name):
            error = ClientError(f"'{name}' is not supported in a batch (each line is answered "
                                "whole, in the output file).", param=name,
                                code="unsupported_parameter")
            return LineAnswer(400, request_id, error_body(error))
    return None


async def call_line(app, url: str, body: bytes, api_key: str | None,
                    request_id: str) -> LineAnswer:
    """POST ``body`` to ``url`` through ``app`` (its ``__call__``), as a client with
    ``api_key``; the whole answer. Cancelled: the app sees its request cancelled, as when
    a client's connection is lost (the engine aborts the generation)."""
    headers = [(b"host", b"batch"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"x-request-id", request_id.encode())]
    if api_key is not None:
        headers.append((b"authorization", b"Bearer " + api_key.encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": url,
        "raw_path": url.encode(), "query_string": b"", "root_path": "",
        "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0), "headers": headers,
        "extensions": {},
    }
    done = trio.Event()
    sent_body = False
    status = 500
    answer_id = request_id
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, answer_id
        if message["type"] == "http.response.start":
            status = message["status"]
            for key, value in message.get("headers", ()):
                if key.lower() == b"x-request-id":
                    answer_id = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        with batch_work():  # (vLLM's priority scheduling: server.manager.batch_priority)
            await app(scope, receive, send)
    finally:
        done.set()
    raw = b"".join(chunks)
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    return LineAnswer(status, answer_id, parsed)
