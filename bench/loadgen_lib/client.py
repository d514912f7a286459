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
        self.responses = args.endpoint == "responses"
        path = api_path(target.base_path, {"chat": "chat/completions"}.get(args.endpoint,
                                                                           args.endpoint))
        headers = [("Content-Type", "application/json"), ("Accept", "text/event-stream")]
        if args.api_key:
            headers.append(("Authorization", f"Bearer {args.api_key}"))
        self.head = build_request("POST", path, target.host_header, b"", tuple(headers))
        # build_request put "Content-Length: 0" last before the extra headers: split it out
        self.head_pre, self.head_post = self.head.split(b"Content-Length: 0\r\n", 1)
        self.bodies = BodyMaker(chat=self.chat, model=model, prompt_tokens=args.prompt_tokens,
                                max_tokens=args.max_tokens, include_usage=args.include_usage,
                                extra=args.extra_body, responses=self.responses)
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


class Schedule:
    """Hands out the request tickets of one continuous run, and says which are measured.

    The run has no pause: a ticket taken before the end of the warmup is a warmup ticket
    (its request is not in the statistics), one taken after it is measured, until
    ``requests`` measured tickets were handed out or ``duration`` seconds passed since the
    end of the warmup; then no new request starts (each client stops at its next request
    boundary). The measured window runs from the end of the warmup (``on_start``, called
    once, at once when there is no warmup) until the last measured request ended
    (``on_end``, called once).

    The warmup ends ``warmup`` seconds after :meth:`begin`, or earlier once ``warmup_cap``
    warmup tickets were handed out. ``stats`` collects the measured requests, ``warm_stats``
    the warmup ones.
    """

    def __init__(self, ctx: Context, *, warmup: float, duration: float | None,
                 requests: int, warmup_cap: int, stats: Stats, warm_stats: Stats,
                 on_start=None, on_end=None) -> None:
        self.ctx = ctx
        self.warmup = warmup
        self.duration = duration
        self.max_measured = requests
        self.warmup_cap = warmup_cap
        self.stats = stats
        self.warm_stats = warm_stats
        self._on_start = on_start
        self._on_end = on_end
        self.t0 = 0.0  # trio clock, set by begin()
        self.warmup_end = 0.0  # trio clock: nominal end of the warmup, then the actual one
        self.deadline: float | None = None  # trio clock: no measured request starts after
        self.warm_issued = 0
        self.issued = 0  # measured tickets handed out
        self.inflight = 0  # measured requests not yet done
        self.measuring = False
        self.closed = False  # no more measured tickets
        self.finished = False  # on_end was called
        self.last_end = 0.0  # perf_counter: end of the last measured request
        self.stopped: str | None = None

    def begin(self) -> None:
        """Start the clock of the run (and the measured window, if there is no warmup)."""
        self.t0 = trio.current_time()
        self.warmup_end = self.t0 + self.warmup
        if self.warmup <= 0:
            self.start_measuring()

    async def warmup_timer(self) -> None:
        """Ends the warmup on time even when no client takes a ticket at that moment (so
        that the window, and the CPU snapshot, start at the end of the warmup)."""
        await trio.sleep_until(self.warmup_end)
        self.start_measuring()

    def start_measuring(self) -> None:
        if self.measuring:
            return
        self.measuring = True
        now = trio.current_time()
        self.warmup_end = min(now, self.warmup_end) if self.warmup > 0 else now
        if self.duration is not None:
            # From now, when the window's clock (below) starts: from a late start (the
            # warmup timer woke late under load) the window would be shorter than asked.
            self.deadline = now + self.duration
        self.stats.t_start = self.warm_stats.t_end = _perf()
        if self._on_start is not None:
            self._on_start(self)

    def finish(self, *, now: bool = False) -> None:
        """End the measured window (idempotent): at the end of the last measured request
        (``now``: at once, e.g. when the run is cut short), or now if none ended yet."""
        if self.finished:
            return
        self.start_measuring()
        self.finished = self.closed = True
        t_end = _perf()
        if self.stats.requests and not now:
            t_end = max(self.stats.t_start, min(self.last_end, t_end))
        self.stats.t_end = t_end
        if self._on_end is not None:
            self._on_end(self)

    def _close(self) -> None:
        self.closed = True
        if self.inflight == 0:
            self.finish()

    def take(self) -> tuple[int, bool] | None:
        """The next ticket and whether its request is measured, or None: stop."""
        if self.closed or self.stopped:
            return None
        ctx = self.ctx
        if not self.measuring:
            if self.warm_stats.errors >= ctx.max_errors:
                self.stopped = (f"stopped after {self.warm_stats.errors} errors during the "
                                "warmup (--max-errors)")
                self._close()
                return None
            if trio.current_time() < self.warmup_end and self.warm_issued < self.warmup_cap:
                self.warm_issued += 1
                ctx.ticket += 1
                return ctx.ticket, False
            self.start_measuring()
        if self.stats.errors >= ctx.max_errors:
            self.stopped = f"stopped after {self.stats.errors} errors (--max-errors)"
            self._close()
            return None
        if self.issued >= self.max_measured or (
                self.deadline is not None and trio.current_time() >= self.deadline):
            if not self.stats.t_steady_end:
                self.stats.t_steady_end = _perf()
            self._close()
            return None
        self.issued += 1
        if self.issued >= self.max_measured and not self.stats.t_steady_end:
            self.stats.t_steady_end = _perf()  # the last measured request starts now
        self.inflight += 1
        ctx.ticket += 1
        return ctx.ticket, True

    def done(self, res: Result, measured: bool) -> None:
        """Record the result of a request of ticket ``take`` handed out."""
        ctx = self.ctx
        if not measured:
            self.warm_stats.record(res)
            if not self.measuring:  # the live counters show the current phase
                ctx.live_done += 1
                ctx.live_errors += res.error is not None
            return
        self.stats.record(res)
        ctx.live_done += 1
        ctx.live_errors += res.error is not None
        if res.end > self.last_end:
            self.last_end = res.end
        self.inflight -= 1
        if self.inflight == 0 and (
                self.closed or self.issued >= self.max_measured
                or (self.deadline is not None and trio.current_time() >= self.deadline)):
            self._close()


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


async def one_request(ctx: Context, client: Client, ticket: int,
                      on_attempt=None) -> Result:
    """Send request ``ticket`` and read its response (retried once on a fresh connection
    when a reused one turns out closed). ``on_attempt(res)``, if given, is called with each
    attempt's :class:`Result` before it is sent, so that a caller can watch a stream's events
    as they arrive (``res.tracker`` appears with the response head)."""
    req = ctx.request_bytes(ticket)
    timeout = ctx.args.request_timeout
    for attempt in (0, 1):
        res = Result(_perf())
        if on_attempt is not None:
            on_attempt(res)
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


async def client_loop(ctx: Context, client: Client, schedule: Schedule,
                      delay: float = 0.0) -> None:
    """Send requests back to back, the first ``delay`` seconds after the start of the run."""
    if delay > 0:
        await trio.sleep_until(schedule.t0 + delay)
    while True:
        got = schedule.take()
        if got is None:
            return
        ticket, measured = got
        ctx.inflight += 1
        try:
            res = await one_request(ctx, client, ticket)
        finally:
            ctx.inflight -= 1
        schedule.done(res, measured)
        if res.error is not None and res.status == 0:
            await trio.sleep(0.05)  # connection trouble: do not spin


def start_offsets(concurrency: int, ramp_up: float) -> list[float]:
    """When each client sends its first request, in seconds after the start of the run:
    client ``i`` at ``i * ramp_up / concurrency``, so that arrivals are spread evenly over
    ``ramp_up``."""
    return [i * ramp_up / concurrency for i in range(concurrency)]


async def run_clients(ctx: Context, schedule: Schedule, ramp_up: float) -> None:
    """One continuous run: start the clients over ``ramp_up`` seconds, wait until all of them
    stopped, and end the schedule's measured window if the clients did not. When cancelled
    (``--time-limit``), the window is left open: the caller ends it."""
    schedule.begin()
    async with trio.open_nursery() as timers:
        if not schedule.measuring:
            timers.start_soon(schedule.warmup_timer)
        async with trio.open_nursery() as nursery:
            for client, delay in zip(ctx.clients, start_offsets(len(ctx.clients), ramp_up)):
                nursery.start_soon(client_loop, ctx, client, schedule, delay)
        timers.cancel_scope.cancel()
    schedule.finish()
