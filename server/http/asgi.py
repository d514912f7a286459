"""Small raw-ASGI helpers: read a bounded body, send a JSON answer, watch for a disconnect,
add headers to every response.

The POST routes are served on raw ASGI (see :mod:`server.http.routes`) because each SSE
event through Quart's response machinery costs about twice the CPU of a raw send.
"""

from __future__ import annotations

import math

import trio

from ..errors import BodyTimeout, PayloadTooLarge, ServerError, error_body, error_headers
from ..openai.encode import dumps
from ..connections.private_api import queued_receive

__all__ = [
    "CLOSE",
    "HeaderSend",
    "discard_body",
    "header",
    "is_json",
    "queued_first",
    "read_body",
    "send_empty",
    "send_error",
    "send_json",
    "watch_disconnect",
]


def header(scope: dict, name: bytes) -> bytes | None:
    """The first value of request header ``name`` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def is_json(content_type: bytes | None) -> bool:
    """Whether a ``Content-Type`` value declares JSON: ``application/json`` or a
    ``+json`` type, any parameters (``; charset=utf-8``) allowed."""
    if content_type is None:
        return False
    media = content_type.partition(b";")[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


async def read_body(
    scope: dict, receive, limit: int, timeout: float | None = None, *, keep: bool = True
) -> bytes | None:
    """The whole request body, or None if the client went away first.

    Raises :class:`PayloadTooLarge` as soon as the declared or received size passes
    ``limit``, without reading the rest, and :class:`RequestTimeout` (408) when the body has
    not arrived within ``timeout`` seconds (a client trickling its body). With ``keep``
    false the bytes are counted and dropped (the result is then ``b""``).
    """
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    body = _Body(limit, keep)
    # Usually the whole body waits in hypercorn's queue (read with the request's head):
    # taken without a trip through the scheduler, and without a timer (nothing waits).
    receive_nowait = queued_receive(receive)
    if receive_nowait is not None:
        try:
            while not body.done:
                body.take(receive_nowait())
        except trio.WouldBlock:
            pass
        if body.done:
            return body.result
    with trio.move_on_after(timeout if timeout else math.inf):
        while not body.done:
            body.take(await receive())
        return body.result
    raise BodyTimeout(f"The request body did not arrive within {timeout:g} s.")


async def discard_body(scope: dict, receive, limit: int, timeout: float | None) -> bool:
    """Read the request body and drop it, before an answer that does not need it (a 401).
    Returns whether all of it was read.

    An HTTP/1.1 connection can carry the next request only once this one's body was read:
    answered first, hypercorn closes the connection after the answer, and a client that
    reuses it at that moment sees it closed under its next request. Gives up quietly past
    ``limit`` bytes or ``timeout`` seconds (answer with :data:`CLOSE` then).
    """
    try:
        return await read_body(scope, receive, limit, timeout, keep=False) is not None
    except ServerError:
        return False


#: The header of an answer given before the request body was read to its end: the
#: connection cannot carry another request, and the client must not try.
CLOSE = (b"connection", b"close")


def queued_first(receive):
    """``receive``, but what is already queued is taken without a trip through the
    scheduler. Hypercorn's receive is a Trio memory channel's, where the body's messages
    (usually all of them, read with the request's head) wait; a trip per message would,
    under load, wait behind other streams' events."""
    receive_nowait = queued_receive(receive)
    if receive_nowait is None:
        return receive

    async def receive_queued_first():
        try:
            return receive_nowait()
        except trio.WouldBlock:
            return await receive()

    return receive_queued_first


class _Body:
    """A request body as its ASGI messages arrive: ``done`` once it ended, with ``result``
    (the bytes; ``b""`` when not kept; None: the client went away)."""

    __slots__ = ("limit", "keep", "chunks", "size", "done", "result")

    def __init__(self, limit: int, keep: bool) -> None:
        self.limit = limit
        self.keep = keep
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False
        self.result: bytes | None = None

    def take(self, message: dict) -> None:
        """One message of the body (raises :class:`PayloadTooLarge` past the limit)."""
        if message["type"] == "http.disconnect":
            self.done = True
            return
        chunk = message.get("body", b"")
        self.size += len(chunk)
        if self.size > self.limit:
            raise PayloadTooLarge(f"The request body is larger than {self.limit} bytes.")
        if self.keep:
            self.chunks.append(chunk)
        if not message.get("more_body", False):
            self.done = True
            self.result = b"".join(self.chunks)


async def send_json(send, status: int, body: bytes, headers: list | None = None, *,
                    content_type: bytes = b"application/json") -> None:
    start_headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
    ]
    if headers:
        start_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_empty(send, status: int, headers: list) -> None:
    """A response without a body (a 204)."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_error(send, exc: ServerError, headers: list | None = None) -> None:
    """An OpenAI-style error body with the exception's status and headers
    (:func:`~server.errors.error_headers`)."""
    extra = [*(headers or ()), *error_headers(exc)]
    await send_json(send, exc.status, dumps(error_body(exc)), extra)


async def watch_disconnect(receive, scope: trio.CancelScope, complete=lambda: False) -> None:
    """The request's cancellation monitor: cancel ``scope`` when the client goes away.

    Runs beside the writer in the request's nursery; after the body was read, ``receive``
    has nothing more to say until the connection closes, so this costs one parked task per
    request and no work per chunk.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            # After the last byte was handed over, the disconnect is hypercorn closing the
            # connection (Connection: close, HTTP/1.0) from inside that send: let it finish.
            if not complete():
                scope.cancel()
            return


class HeaderSend:
    """An ASGI ``send`` that adds ``headers`` to the response start.

    The app wraps ``send`` in one for the routes Quart serves (and the answers it writes
    itself), so that ``X-Request-Id`` and the CORS headers are on every response. The
    generation routes add the headers themselves and keep hypercorn's ``send``: no extra
    call per streamed event.
    """

    __slots__ = ("_send", "_headers", "complete")

    def __init__(self, send, headers: list) -> None:
        self._send = send
        self._headers = headers
        #: True once the last body message of the response is being sent.
        self.complete = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *self._headers]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    def receive(self, receive):
        """``receive``, except that the ``http.disconnect`` that hypercorn delivers from
        inside the response's last ``send`` is kept back. quart-trio cancels the request on
        it, and that would cancel what hypercorn does next in that same ``send``: close the
        connection (``Connection: close``, HTTP/1.0) or restart its keep-alive idle timer.
        quart-trio ends this wait itself once the response is sent."""

        async def receive_until_complete():
            message = await receive()
            if message["type"] == "http.disconnect" and self.complete:
                await trio.sleep_forever()
            return message

        return receive_until_complete
