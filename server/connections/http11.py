"""HTTP/1.1 on one connection: hypercorn's protocol classes, scoped to this server.

Hypercorn picks HTTP/1.1 or HTTP/2 per connection (``ProtocolWrapper``), parses with h11
(``H11Protocol``) and runs one ASGI request at a time (``HTTPStream``). This module's
subclasses are used only by connections that :mod:`server.connections.connection` serves for this
server; nothing here changes hypercorn for other apps in the process.

* :class:`ServingProtocolWrapper` speaks HTTP/1.1 only. Cleartext HTTP/2 (prior knowledge
  or ``Upgrade: h2c``) is not served: hypercorn's HTTP/2 code ends the whole server on some
  frame sequences, and HTTP/2 between a proxy and this server gains nothing for SSE. The
  preface is answered 505, an ``Upgrade`` header is ignored (the request is served as
  HTTP/1.1). See docs/operations.md, "Security".
* :class:`ServingH11Protocol` refuses, before the app, the request heads of
  :mod:`server.connections.framing` (400/505 with an OpenAI-style body and ``Connection: close``),
  and frames the chunks of a response h11 already sends chunked itself:
  ``<size in hex>\\r\\n<bytes>\\r\\n``, exactly what h11 writes. A ``Data`` event changes no
  h11 state, so h11 is still right about everything else (the head, the last chunk,
  keep-alive); any other framing (``Content-Length``, an HTTP/1.0 client) goes through h11.
* :class:`ServingHTTPStream` passes the body messages of a response in progress straight to
  the protocol (one call instead of hypercorn's state checks per SSE event).

The private names of hypercorn and h11 these classes rely on are all in
:mod:`server.connections.private_api` (its table says which and why); the classes here override
the public hooks its adapters give them. When the installed versions are not the ones it
was written for, none of this is used: the server serves through hypercorn's public
``serve()`` instead.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from itertools import chain
from http import HTTPStatus

import h11

from ..errors import ClientError, error_body
from ..observability.logs import request_id_from_header
from ..openai.encode import dumps
from .framing import Refusal, check_request_head
from .private_api import (
    STREAM_ID,
    ASGIHTTPState,
    Body,
    Closed,
    EndBody,
    H11Hooks,
    HTTPStreamHooks,
    RawData,
    Request,
    Response,
    StreamClosed,
    StrictH11Connection,
    suppress_body,
)

__all__ = [
    "DIRECT_BODY",
    "DirectBody",
    "ServingH11Protocol",
    "ServingHTTPStream",
    "ServingProtocolWrapper",
    "chunk",
    "refusal_events",
]

log = logging.getLogger("server.http")


def refusal_events(refusal: Refusal, request_id: str, extra_headers=()) -> list:
    """The h11 events of the whole answer to a refused request (sans-IO)."""
    body = dumps(error_body(ClientError(refusal.message, code=refusal.code)))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id.encode("ascii")),
        (b"connection", b"close"),
        *extra_headers,
    ]
    return [
        h11.Response(status_code=refusal.status, headers=headers, reason=_reason(refusal.status)),
        h11.Data(data=body),
        h11.EndOfMessage(),
    ]


@functools.cache
def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b"Error"


#: What h11 refused (before the app), by the status it suggests.
_PARSE_ERRORS = {
    400: ("The request is not valid HTTP/1.1.", "invalid_http"),
    431: ("The request head is too large.", "request_header_fields_too_large"),
    501: ("This server supports no Transfer-Encoding but chunked.", "not_implemented"),
}


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body: ``<size in hex>\\r\\n<bytes>\\r\\n``,
    exactly what h11 writes (not for empty data: that would end the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class ServingH11Protocol(H11Hooks):
    """Hypercorn's HTTP/1.1 protocol with strict request heads and our own chunk framing."""

    #: The response head went out and h11 chose chunked framing for its body.
    chunked = False

    def __init__(self, *args, writer=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: The connection's direct writer (``write_nowait``, ``send_torn``), if it has one.
        self.writer = writer
        self.connection = StrictH11Connection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )

    async def handle(self, event) -> None:
        try:
            await super().handle(event)
        except Refusal as refusal:
            await self._refuse(refusal)

    async def _refuse(self, refusal: Refusal) -> None:
        """Answer a refused head (unless a response already started) and close."""
        await self._answer(refusal)
        log.info("refused a request (%s) from %s: %s", refusal.code, _peer(self.client), refusal)
        await self.send(Closed())

    async def send_error_response(self, status_code: int) -> None:
        # A request h11 could not parse: hypercorn's bodiless answer, with an OpenAI body.
        message, code = _PARSE_ERRORS.get(status_code, _PARSE_ERRORS[400])
        await self._answer(Refusal(status_code, message, code))

    async def _answer(self, refusal: Refusal) -> None:
        if self.connection.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # a response is under way: closing is all that is left
        request_id, _ = request_id_from_header(None)
        extra = self.config.response_headers("h11")
        for event in refusal_events(refusal, request_id, extra):
            await self.send_h11_event(event)

    async def check_protocol(self, event: h11.Request) -> None:
        # Called as soon as h11 parsed the head, before hypercorn's loop sends a
        # ``100 Continue`` (at the top of its next turn): a refusal here goes out first.
        body_limit = getattr(self.config, "body_limit", None)  # (a ServingConfig's)
        refusal = check_request_head(
            event.http_version, event.headers,
            expects_continue=self.connection.they_are_waiting_for_100_continue,
            max_body=None if body_limit is None else body_limit(event.target),
        )
        if refusal is not None:
            try:
                raise refusal
            finally:  # no local may hold it: exception, traceback and frame would cycle
                del refusal

    async def create_stream(self, request: h11.Request) -> None:
        # Hypercorn's, less the WebSocket upgrade (an Upgrade header is ignored), with our
        # stream class.
        self.stream = ServingHTTPStream(
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.ssl,
            self.client,
            self.server,
            self.stream_send,
            STREAM_ID,
        )
        if self.writer is not None:
            self.stream.direct_body = DirectBody(self.stream, self, self.writer)
        headers = (
            request.headers.raw_items() if self.config.h11_pass_raw_headers else list(request.headers)
        )
        await self.stream.handle(
            Request(
                stream_id=STREAM_ID,
                headers=headers,
                http_version=request.http_version.decode(),
                method=request.method.decode("ascii").upper(),
                raw_path=request.target,
                state=self.connection_state,
            )
        )
        self.keep_alive_requests += 1
        await self.context.mark_request()

    async def write_h11_event(self, event) -> None:
        """Hypercorn writes status lines with no reason phrase (``HTTP/1.1 400 ``), which
        some proxies and tools print as an empty reason: give each its standard phrase."""
        if type(event) in (h11.Response, h11.InformationalResponse) and not event.reason:
            event = type(event)(status_code=event.status_code, headers=event.headers,
                                http_version=event.http_version,
                                reason=_reason(event.status_code))
        await super().write_h11_event(event)

    async def stream_send(self, event) -> None:
        if type(event) is Body and self.chunked:
            data = event.data
            if data:  # h11 writes nothing for an empty chunk (it would end the body)
                await self.send(RawData(data=chunk(data)))
            return
        self.chunked = False
        if type(event) is Response and event.status_code >= 200:
            # Hypercorn's response head, built once with its reason phrase (not rebuilt
            # by write_h11_event: h11 validates every header of each event it builds).
            headers = list(chain(event.headers, self.config.response_headers("h11")))
            if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                headers.append((b"connection", b"close"))
            await self.send_h11_event(h11.Response(
                headers=headers, status_code=event.status_code,
                reason=_reason(event.status_code),
            ))
            self.chunked = self.chunked_body()
            return
        await super().stream_send(event)
        if type(event) is EndBody and self.writer is not None:
            # The response's last bytes are written: what was held for them goes now, with
            # them (the connection's hold_writes), before the stream closes.
            await self.writer.release_writes()


def _peer(client) -> str:
    if not client:
        return "?"
    return f"{client[0]}:{client[1]}"


_RESPONSE = ASGIHTTPState.RESPONSE

#: The ASGI scope extension of :class:`DirectBody` (only this server's connections have it).
DIRECT_BODY = "trio_llm.direct_body"


class DirectBody:
    """Writes of body chunks that need no task: the ASGI extension :data:`DIRECT_BODY`.

    For a response in progress with chunked framing, :meth:`write_nowait` hands one chunk
    to the kernel at once, from any code that runs in the connection's thread (the worker's
    router, which has the text in hand), when no other write is in progress. What the
    kernel does not take is the caller's to send next, with :meth:`send_torn`, before any
    other message of the response. Everything else (the head, the last chunk, errors)
    goes through the ASGI ``send`` as usual.

    The stream and the protocol are held weakly: both hold this object (the stream as an
    attribute and in its scope), and strong references back would make each request a
    reference cycle, freed only by the garbage collector (with a pause) instead of when its
    last reference goes.
    """

    __slots__ = ("_stream", "_protocol", "_connection", "_on_disconnect")

    def __init__(self, stream: ServingHTTPStream, protocol: ServingH11Protocol, connection) -> None:
        self._stream = weakref.ref(stream)
        self._protocol = weakref.ref(protocol)
        self._connection = connection
        self._on_disconnect: Callable[[], None] | None = None

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` when the request's stream ends: the client went away, or the
        connection closed, or the response is over. That is when hypercorn puts
        ``http.disconnect`` in the app's queue, so a route needs no task parked in
        ``receive`` to learn it. At once when the stream has already ended. The callback
        is plain and must not raise; None stops the calls (before the route returns)."""
        self._on_disconnect = callback
        if callback is not None:
            stream = self._stream()
            if stream is None or stream.closed:
                callback()

    def disconnected(self) -> None:
        """The request's stream ended (its ``StreamClosed``): :meth:`on_disconnect`'s call."""
        callback = self._on_disconnect
        if callback is not None:
            self._on_disconnect = None
            callback()

    def usable(self) -> bool:
        """Whether a chunked body is in progress (not an HTTP/1.0 or Content-Length body,
        not before the head or after the last chunk): only then can it write.
        (:meth:`write_parts_nowait` repeats these tests inline: change both.)"""
        stream = self._stream()
        protocol = self._protocol()
        return (
            stream is not None and protocol is not None
            and stream.body_ok and protocol.chunked and not stream.closed
            and stream.state == ASGIHTTPState.RESPONSE
        )

    def write_nowait(self, body: bytes) -> bytes | None:
        """Write ``body`` as one chunk now. Returns None when nothing was written (no body
        in progress, another write under way, a full socket buffer, a broken connection:
        send it the usual way), ``b""`` when all of it was, else the rest of the framed
        chunk, which must go next, with :meth:`send_torn`."""
        return self.write_parts_nowait(b"", body, b"")

    def write_parts_nowait(self, head: bytes, middle: bytes, tail: bytes) -> bytes | None:
        """:meth:`write_nowait` of ``head + middle + tail``, framed in one step: the
        router's sink writes every streamed event through this, so it copies the event
        once and repeats :meth:`usable`'s tests inline rather than calling it."""
        stream = self._stream()
        protocol = self._protocol()
        if (
            stream is None or protocol is None or not stream.body_ok or not protocol.chunked
            or stream.closed or stream.state is not _RESPONSE
        ):
            return None
        size = len(head) + len(middle) + len(tail)
        if not size:
            return None
        data = b"%x\r\n%b%b%b\r\n" % (size, head, middle, tail)
        sent = self._connection.write_nowait(data)
        if sent <= 0:
            return None
        return data[sent:]

    async def send_torn(self, rest: bytes) -> None:
        """The rest of a chunk :meth:`write_nowait` tore; shielded, bounded like any write."""
        await self._connection.send_torn(rest)

    def hold(self) -> None:
        """Keep the response's next writes (the head included), to go out in one write at
        :meth:`release` or at the end of the body, whichever comes first. Only for messages
        ready at the same moment: the caller must release before it waits for anything."""
        self._connection.hold_writes()

    async def release(self) -> None:
        """Write what :meth:`hold` kept, in one write (nothing when nothing is held)."""
        await self._connection.release_writes()


class ServingHTTPStream(HTTPStreamHooks):
    """Hypercorn's ASGI side of one HTTP request, passing body messages of a response in
    progress (more to come, bytes, a response that has a body) straight to the protocol;
    everything else is hypercorn's own ``app_send``. Its scope offers :class:`DirectBody`
    when the connection is one of this server's."""

    #: The response started and its body is sent (not a HEAD, a 204 or a 304).
    body_ok = False
    #: Set by the protocol that creates it.
    direct_body: DirectBody | None = None

    async def handle(self, event) -> None:
        await super().handle(event)
        direct = self.direct_body
        if direct is None:
            return
        kind = type(event)
        # The app was spawned, not yet run: it finds the extension in its scope.
        if kind is Request and self.app_spawned():
            extensions: dict = self.scope["extensions"]  # type: ignore[typeddict-item]
            extensions[DIRECT_BODY] = direct
        elif kind is StreamClosed:  # (hypercorn put http.disconnect in the app's queue)
            direct.disconnected()

    async def app_send(self, message) -> None:
        if message is not None and self.body_ok and message.get("more_body", False):
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and type(body) is bytes:
                if body:
                    await self.send(Body(stream_id=self.stream_id, data=body))
                return
        await super().app_send(message)
        self.body_ok = self.state == ASGIHTTPState.RESPONSE and not suppress_body(
            self.scope["method"], int(self.response["status"])
        )


class ServingProtocolWrapper:
    """Hypercorn's ``ProtocolWrapper`` for this server: HTTP/1.1 only (module docstring)."""

    __slots__ = ("protocol",)

    def __init__(
        self, app, config, context, task_group, state, ssl, client, server, send, writer=None
    ) -> None:
        self.protocol = ServingH11Protocol(
            app, config, context, task_group, state, ssl, client, server, send, writer=writer
        )

    async def initiate(self) -> None:
        await self.protocol.initiate()

    async def handle(self, event) -> None:
        await self.protocol.handle(event)
