"""Hypercorn's per-connection classes, with bounded writes and a short path for body chunks.

Theory of operation
-------------------
Hypercorn's Trio worker serves each TCP connection with a ``TCPServer``: a reader task that
feeds bytes to the HTTP protocol, and ``protocol_send`` that the protocol calls with the
bytes to write. Upstream, every write takes a lock, opens a shielded cancel scope and goes
through ``SocketStream.send_all``: two trips through Trio's scheduler and a handful of
context managers per write. For a server whose responses are thousands of small SSE writes
a second, that was a third of the frontend's CPU (``docs/benchmarks.md``).

:class:`BoundedWriteTCPServer` changes two things, and :func:`install` makes hypercorn use it:

* **Direct writes.** When no other write is in progress on the connection (the lock is
  free), the bytes are handed to the kernel with one non-blocking ``write``. Nothing awaits
  in between, so no other task can start a write on the connection meanwhile, and the order
  of writes is kept. Only what the kernel does not take at once (a full socket buffer), or a
  failed write, goes the slow way below, which reports a broken or closed connection as
  before.
* **Bounded writes.** Hypercorn shields every write from cancellation, so a client that
  stops reading (its TCP window full) would block its request's task for as long as the
  connection lives: neither the request timeout, nor the drain's abort, nor hypercorn's
  graceful close could end it, and the request kept its --max-concurrent-requests slot. A
  write that cannot finish within ``config.send_timeout`` closes the connection instead
  (the app then sees a disconnect and lets the request go). The scopes of blocked writes
  are kept in ``config.active_writes``, so that :func:`cut_stalled_writes` can shorten them
  when the server stops.

TLS connections (``trio.SSLStream``) always take the slow path: their bytes must go through
the TLS layer.

Above it, hypercorn's HTTP/1.1 protocol turns each ASGI body message into an h11 ``Data``
event, and h11 checks it against its state machine and frames it. :class:`ServingH11Protocol`
frames the chunks of a response that h11 has already decided to send chunked (its state is
``SEND_BODY`` with the chunked writer) itself: ``<size in hex>\r\n<bytes>\r\n``, exactly
what h11 writes. A ``Data`` event changes no h11 state, so h11 is still right about
everything else (the response head, the last chunk, keep-alive); any other framing
(``Content-Length``, an HTTP/1.0 client) goes through h11 as before.

Writes that no longer yield to the scheduler made one race of hypercorn's likely: an answer
given before the request body was read (a 401) can be complete before hypercorn's reader
has the end of the body, and hypercorn then closes the connection instead of keeping it
alive. The generation routes therefore read the body before such answers, or say
``Connection: close`` (see :func:`server.http.asgi.discard_body`).
"""

from __future__ import annotations

import logging
import os

import h11
import hypercorn.protocol
import hypercorn.protocol.h11
import hypercorn.trio.run
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import Body, Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import suppress_body

try:  # h11's chunked writer (private): without it, every chunk goes through h11 as usual
    from h11._writers import ChunkedWriter
except ImportError:  # pragma: no cover
    ChunkedWriter = None

__all__ = [
    "BoundedWriteTCPServer",
    "KeepAliveTask",
    "ServingH11Protocol",
    "ServingHTTPStream",
    "cut_stalled_writes",
    "install",
]

log = logging.getLogger("server")


class KeepAliveTask:
    """Hypercorn's keep-alive timer task (its ``TrioSingleTask``), without the lock.

    Hypercorn restarts the timer when a connection becomes idle (after each response) and
    stops it when a request arrives. Upstream both take a lock, and a restart waits for the
    new task to start: a trip through the scheduler on every request, one of them between
    the request's bytes arriving and the app being called. Here ``stop`` only cancels, and
    ``restart`` cancels the previous timer and spawns the next one; neither waits.
    """

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    async def restart(self, task_group, action) -> None:
        if self._scope is not None:
            self._scope.cancel()
        scope = self._scope = trio.CancelScope()
        task_group.spawn(_run_in_scope, scope, action)

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None


async def _run_in_scope(scope: trio.CancelScope, action) -> None:
    with scope:  # cancelled before it started: the action is cancelled at once
        await action()


class BoundedWriteTCPServer(TCPServer):
    """Hypercorn's connection with direct and bounded writes (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task = KeepAliveTask()

    async def _read_data(self) -> None:
        await super()._read_data()
        # The client closed the connection (or reading failed): hypercorn's connection task
        # group would otherwise wait for the keep-alive idle timer (keep_alive_timeout, 30 s
        # by default) before letting go of this connection's tasks and buffers.
        await self.idle_task.stop()

    async def protocol_send(self, event) -> None:
        if type(event) is not RawData:
            await super().protocol_send(event)
            return
        data = event.data
        stream = self.stream
        if type(stream) is trio.SocketStream and not self.send_lock.locked():
            try:
                # fileno() is -1 once the socket is closed: the write then fails (EBADF).
                sent = os.write(stream.socket.fileno(), data)
            except OSError:  # a full buffer (EAGAIN), or a broken or closed connection
                sent = 0
            if sent == len(data):
                return
            if sent:  # the rest must follow, even if the caller is being cancelled
                await self._send_bounded(memoryview(data)[sent:], torn=True)
                return
        await self._send_bounded(data)

    async def _send_bounded(self, data, *, torn: bool = False) -> None:
        """Write ``data`` under the lock, shielded and bounded by the send timeout. ``torn``:
        the rest of a partial direct write; the lock is free (nothing yielded since that
        write), and it is taken inside the shield so that a cancelled caller cannot leave a
        chunk half-written. Otherwise waiting for the lock stays cancellable, as upstream."""
        scope = trio.CancelScope(shield=True)
        broken = False
        if torn:
            with scope:
                async with self.send_lock:
                    broken = await self._send_all(data, scope)
        else:
            async with self.send_lock:
                with scope:
                    broken = await self._send_all(data, scope)
        if broken:
            await self.protocol.handle(Closed())
        elif scope.cancelled_caught:  # a half-written response: the connection is done for
            log.info("closing a connection whose client stopped reading")
            await self.stream.aclose()
            await self.protocol.handle(Closed())

    async def _send_all(self, data, scope: trio.CancelScope) -> bool:
        """``send_all`` within ``config.send_timeout`` from now, its scope registered for
        :func:`cut_stalled_writes`; returns whether the connection was broken or closed."""
        timeout = getattr(self.config, "send_timeout", None)
        if timeout is not None:
            scope.deadline = trio.current_time() + timeout
        writes = getattr(self.config, "active_writes", None)
        if writes is not None:
            writes.add(scope)
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True
        finally:
            if writes is not None:
                writes.discard(scope)
        return False


class ServingH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, framing the chunks of a chunked response itself."""

    #: The response head went out and h11 chose chunked framing for its body.
    _chunked = False

    async def stream_send(self, event) -> None:
        if type(event) is Body and self._chunked:
            data = event.data
            if data:  # h11 writes nothing for an empty chunk (it would end the body)
                await self.send(RawData(data=b"%x\r\n%b\r\n" % (len(data), data)))
            return
        self._chunked = False
        await super().stream_send(event)
        if type(event) is Response:
            connection = self.connection
            self._chunked = ChunkedWriter is not None and (
                type(getattr(connection, "_writer", None)) is ChunkedWriter
                and connection.our_state is h11.SEND_BODY
            )


class ServingHTTPStream(HTTPStream):
    """Hypercorn's ASGI side of one HTTP request, passing body messages of a response in
    progress (more to come, bytes, a response that has a body) straight to the protocol;
    everything else is hypercorn's own ``app_send``."""

    #: The response started and its body is sent (not a HEAD, a 204 or a 304).
    _body_ok = False

    async def app_send(self, message) -> None:
        if message is not None and self._body_ok and message.get("more_body", False):
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and type(body) is bytes:
                if body:
                    await self.send(Body(stream_id=self.stream_id, data=body))
                return
        await super().app_send(message)
        self._body_ok = self.state == ASGIHTTPState.RESPONSE and not suppress_body(
            self.scope["method"], int(self.response["status"])
        )


def install() -> None:
    """Make hypercorn's Trio worker use :class:`BoundedWriteTCPServer` for its connections,
    :class:`ServingH11Protocol` for HTTP/1.1 on them and :class:`ServingHTTPStream` for
    each request.

    Hypercorn's modules refer to the classes they imported; this replaces those names, for
    every hypercorn server in the process (the behaviour is the same, only cheaper and
    bounded). Called when :mod:`server.http.serve` is imported; harmless to call again.
    """
    hypercorn.trio.run.TCPServer = BoundedWriteTCPServer
    hypercorn.protocol.H11Protocol = ServingH11Protocol
    hypercorn.protocol.h11.HTTPStream = ServingHTTPStream


def cut_stalled_writes(hc: HypercornConfig, grace: float) -> None:
    """From now on no write may take longer than ``grace`` seconds, blocked ones included."""
    hc.send_timeout = grace if hc.send_timeout is None else min(hc.send_timeout, grace)
    deadline = trio.current_time() + grace
    for scope in list(hc.active_writes):
        scope.deadline = min(scope.deadline, deadline)


install()
