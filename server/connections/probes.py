"""A listener for health probes only (``--health-port``): ``/health`` and ``/ready``.

Why it exists
-------------
A burst of connects on the public port fills its accept queue, and the kernel then drops
new connects there, a probe's among them; the client retries its SYN after 1, 3, 7 s, so
a kubelet probe with its default 1 s timeout fails and the pod is restarted or taken out
of rotation while the server is merely busy (issue 23, docs/benchmarks.md "Loop stalls
from big bodies and connect bursts"). A second listening socket has an accept queue of its
own: probes sent there are never queued behind the public port's connects.

Theory of operation
-------------------
This is deliberately not the HTTP path of the API (no hypercorn, no ASGI, no Quart): each
connection is a small h11 loop in one task that answers ``GET``/``HEAD`` of ``/health``
and ``/ready`` from ``answer(path)`` (the app's own probe answers, so the two ports always
agree), ``404`` for any other path and ``405`` for any other method, with keep-alive. It
holds at most ``max_connections`` connections (a connect beyond that is closed at once:
probes are few), and a connection that sends nothing within ``idle_timeout`` is closed.
No connection can end the listener: each one's errors end that connection only. The
requests parsed here are bounded by h11 (16 KiB of head; more is a 431) and a request
h11 cannot parse gets its 400 before the connection closes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import h11
import trio

from ..openai.encode import dumps

__all__ = ["PROBE_PATHS", "serve_probes"]

log = logging.getLogger("server.probes")

#: The paths answered on the probe port.
PROBE_PATHS = ("/health", "/ready")


async def serve_probes(
    listeners: list[trio.SocketListener],
    answer: Callable[[str], tuple[int, dict]],
    *,
    max_connections: int = 64,
    idle_timeout: float = 5.0,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve probe requests on ``listeners`` until cancelled; ``started()`` once accepting.

    ``answer(path)`` gives the status and JSON body for a path of :data:`PROBE_PATHS`
    (never blocking: it reads the app's state)."""
    open_connections = 0

    async def serve_one(stream: trio.SocketStream) -> None:
        nonlocal open_connections
        try:
            await _serve_connection(stream, answer, idle_timeout)
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
            if open_connections >= max_connections:
                await stream.aclose()
                continue
            open_connections += 1
            nursery.start_soon(serve_one, stream)

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(accept_loop, listener, nursery)
        task_status.started()


async def _serve_connection(stream: trio.SocketStream, answer, idle_timeout: float) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        await _serve_requests(stream, conn, answer, idle_timeout)
    except h11.RemoteProtocolError as exc:  # a bad request: its status (400, 431), then close
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            response = h11.Response(status_code=exc.error_status_hint,
                                    headers=[(b"content-length", b"0"),
                                             (b"connection", b"close")])
            await stream.send_all(conn.send(response) + conn.send(h11.EndOfMessage()))


async def _serve_requests(stream, conn: h11.Connection, answer, idle_timeout: float) -> None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            with trio.move_on_after(idle_timeout) as idle:
                data = await stream.receive_some(16384)
            if idle.cancelled_caught:
                return
            conn.receive_data(data)
            if not data and conn.their_state is not h11.CLOSED:
                return  # the peer closed between requests
            continue
        if isinstance(event, h11.Request):
            await _respond(stream, conn, event, answer)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            continue
        if event is h11.PAUSED and conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()  # keep-alive: the next request
            continue
        return  # ConnectionClosed (or nothing more to do on this connection)


async def _respond(stream, conn: h11.Connection, request: h11.Request, answer) -> None:
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
    # drain the request's own body (probes send none; bounded by h11's buffer)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(16384)
            conn.receive_data(data)
            if not data:
                break
            continue
        if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    out = conn.send(h11.Response(status_code=code, headers=headers))
    if method != b"HEAD":
        out += conn.send(h11.Data(data=payload))
    out += conn.send(h11.EndOfMessage())
    await stream.send_all(out)
