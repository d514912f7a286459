"""The sending side of the load: closed-loop clients, each sending requests back to back on
its own keep-alive connection, and what they share (:class:`Context`, :class:`Phase`).

A request is written with one ``send_all``; its response is read by the :class:`Reactor`
task, which wakes the client once the response is complete.
"""

from __future__ import annotations

import time

import trio

from .http11 import ProtocolError, build_request
from .openai_api import BodyMaker, error_message
from .reactor import Reactor, ResponseReader
from .stats import Result, Stats
from .target import Target, api_path, close_stream

_perf = time.perf_counter


class Client:
    """One client: its keep-alive connection (None until the next request opens one)."""

    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream = None

    def close(self) -> None:
        """Close the connection, if any, so that the next request opens a new one."""
        if self.stream is not None:
            close_stream(self.stream)
            self.stream = None


class Context:
    """What the clients share: the request template, the reactor and the live counters."""

    def __init__(self, args, target: Target, model: str) -> None:
        self.args = args
        self.target = target
        self.chat = args.endpoint == "chat"
        path = api_path(target.base_path, "chat/completions" if self.chat else "completions")
        headers = [("Content-Type", "application/json"), ("Accept", "text/event-stream")]
        if args.api_key:
            headers.append(("Authorization", f"Bearer {args.api_key}"))
        self.head = build_request("POST", path, target.host_header, b"", tuple(headers))
        # build_request put "Content-Length: 0" last before the extra headers: split it out
        self.head_pre, self.head_post = self.head.split(b"Content-Length: 0\r\n", 1)
        self.bodies = BodyMaker(chat=self.chat, model=model, prompt_tokens=args.prompt_tokens,
                                max_tokens=args.max_tokens, include_usage=args.include_usage,
                                extra=args.extra_body)
        self.clients = [Client() for _ in range(args.concurrency)]
        self.ticket = 0
        self.max_errors = args.max_errors
        self.inflight = 0
        self.live_events = 0
        self.live_done = 0
        self.live_errors = 0
        self.connections_opened = 0
        self.reactor = Reactor()

    def request_bytes(self, ticket: int) -> bytes:
        body = self.bodies.body(ticket)
        return self.head_pre + b"Content-Length: %d\r\n" % len(body) + self.head_post + body


class Phase:
    """Hands out request tickets until the phase's count or deadline is reached."""

    def __init__(self, ctx: Context, *, max_requests: int | None, duration: float | None,
                 stats: Stats) -> None:
        self.ctx = ctx
        self.max_requests = max_requests
        self.deadline = None if duration is None else trio.current_time() + duration
        self.stats = stats
        self.issued = 0
        self.stopped: str | None = None

    def take(self) -> int | None:
        if self.stopped:
            return None
        if self.max_requests is not None and self.issued >= self.max_requests:
            return None
        if self.deadline is not None and trio.current_time() >= self.deadline:
            return None
        if self.stats.errors >= self.ctx.max_errors:
            self.stopped = f"stopped after {self.stats.errors} errors (--max-errors)"
            return None
        self.issued += 1
        self.ctx.ticket += 1
        return self.ctx.ticket


class _CloseConnection(Exception):
    """Internal: the response is fine but the connection must not be reused."""


async def _exchange(ctx: Context, stream, req: bytes, res: Result) -> bool:
    """Send one request on ``stream`` and read its response into ``res``.

    Returns whether any response byte came back (a reused connection that yields nothing was
    probably closed by the server while idle, and the request may be retried). Raises
    :class:`_CloseConnection` when the response is complete but the connection is not
    reusable, and the I/O or protocol error that ended the response otherwise.
    """
    await stream.send_all(req)
    reader = ResponseReader(ctx, stream.socket.fileno(), res)
    ctx.reactor.add(reader)
    try:
        await reader.finished.wait()
    finally:
        ctx.reactor.remove(reader.fd)
    res.end = _perf()
    parser = reader.parser
    if reader.exc is not None:
        if isinstance(reader.exc, (ProtocolError, OSError)) and not reader.got_any:
            return False
        raise reader.exc
    if res.status != 200:
        body = reader.errbody.body() if reader.errbody is not None else b""
        res.error_kind = f"http_{res.status}"
        res.error = f"HTTP {res.status}: {error_message(body)}"
    else:
        tracker = reader.tracker
        if not tracker.done:
            res.incomplete = True
            ctype = (parser.head.get("content-type") or "").split(";")[0].strip().lower()
            if ctype and ctype != "text/event-stream" and tracker.events == 0:
                res.error_kind = "not_sse"
                res.error = f"200 response with content-type {ctype!r}, not an event stream"
    if not parser.keep_alive or parser.trailing:
        raise _CloseConnection
    return True


_CLOSE_KINDS = frozenset({"timeout", "protocol", "connection", "connection_closed"})


async def one_request(ctx: Context, client: Client, ticket: int) -> Result:
    req = ctx.request_bytes(ticket)
    timeout = ctx.args.request_timeout
    for attempt in (0, 1):
        res = Result(_perf())
        reused = client.stream is not None
        with trio.move_on_after(timeout) as cs:
            try:
                if client.stream is None:
                    ctx.connections_opened += 1
                    client.stream = await ctx.target.connect()
                ok = await _exchange(ctx, client.stream, req, res)
                if not ok:
                    client.close()
                    if reused and attempt == 0:
                        continue  # stale keep-alive connection: retry once on a fresh one
                    res.error_kind = "connection_closed"
                    res.error = "connection closed before any response"
            except _CloseConnection:
                client.close()
            except ProtocolError as exc:
                res.error_kind = "protocol"
                res.error = str(exc)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if reused and attempt == 0 and res.status == 0:
                    client.close()
                    continue
                res.error_kind = "connection"
                res.error = f"{type(exc).__name__}: {exc}"
        if cs.cancelled_caught:
            res.error_kind = "timeout"
            res.error = f"no complete response within {timeout} s (--request-timeout)"
        if res.error is not None and res.error_kind in _CLOSE_KINDS:
            # the connection is in an unknown state: do not reuse it
            res.end = _perf()
            client.close()
            if res.status == 200:
                res.incomplete = not (res.tracker and res.tracker.done)
        return res
    raise AssertionError("unreachable")  # pragma: no cover


async def client_loop(ctx: Context, client: Client, phase: Phase) -> None:
    stats = phase.stats
    while True:
        ticket = phase.take()
        if ticket is None:
            return
        ctx.inflight += 1
        try:
            res = await one_request(ctx, client, ticket)
        finally:
            ctx.inflight -= 1
        stats.record(res)
        ctx.live_done += 1
        if res.error is not None:
            ctx.live_errors += 1
            if res.status == 0:
                await trio.sleep(0.05)  # connection trouble: do not spin


async def run_phase(ctx: Context, phase: Phase) -> None:
    phase.stats.t_start = _perf()
    async with trio.open_nursery() as nursery:
        for client in ctx.clients:
            nursery.start_soon(client_loop, ctx, client, phase)
    phase.stats.t_end = _perf()
