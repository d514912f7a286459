"""One TCP connection of this server: hypercorn's ``TCPServer`` with direct, progress-bounded
writes and a keep-alive timer that the listener can end early.

Theory of operation
-------------------
Hypercorn's Trio worker serves each TCP connection with a ``TCPServer``: a reader task that
feeds bytes to the HTTP protocol, and ``protocol_send`` that the protocol calls with the
bytes to write. Upstream, every write takes a lock, opens a shielded cancel scope and goes
through ``SocketStream.send_all``: two trips through Trio's scheduler and a handful of
context managers per write. For a server whose responses are thousands of small SSE writes
a second, the write (lock, shielded scope, ``send_all``) was 42 % of the frontend's CPU in
a profile of 128 streams (docs/changelog.md, 2026-11-30, "Where the CPU goes").

:class:`ServingConnection` is used only by :mod:`server.connections.accept` for this server's own
listeners (no hypercorn module is changed). It overrides the public hooks that
:class:`~server.connections.private_api.ConnectionHooks` gives hypercorn's private ones (that
module lists every private name relied on), and differs from upstream in these ways:

* **HTTP/1.1 only**, through :class:`~server.connections.http11.ServingProtocolWrapper`.
* **Direct writes.** When no other write is in progress on the connection (the lock is
  free), the bytes are handed to the kernel with one non-blocking ``write``. Nothing awaits
  in between, so no other task can start a write on the connection meanwhile, and the order
  of writes is kept. Only what the kernel does not take at once (a full socket buffer), or a
  failed write, goes the slow way below, which reports a broken or closed connection as
  before.
* **What is ready at once goes out at once, in one write.** A route that has several
  messages of a response in hand (a one-token stream's head, event, usage, ``[DONE]`` and
  last chunk) asks the connection to hold its writes (:meth:`ServingConnection.hold_writes`,
  ``DirectBody.hold``) and releases them before it waits for anything; the end of the body
  releases them too. The bytes and their order are the same, the syscalls fewer (four to
  one for that stream: docs/benchmarks.md, "Workload A and B").
* **Writes bounded by progress.** Hypercorn shields every write from cancellation, so a
  client that stops reading (its TCP window full) would block its request's task for as
  long as the connection lives. Here a blocked write goes on while the client takes bytes,
  however slowly, and closes the connection once it has taken none for
  ``config.send_timeout`` seconds (the app then sees a disconnect and lets the request go).
  The scopes of blocked writes are kept in ``config.active_writes``, so that
  :func:`cut_stalled_writes` can shorten them when the server stops.
* **Keep-alive.** The idle timer (upstream's ``TrioSingleTask``, a task spawned each time
  the connection becomes idle and cancelled when a request arrives) is the deadline of the
  connection's read (:class:`KeepAliveTask`): no task, no lock. While a connection is idle
  it is registered with the listener's pool, which may end it early
  (:meth:`ServingConnection.close_if_idle`) to make room for a new connection; a server
  that stops ends its idle connections at once, as upstream's timer does.
* Closing is shielded: a connection cancelled at shutdown still releases its socket.
* **No reference cycle of the connection's and its requests' HTTP objects outlives them**
  (this module's and :mod:`~server.connections.http11`'s, hypercorn's and h11's under
  them), so that they are freed as they end, not by the garbage collector. Hypercorn's
  objects refer to one another both ways; at 40 connections a second, the collections they
  needed paused the event loop for ~60 ms every 20 s (``docs/changelog.md``, 2026-12-03).

Writes that no longer yield to the scheduler made one race of hypercorn's likely: an answer
given before the request body was read (a 401) can be complete before hypercorn's reader
has the end of the body, and hypercorn then closes the connection instead of keeping it
alive. The generation routes therefore read the body before such answers, or say
``Connection: close`` (see :func:`server.http.asgi.discard_body`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from wsgiref.handlers import format_date_time

import trio
from hypercorn.config import Config as HypercornConfig

from .private_api import (
    MAX_RECV,
    Closed,
    ConnectionHooks,
    ConnectionState,
    RawData,
    TaskGroup,
    parse_socket_addr,
)
from .http11 import ServingProtocolWrapper

__all__ = ["KeepAliveTask", "ServingConfig", "ServingConnection", "cut_stalled_writes"]

log = logging.getLogger("server")


class KeepAliveTask:
    """Hypercorn's keep-alive timer (its ``TrioSingleTask``), as a deadline on the
    connection's read instead of a task.

    Hypercorn restarts the timer when a connection becomes idle (after each response, and
    at its start) and stops it when a request arrives. Upstream each restart spawns a task
    that waits for the keep-alive time and each stop cancels it: two spawns and two
    cancellations per connection of one request (docs/benchmarks.md, "the burst"). Here
    both only move the deadline of the
    connection's read (:meth:`ServingConnection.become_idle`, ``become_busy``); the read
    loop closes the connection when its read passes that deadline.
    """

    __slots__ = ("_conn",)

    def __init__(self, conn: ServingConnection) -> None:
        self._conn: ServingConnection | None = conn

    async def restart(self, task_group, action) -> None:
        if self._conn is not None:
            self._conn.become_idle()

    async def stop(self) -> None:
        if self._conn is not None:
            self._conn.become_busy()

    def release(self) -> None:
        """Let go of the connection once it has ended (no reference cycle outlives it)."""
        self._conn = None


class ServingConfig(HypercornConfig):
    """Hypercorn's configuration, plus what :class:`ServingConnection` reads: the send
    timeout (progress-based), the time past which no write may go on (set at shutdown by
    :func:`cut_stalled_writes`), and the cancel scopes of the writes in progress; and what
    its protocol's request-head checks read: the body limit (``--max-body-bytes``), and the
    larger limits of the paths in ``upload_limits`` (the Files API's uploads)."""

    send_timeout: float | None = None
    send_cutoff: float = math.inf
    max_body_bytes: int | None = None
    upload_limits: dict[bytes, int] = {}

    def body_limit(self, target: bytes) -> int | None:
        """The most body bytes a request to ``target`` (its path and query) may send."""
        return self.upload_limits.get(target.partition(b"?")[0], self.max_body_bytes)

    def __init__(self) -> None:
        super().__init__()
        self.active_writes: set[trio.CancelScope] = set()
        #: The last :meth:`response_headers`: (the second, the protocol), the headers.
        self._headers_of: tuple[tuple[int, str], list] = ((-1, ""), [])

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        """Hypercorn's headers of every response (the date, as configured), made once a
        second instead of once per response: the date has a resolution of one second."""
        key = (int(time.time()), protocol)
        of, headers = self._headers_of
        if of != key:
            headers = [
                (name, _http_date(key[0]) if name == b"date" else value)
                for name, value in super().response_headers(protocol)
            ]
            self._headers_of = (key, headers)
        return list(headers)


def _http_date(second: int) -> bytes:
    """The date header's value for ``second``, formatted as hypercorn formats it (from the
    cache's own clock read, so that the date is always the one of its key)."""
    return format_date_time(second).encode("ascii")


class ServingConnection(ConnectionHooks):
    """One connection of this server (see the module docstring). ``idle`` is the pool's set
    of idle connections (insertion-ordered: oldest first), or None."""

    config: ServingConfig
    protocol: ServingProtocolWrapper  # type: ignore[assignment]
    idle_task: KeepAliveTask  # type: ignore[assignment]

    def __init__(
        self, app, config, context, state, stream, *, idle: dict | None = None
    ) -> None:
        super().__init__(app, config, context, state, stream)
        self.idle_task = KeepAliveTask(self)
        self._idle = idle
        #: When the connection, idle, is closed: its keep-alive deadline (-inf: now; inf
        #: while a request is in hand, or once it is closing).
        self._idle_deadline = math.inf
        #: The scope of the read in progress (None between reads), which that deadline ends.
        self._read_scope: trio.CancelScope | None = None
        self._closing = False
        #: Writes held to go out together (:meth:`hold_writes`), or None: written at once.
        self._held: list[bytes] | None = None
        #: The socket's descriptor, asked at each write (-1 once it is closed), and the lock
        #: of the slow way's writes (looked up once: :meth:`write_nowait` runs per event).
        self._fileno = stream.socket.fileno
        self._locked = self.send_lock.locked

    async def run(self) -> None:
        """Serve the connection until it closes; errors of the protocol propagate (the
        listener's boundary stops them there)."""
        socket = self.stream.socket
        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            async with TaskGroup() as task_group:
                self.task_group = task_group
                self.protocol = ServingProtocolWrapper(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    False,
                    client,
                    server,
                    self.protocol_send,
                    writer=self,
                )
                await self.protocol.initiate()
                self.become_idle()  # (until its first request)
                await self.read_requests()
        except OSError:
            pass
        finally:
            await self.close_connection()
            # Every task of the connection is done. Hypercorn's protocol holds this object
            # (its send callback), and this object the protocol: let go of it, so that the
            # connection's objects are freed when the listener lets go of this one, not by
            # a collection of the garbage collector (a pause of every stream). So does the
            # keep-alive timer.
            self.protocol = None  # type: ignore[assignment]
            self.idle_task.release()

    async def close_connection(self) -> None:
        with trio.CancelScope(shield=True):  # nothing here blocks: shielded, and bounded
            await super().close_connection()

    async def read_requests(self) -> None:
        """Hypercorn's read loop, with the keep-alive timer as each read's deadline
        (:class:`KeepAliveTask`): a read past it ends the connection as upstream's timer
        does. Hypercorn's ``read_timeout`` (not this server's settings: serve.hypercorn_config)
        is honoured the same way."""
        receive_some = self.stream.receive_some
        handle = self.protocol.handle
        read_timeout = self.config.read_timeout
        while True:
            deadline = self._idle_deadline
            if read_timeout is not None:
                deadline = min(deadline, trio.current_time() + read_timeout)
            with trio.CancelScope(deadline=deadline) as scope:
                self._read_scope = scope
                try:
                    data = await receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                finally:
                    self._read_scope = None
            if scope.cancelled_caught:  # idle past its keep-alive (or ended early), or slow
                if self._idle_deadline != math.inf:
                    self.become_busy()
                    self._closing = True
                    with trio.CancelScope(shield=True):
                        await self.initiate_server_close()
                break
            await handle(RawData(bytes(data)))
            if not data:
                break
        await handle(Closed())
        self.become_busy()  # (no longer the pool's to end)

    # -- keep-alive ---------------------------------------------------------------------------

    def become_idle(self) -> None:
        """Between requests (hypercorn's timer restarted): the connection is closed after
        ``keep_alive_timeout`` seconds without a request, at once once the server stops,
        and it is registered with the pool as idle (the oldest idle first)."""
        if self._closing or self.context.terminated.is_set():  # (ended early meanwhile)
            self._set_idle_deadline(-math.inf)
        else:
            self._set_idle_deadline(trio.current_time() + self.config.keep_alive_timeout)
        idle = self._idle
        if idle is not None:
            idle.pop(self, None)
            idle[self] = None

    def become_busy(self) -> None:
        """A request arrived (hypercorn's timer stopped), or the connection is closing."""
        self._set_idle_deadline(math.inf)
        idle = self._idle
        if idle is not None:
            idle.pop(self, None)

    def _set_idle_deadline(self, deadline: float) -> None:
        self._idle_deadline = deadline
        scope = self._read_scope
        if scope is not None:
            scope.deadline = deadline

    def close_if_idle(self) -> bool:
        """End the connection now if it is between requests; returns whether it was."""
        if self._closing or self._idle_deadline == math.inf:
            return False
        self._closing = True
        self._set_idle_deadline(-math.inf)
        return True

    # -- writes -------------------------------------------------------------------------------

    async def protocol_send(self, event) -> None:
        if type(event) is not RawData:
            if self._held is not None:  # (a close, or the connection going idle)
                await self.release_writes()
            await super().protocol_send(event)
            return
        data = event.data
        held = self._held
        if held is not None:
            held.append(data)
            return
        sent = self.write_nowait(data)
        if sent == len(data):
            return
        if sent > 0:  # the rest must follow, even if the caller is being cancelled
            await self.send_torn(memoryview(data)[sent:])
            return
        await self._send_bounded(data)

    def hold_writes(self) -> None:
        """Keep what is written from now on, to hand it to the kernel in one write at
        :meth:`release_writes`: for a response whose messages are ready at the same moment
        (its head and first events, its last events and its end). The caller sends them
        without waiting in between and releases before it waits for anything; the end of a
        response body releases too (``ServingH11Protocol``), and so does any other event
        of the protocol (a close). Same bytes, in the same order, in fewer syscalls."""
        if self._held is None:
            self._held = []

    async def release_writes(self) -> None:
        """Write what :meth:`hold_writes` kept, in one write, and write at once again."""
        held = self._held
        if held is None:
            return
        self._held = None
        if held:
            await self.protocol_send(RawData(data=held[0] if len(held) == 1 else b"".join(held)))

    def write_nowait(self, data: bytes) -> int:
        """Hand ``data`` to the kernel with one non-blocking write, when no other write is
        in progress; returns how many bytes it took (0: none, or the lock is held, or writes
        are held (:meth:`hold_writes`, even before any is), or the connection is broken or
        closed: the slow way finds out which). A partial write must be completed with
        :meth:`send_torn` before anything else is written."""
        if self._held is not None or self._locked():
            return 0
        try:
            # fileno() is -1 once the socket is closed: the write then fails (EBADF).
            return os.write(self._fileno(), data)
        except OSError:  # a full buffer (EAGAIN), or a broken or closed connection
            return 0

    async def send_torn(self, rest) -> None:
        """The rest of a partial :meth:`write_nowait`, shielded (see :meth:`_send_bounded`)."""
        await self._send_bounded(rest, torn=True)

    async def _send_bounded(self, data, *, torn: bool = False) -> None:
        """Write ``data`` under the lock, shielded and bounded by progress. ``torn``: the
        rest of a partial direct write; the lock is free (nothing yielded since that write),
        and it is taken inside the shield so that a cancelled caller cannot leave a chunk
        half-written. Otherwise waiting for the lock stays cancellable, as upstream."""
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
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
            await self.protocol.handle(Closed())

    async def _send_all(self, data, scope: trio.CancelScope) -> bool:
        """Send all of ``data``; the deadline moves ``config.send_timeout`` past each write
        that made progress. ``scope`` is registered for :func:`cut_stalled_writes`. Returns
        whether the connection was broken or closed."""
        config = self.config
        writes = config.active_writes
        writes.add(scope)
        sock = self.stream.socket
        view = memoryview(data)
        try:
            while view:
                timeout = config.send_timeout
                deadline = math.inf if timeout is None else trio.current_time() + timeout
                scope.deadline = min(deadline, config.send_cutoff)
                sent = await sock.send(view)
                view = view[sent:]
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return True
        finally:
            writes.discard(scope)
        return False


def cut_stalled_writes(hc: ServingConfig, grace: float) -> None:
    """From now on no write may take longer than ``grace`` seconds, blocked ones included."""
    deadline = trio.current_time() + grace
    hc.send_cutoff = min(hc.send_cutoff, deadline)
    for scope in list(hc.active_writes):
        scope.deadline = min(scope.deadline, deadline)
