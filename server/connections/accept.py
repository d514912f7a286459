"""Listening and accepting: this server's replacement for hypercorn's Trio ``serve`` loop.

Theory of operation
-------------------
Hypercorn's loop (``hypercorn.trio.run.worker_serve``) runs every connection as a child of
the server's nursery, and structured concurrency makes an error in a child end its parent:
one connection that raised (a bug of ours, of hypercorn, of h11) ended the whole server.
This module keeps hypercorn's parts (its lifespan handling, its per-connection server, its
protocols) and owns the loop itself, so that it can hold these by construction:

* **No connection can end the server.** Each connection runs in :meth:`ConnectionPool.serve`,
  whose ``except`` is the per-connection boundary. Whatever the connection raised ends that
  connection (its requests' tasks are cancelled with it, which aborts their engine
  requests). It is logged once with the peer and the last request id seen on it, and
  counted (``trio_llm:connection_errors_total``). Cancellation still passes.
* **A bounded number of connections** (``--max-connections``). A new connection beyond the
  limit first ends the oldest idle keep-alive connection, if there is one (as nginx reuses
  idle connections); otherwise it gets a fixed ``503`` written without any parsing, and is
  closed. The default leaves room below the process's file-descriptor limit.
* **Out of descriptors** (``EMFILE``): accepting pauses and retries every 100 ms; one line is
  logged when an episode starts and one when it ends, never one per attempt.
* **A listen backlog of our choosing** (``--backlog``, default 2048; the kernel caps it at
  ``net.core.somaxconn``). Hypercorn's default of 100 made connects wait for seconds
  under bursts.

All this relies on hypercorn's internals (:mod:`server.connections.private_api`). When the
installed hypercorn or h11 is not the version it was written for, :func:`serve_public`
serves through hypercorn's public ``serve()`` instead, without these guarantees.

Shutdown follows hypercorn's: stop accepting, mark the worker context terminated (idle
keep-alive connections close, busy ones close after their response), give connections
``graceful_timeout`` seconds, then cancel them; then the ASGI lifespan shutdown.

The pool's :class:`ConnectionInfo` travels in a context variable into every task the
connection spawns, so that the app can note the request id on it for the boundary's log
line.
"""

from __future__ import annotations

import contextvars
import errno
import logging
import math
import os
import resource
import socket
import time
from dataclasses import dataclass

import trio
import hypercorn.trio
from hypercorn.config import Config as HypercornConfig

from ..errors import ServiceUnavailable, error_body
from .connection import ServingConnection
from ..openai.encode import dumps
from .private_api import Lifespan, WorkerContext, repr_socket_addr, wrap_app

__all__ = [
    "ConnectionInfo",
    "ConnectionPool",
    "ConnectionStatistics",
    "ListenError",
    "connection_info",
    "default_max_connections",
    "serve_app",
    "serve_public",
]

log = logging.getLogger("server")

#: The connection a task serves (set by the pool for every connection's tasks).
connection_info: contextvars.ContextVar[ConnectionInfo | None] = contextvars.ContextVar(
    "trio_llm_connection", default=None
)

_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

# Descriptors kept free for what is not a connection: worker pipes, log files, the
# listening sockets, imports.
_RESERVED_DESCRIPTORS = 128


def default_max_connections() -> int:
    """The default connection limit: the soft ``RLIMIT_NOFILE`` less a reserve (at least
    64), or 65536 when the limit is unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, soft - _RESERVED_DESCRIPTORS)


class ConnectionInfo:
    """What the boundary's log line says of a connection: its peer, the last request id."""

    __slots__ = ("peer", "request_id")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.request_id: str | None = None


@dataclass(frozen=True)
class ConnectionStatistics:
    """A snapshot of :class:`ConnectionPool` (for ``/metrics``)."""

    open: int
    idle: int
    accepted: int
    refused: int
    reaped_idle: int
    errors: int
    descriptor_exhaustions: int


def _refusal_response() -> bytes:
    body = dumps(
        error_body(
            ServiceUnavailable(
                "The server is at its connection limit; retry later.", code="too_many_connections"
            )
        )
    )
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%b" % (len(body), body)
    )


_REFUSAL = _refusal_response()


class ConnectionPool:
    """The connections of one server: accepts, limits and guards them (module docstring)."""

    def __init__(self, app, hc: HypercornConfig, context: WorkerContext, max_connections: int):
        self.app = app
        self.hc = hc
        self.context = context
        self.max_connections = max_connections
        #: Idle keep-alive connections, oldest first (maintained by the connections:
        #: ServingConnection.become_idle). A connection is idle from its accept until its
        #: first request too: the newest, so the last to be closed for room.
        self.idle: dict[ServingConnection, None] = {}
        self.open = 0
        self.accepted = 0
        self.refused = 0
        self.reaped_idle = 0
        self.errors = 0
        self.descriptor_exhaustions = 0
        self._exhausted_since: float | None = None
        self._exhausted_attempts = 0

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            self.open, len(self.idle), self.accepted, self.refused, self.reaped_idle,
            self.errors, self.descriptor_exhaustions,
        )

    async def accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections from ``listener`` forever, each served in ``nursery``."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _OUT_OF_DESCRIPTORS:
                    raise
                self._out_of_descriptors(exc)
                await trio.sleep(0.1)
                continue
            if self._exhausted_since is not None:
                self._descriptors_back()
            if self.open >= self.max_connections and not self._make_room():
                self._refuse(stream)
                continue
            self.open += 1
            self.accepted += 1
            nursery.start_soon(self.serve, stream)

    def _make_room(self) -> bool:
        """End the oldest idle connection; whether there was one."""
        for conn in self.idle:
            if conn.close_if_idle():
                self.reaped_idle += 1
                return True
        return False

    def _refuse(self, stream: trio.SocketStream) -> None:
        self.refused += 1
        sock = stream.socket
        try:  # a fresh socket's buffer takes this at once (non-blocking); if not, nothing
            os.write(sock.fileno(), _REFUSAL)
            sock.shutdown(socket.SHUT_WR)  # the answer, then FIN, before the close
        except OSError:
            pass
        sock.close()
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning(
                "connection limit (%d) reached: refused %d connection(s) so far "
                "(raise --max-connections, or add servers)",
                self.max_connections, self.refused,
            )

    def _out_of_descriptors(self, exc: OSError) -> None:
        self._exhausted_attempts += 1
        if self._exhausted_since is None:
            self._exhausted_since = time.monotonic()
            self.descriptor_exhaustions += 1
            log.error(
                "cannot accept connections: %s (%d open); retrying every 100 ms. Lower "
                "--max-connections or raise the limit (ulimit -n)",
                exc.strerror or exc, self.open,
            )

    def _descriptors_back(self) -> None:
        since = self._exhausted_since
        log.warning(
            "accepting connections again after %.1f s out of file descriptors (%d attempts)",
            time.monotonic() - (since if since is not None else time.monotonic()),
            self._exhausted_attempts,
        )
        self._exhausted_since = None
        self._exhausted_attempts = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        """Serve one connection; the per-connection boundary (module docstring)."""
        info = ConnectionInfo("?")
        try:
            peer = stream.socket.getpeername()
            info.peer = repr_socket_addr(stream.socket.family, peer)
        except OSError:
            pass
        connection_info.set(info)  # this task's context: copied into the tasks it spawns
        conn = ServingConnection(self.app, self.hc, self.context, {}, stream, idle=self.idle)
        try:
            await conn.run()
        except Exception as exc:  # noqa: BLE001 - the boundary: nothing passes but Cancelled
            self._failed(info, exc)
        except BaseExceptionGroup as group:
            # Cancelled (and KeyboardInterrupt, SystemExit) pass; errors stop here.
            errors, passing = group.split(Exception)
            if errors is not None:
                self._failed(info, errors)
                del errors
            if passing is not None:
                try:
                    raise passing from None
                finally:
                    del passing
        finally:
            self.open -= 1
            self.idle.pop(conn, None)
            stream.socket.close()  # if the connection's own close did not get to it

    def _failed(self, info: ConnectionInfo, exc: BaseException) -> None:
        self.errors += 1
        log.error(
            "connection from %s ended by an error (last request id %s); the server goes on",
            info.peer, info.request_id or "none", exc_info=exc,
        )


class ListenError(Exception):
    """The server cannot listen where it was told (a port in use, an address not here, no
    permission): a configuration error, said in one line."""


def open_sockets(hc: HypercornConfig, backlog: int) -> list:
    """Hypercorn's bound sockets for ``hc.bind``, listening with ``backlog``; raises
    :class:`ListenError` when it cannot."""
    try:
        sockets = hc.create_sockets()
    except OSError as exc:
        where = ", ".join(hc.bind)
        raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    for sock in sockets.insecure_sockets:
        sock.listen(backlog)
    return list(sockets.insecure_sockets)


async def serve_app(
    app,
    hc: HypercornConfig,
    *,
    backlog: int = 2048,
    max_connections: int | None = None,
    shutdown_trigger,
    on_pool=None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` over HTTP/1.1 on ``hc.bind`` until ``shutdown_trigger()``
    returns. ``started(urls)`` once listening; ``on_pool(pool)`` is called with the
    :class:`ConnectionPool` before the first connection is accepted."""
    app = wrap_app(app, hc.wsgi_max_body_size, "asgi")
    lifespan = Lifespan(app, hc, {})
    context = WorkerContext(None)
    pool = ConnectionPool(app, hc, context, max_connections or default_max_connections())
    if on_pool is not None:
        on_pool(pool)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            sockets = open_sockets(hc, backlog)
            listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in sockets]
            binds = [f"http://{repr_socket_addr(s.family, s.getsockname())}" for s in sockets]
            try:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(pool.accept_loop, listener, connections)
                    task_status.started(binds)
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                for listener in listeners:
                    with trio.CancelScope(shield=True):
                        await listener.aclose()
                await context.terminated.set()
                for conn in list(pool.idle):  # (those that become idle later end at once)
                    conn.close_if_idle()
                timeout = hc.graceful_timeout
                connections.cancel_scope.deadline = trio.current_time() + (
                    timeout if timeout is not None else math.inf
                )
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def serve_public(
    app, hc: HypercornConfig, *, backlog: int = 2048, shutdown_trigger,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """The fallback of :func:`serve_app`: hypercorn's public ``serve()``, with its own
    connections (no connection limit, no per-connection boundary, HTTP/2 cleartext served,
    hypercorn's writes and request parsing). Same arguments, same ``started(urls)``; a
    socket that cannot be bound is a :class:`ListenError` as there."""
    hc.backlog = backlog
    listening = False

    class _Status:
        def started(self, value=None) -> None:
            nonlocal listening
            listening = True
            task_status.started(value)

    try:
        await hypercorn.trio.serve(app, hc, shutdown_trigger=shutdown_trigger, task_status=_Status())
    except* OSError as group:
        if listening:
            raise
        exc = group.exceptions[0]
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        where = ", ".join(hc.bind)
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ListenError(f"cannot listen on {where}: {message}") from None
