"""A listener for health probes only (``--health-port``): ``/health`` and ``/ready``.

Why it exists
-------------
A burst of connects on the public port fills its accept queue, and the kernel then drops
new connects there, a probe's among them. The client retries its SYN after 1, 3, 7 s, so a
kubelet probe with its default 1 s timeout fails: the pod is restarted or taken out of
rotation while the server is merely busy (issue 23, docs/benchmarks.md "Loop stalls from
big bodies and connect bursts"). A second listening socket has an accept queue of its
own: probes sent there are never queued behind the public port's connects.

Theory of operation
-------------------
This is deliberately not the HTTP path of the API (no hypercorn, no ASGI, no Quart): each
connection is a small h11 loop in one task, with keep-alive. It answers ``GET``/``HEAD``
of ``/health`` and ``/ready`` from ``answer(path)``, the app's own probe answers, so that
the two ports always agree; ``404`` for any other path and ``405`` for any other method. No
connection can end the listener: each one's errors end that connection only. The requests
parsed here are bounded by h11 (16 KiB of head; more is a 431) and a request h11 cannot
parse gets its 400 before the connection closes.

The port holds at most ``max_connections`` connections (probes are few), so no connection
may hold a slot for long (issue 42: 64 connections that sent a body never, a head slowly or
requests without reading the answers held the port shut, and the liveness probes with it).
And a connect at the cap first **makes room**: it ends the connection that has waited
longest on its client, as the API port ends its oldest idle keep-alive and the listening
worker its oldest unauthenticated connection. A connection waits (:class:`Waiting`) for a
request head, for the client to take an answer the socket could not take at once, or for
the end of an unread body. Only when every connection is being answered is the connect closed at once.
Bounding each connection was not enough: an attacker reopening ~13 connections a second
kept the 64 slots busy although each ended after its 5 s, and a probe got in only if it
won the moment a slot freed. Now the attacker's oldest connection goes, and the probe,
the newest, sends its head at once and is answered. The bounds, :class:`ProbeLimits`:

* **One deadline per request head**: the whole head must arrive within ``head_timeout`` of
  the connection being ready for it (accepted, or the previous answer sent), however it
  trickles in; else the connection is closed without an answer (as nginx's
  ``client_header_timeout``).
* **No body is read.** A request with one (``Content-Length`` above 0, chunked) gets its
  answer with ``Connection: close``; then the connection is closed after a short, bounded
  linger (``linger``: our side is shut, the client's bytes are read away until it closes)
  so that the answer is not lost to a reset.
* **Each write is bounded**: an answer not taken by the client within ``send_timeout``
  closes the connection (a client that pipelines requests and never reads the answers).
* **At most ``lifetime`` seconds of keep-alive**: the first answer after it says
  ``Connection: close``, so that even a client that reads just fast enough gives its slot
  back.
* **The cap is logged** when a connect meets it (made room, or refused): at once, then at
  most once per ``log_interval`` with the numbers since (:class:`CapReport`).

The decisions (what a request gets, when to log) are sans-IO; :func:`serve_probes` does
the I/O. The limits are constants, documented in docs/operations.md; tests set smaller
ones through :data:`LIMITS`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import h11
import trio

from ..openai.encode import dumps

__all__ = [
    "LIMITS", "PROBE_PATHS", "CapReport", "ProbeLimits", "Waiting", "answer_bytes", "serve_probes",
]

log = logging.getLogger("server.probes")

#: The paths answered on the probe port.
PROBE_PATHS = ("/health", "/ready")

#: Bytes read per ``receive_some``.
_RECEIVE_SIZE = 16384


@dataclass(frozen=True)
class ProbeLimits:
    """The probe port's bounds (module docstring); seconds unless said otherwise."""

    #: Connections served at once; a connect beyond first ends the one that waited longest
    #: on its client, and is closed at once if none waits.
    max_connections: int = 64
    #: A request's whole head must arrive within this, from the connection being ready.
    head_timeout: float = 5.0
    #: An answer must be taken by the client within this.
    send_timeout: float = 5.0
    #: After an answer to a request with a body: how long its bytes are read away.
    linger: float = 2.0
    #: Keep-alive ends with the first answer after this.
    lifetime: float = 60.0
    #: The cap's refusals are logged at most once per this.
    log_interval: float = 60.0


#: The limits :func:`serve_probes` uses when given none (read at each call).
LIMITS = ProbeLimits()


class CapReport:
    """When to log the connects that met the cap: the first at once, then at most one line
    per ``interval`` seconds, with the numbers since the last line. Sans-IO."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._made_room = 0
        self._refused = 0
        self._next = -math.inf

    def met(self, now: float, *, refused: bool) -> tuple[int, int] | None:
        """Count one connect at the cap at ``now`` (``refused``, or it made room); the
        numbers to log now, ``(made room, refused)``, or None."""
        if refused:
            self._refused += 1
        else:
            self._made_room += 1
        if now < self._next:
            return None
        counts = self._made_room, self._refused
        self._made_room = self._refused = 0
        self._next = now + self.interval
        return counts


class Waiting:
    """The connections that wait on their client now, the longest waiting first: the ones
    a connect at the cap may end to make room (module docstring). Each is represented by
    the cancel scope around its whole connection."""

    def __init__(self) -> None:
        self._scopes: dict[trio.CancelScope, None] = {}  # (insertion-ordered)

    @contextmanager
    def on_client(self, scope: trio.CancelScope) -> Iterator[None]:
        """While the block waits on the client, ``scope``'s connection may be ended."""
        self._scopes[scope] = None
        try:
            yield
        finally:
            self._scopes.pop(scope, None)

    def end_longest(self) -> bool:
        """End the connection that has waited longest; whether there was one."""
        for scope in self._scopes:
            del self._scopes[scope]
            scope.cancel()
            return True
        return False


async def serve_probes(
    listeners: list[trio.SocketListener],
    answer: Callable[[str], tuple[int, dict]],
    *,
    limits: ProbeLimits | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve probe requests on ``listeners`` until cancelled; ``started()`` once accepting.

    ``answer(path)`` gives the status and JSON body for a path of :data:`PROBE_PATHS`
    (never blocking: it reads the app's state). ``limits``: :data:`LIMITS` if None."""
    limits = limits or LIMITS
    open_connections = 0
    report = CapReport(limits.log_interval)
    waiting = Waiting()

    async def serve_one(stream: trio.SocketStream) -> None:
        nonlocal open_connections
        try:
            with trio.CancelScope() as scope:  # (cancelled to make room: waiting)
                await _serve_connection(_Probe(stream, limits, waiting, scope), answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass  # the peer went away or spoke nonsense: only this connection ends
        except Exception:  # a bug here must not end the probes, let alone the server
            log.exception("probe connection failed")
        finally:
            open_connections -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def accept_loop(listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        nonlocal open_connections
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # e.g. EMFILE: the connect waits in the backlog
                log.warning("probe port: accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            if open_connections >= limits.max_connections:
                # (the one ended counts as open until its task has closed it: briefly one
                # more than the cap)
                refused = not waiting.end_longest()
                if refused:
                    await stream.aclose()
                counts = report.met(trio.current_time(), refused=refused)
                if counts is not None:
                    log.warning(
                        "probe port: %d connections open, its cap: ended the one waiting "
                        "longest on its client for %d connect(s), refused %d connect(s) "
                        "since the last such line (a refused probe fails)",
                        open_connections, *counts,
                    )
                if refused:
                    continue
            open_connections += 1
            nursery.start_soon(serve_one, stream)

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(accept_loop, listener, nursery)
        task_status.started()


@dataclass
class _Probe:
    """One connection of the probe port, and what its I/O needs."""

    stream: trio.SocketStream
    limits: ProbeLimits
    waiting: Waiting
    #: Around the whole connection: cancelled to make room (:class:`Waiting`).
    scope: trio.CancelScope

    def on_client(self) -> AbstractContextManager[None]:
        """While the block waits on the client, this connection may be ended for room."""
        return self.waiting.on_client(self.scope)


async def _serve_connection(probe: _Probe, answer) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        await _serve_requests(probe, conn, answer)
    except h11.RemoteProtocolError as exc:  # a bad request: its status (400, 431), then close
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            response = h11.Response(status_code=exc.error_status_hint,
                                    headers=[(b"content-length", b"0"),
                                             (b"connection", b"close")])
            await _send(probe, conn.send(response) + conn.send(h11.EndOfMessage()))


async def _serve_requests(probe: _Probe, conn: h11.Connection, answer) -> None:
    limits = probe.limits
    last_call = trio.current_time() + limits.lifetime
    while True:
        request = None
        with trio.move_on_after(limits.head_timeout), probe.on_client():
            request = await _receive_request(probe.stream, conn)
        if request is None:
            return  # the head did not arrive in time, or the client closed
        close = trio.current_time() >= last_call
        if not await _send(probe, answer_bytes(conn, request, answer, close=close)):
            return
        if conn.their_state is not h11.DONE:  # its body is unread: the connection ends
            with probe.on_client():
                await _linger(probe.stream, limits.linger)
            return
        if conn.our_state is not h11.DONE:  # MUST_CLOSE: Connection: close, HTTP/1.0
            return
        conn.start_next_cycle()  # keep-alive: the next request


async def _receive_request(stream, conn: h11.Connection) -> h11.Request | None:
    """The next request's head, or None when the client closed first."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(_RECEIVE_SIZE))
            continue
        return event if isinstance(event, h11.Request) else None


def answer_bytes(conn: h11.Connection, request: h11.Request, answer, *, close: bool = False) -> bytes:
    """The whole answer to ``request`` (sans-IO; ``conn`` has just produced it). Reads no
    body: a request that has one is answered with ``Connection: close``, as is every
    request when ``close``."""
    path = request.target.decode("ascii", "replace").split("?", 1)[0]
    method = request.method
    if path not in PROBE_PATHS:
        code, body = 404, {"error": {"message": f"the probe port serves {', '.join(PROBE_PATHS)}",
                                     "type": "not_found", "param": None, "code": None}}
    elif method not in (b"GET", b"HEAD"):
        code, body = 405, {"error": {"message": "the probe port answers GET and HEAD",
                                     "type": "method_not_allowed", "param": None,
                                     "code": None}}
    else:
        code, body = answer(path)
    payload = dumps(body)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", b"%d" % len(payload))]
    if code == 503:
        headers.append((b"retry-after", b"1"))
    # A body-less request's end is known from its head alone (h11 needs no more bytes).
    if close or type(conn.next_event()) is not h11.EndOfMessage:
        headers.append((b"connection", b"close"))
    out = conn.send(h11.Response(status_code=code, headers=headers))
    if method != b"HEAD":
        out += conn.send(h11.Data(data=payload))
    return out + conn.send(h11.EndOfMessage())


async def _send(probe: _Probe, data: bytes) -> bool:
    """Send ``data`` within ``send_timeout``; whether it was all sent. What the socket does
    not take at once waits on the client (it has not read earlier answers): meanwhile this
    connection may be ended for room."""
    with trio.move_on_after(probe.limits.send_timeout):
        sent = _send_now(probe.stream, data)
        if sent < len(data):
            with probe.on_client():
                await probe.stream.send_all(data[sent:])
        return True
    return False


def _send_now(stream: trio.SocketStream, data: bytes) -> int:
    """What the socket takes of ``data`` without waiting (it is non-blocking)."""
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError as exc:  # (reset, EPIPE: as send_all says it)
        raise trio.BrokenResourceError(exc) from exc


async def _linger(stream, seconds: float) -> None:
    """Close our side, and read what the client still sends (a body) until it closes or
    ``seconds`` pass: closing with its bytes unread would reset the connection, and a
    reset can lose the answer before the client reads it (as nginx's lingering close)."""
    with trio.move_on_after(seconds):
        await stream.send_eof()
        while await stream.receive_some(_RECEIVE_SIZE):
            pass
