"""One engine worker as the frontend sees it: spawn or connect, route, supervise, stop.

Theory of operation
-------------------
:meth:`WorkerClient.run` is a long-running service (start protocol: it reports ``started``
with itself once the first session said HELLO). It loops over *sessions*; a session is one
process it spawned, or one connection to a worker that listens (``address``; see
:mod:`server.manager.transport`), with three tasks in one nursery:

* the **router** reads frames from the worker's stdout and hands each output to the
  :class:`~server.manager.stream.Choice` its rid names. Late output for a rid the table no
  longer holds is dropped: that is how the abort-versus-finish race ends harmlessly. A
  frame of :data:`~server.worker_protocol.wire.BIG_FRAME` or more is decoded in a thread,
  a piece per call (``decode_sliced``), so that the event loop serves the other streams
  meanwhile. The router waits for a big STEP, to keep outputs in order. It does not wait
  for a big RESULT (a /tokenize answer of millions of ids: seconds of decoding), which
  concerns one round trip only: a task of its own decodes and files it (``_decode_aside``,
  at most ``_ASIDES`` at once; a further one is decoded in the router's way). A worker we
  spawn sends such an answer in PART frames between its STEPs, and so does a listening one
  whose session subscribed to ``wire.PARTS_TOPIC`` (:mod:`server.worker_protocol.parts`;
  docs/protocol.md, "Answers in parts"). The link's decoder joins the parts while the
  router reads on (``decode_frames``); an answer cut off by the session's end is lost with
  it, as a frame half read was. An answer decoded aside has fully arrived, so it outlives
  the session: when the session ends meanwhile (the worker exits after answering, the
  connection drops, the server stops), its decode goes on, shielded, and its waiter gets
  the answer, not the session's error. That lasts at most ``shutdown_grace`` seconds from
  the router's end; then the decode is cancelled and the waiter gets the error. A decode
  cancelled in its thread (``abandon_on_cancel``) leaves that thread to finish alone,
  holding its ``frame_decode_aside`` token until then (at most one 64 MiB frame's
  decoding). Later big answers, from any worker, then wait aside for a token (the router
  does not): accepted, since the limiter is there to count the threads that really run;
* the **writer** sends what :meth:`submit_nowait` and :meth:`abort_nowait` queued, all of it
  in one write;
* the **heartbeat** pings, and ends the session when the worker has been silent too long
  (less the frontend's own loop lag and the host's CPU stall: :mod:`server.manager.silence`).

A session ends when the process exits (end of its stdout) or the connection closes, the
worker breaks the protocol, or it hangs (no answer to pings: a dead network link looks the
same). Then every choice the worker held moves to another worker (the engine's ``migrate``
hook, :mod:`server.manager.migration`) or ends with an ``error`` output at once, the link is
closed (a process: close the pipe, SIGTERM, SIGKILL, each after a grace period; shielded),
and a new session starts after a backoff (:mod:`server.restarts`). A spawned worker that
restarted too often in a while is over its budget: it is retried at the capped backoff,
never left down, and says so once (an error in the log). A spawn that failed for the
frontend's own reasons (out of descriptors: EMFILE) is not charged to it. A remote one has
no budget: it is reconnected to at the backoff, since it is restarted by whoever runs it,
not by us.

A listening worker told to stop (SIGTERM: a Kubernetes scale-down) says LEAVING first, to
a session that subscribed (``wire.LEAVING_KEY`` in its HELLO). From then on the worker is
``leaving``: not routed to, its streams going on. The SUBMITs it refuses meanwhile (sent
before LEAVING arrived) go to another worker (the engine's ``resubmit`` hook). A clean end
of the session that follows is a planned leave if the worker held none of our accepted
requests, or LEAVING's deadline had passed: logged as info, not counted as a restart;
what it never accepted (sent after its drain) is sent again, the rest moved with the
cause ``left``. Any other end is a crash. Its address is tried again at the backoff: the
first failed try quietly, the later ones as any worker's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable

import trio
from trio_util import AsyncValue

from ..config import EngineConfig
from ..errors import EngineError, error_from_wire
from ..observability.engine_metrics import EngineReport
from ..thread_limits import run_limiter
from ..worker_protocol import wire
from ..worker_protocol.parts import PartsDecoder
from .kv_index import KVIndex
from .pacing import Pacer
from .routing import NAMING
from .silence import MAX_STRETCH, CpuStall, LoopLag, judge, read_cpu_stall
from .stream import Choice
from ..restarts import Restarts, starter_fault
from .transport import Link, SessionEnded, open_connected, open_spawned, tls_context

__all__ = ["WorkerClient", "WorkerStartupError", "spawn_process"]

log = logging.getLogger("server.worker")


class WorkerStartupError(EngineError):
    """The worker process could not load its engine (it said why on stderr)."""


async def spawn_process(config: EngineConfig) -> trio.Process:
    """Start a worker process with its protocol on stdin/stdout (stderr is inherited), in a
    process group of its own. So a Ctrl-C in the terminal reaches the frontend only, which
    decides how its workers stop. And what the worker starts (vLLM's engine core and
    tensor-parallel workers) stays in that group, which the link kills when the worker is
    gone (:mod:`server.manager.transport`).

    This is the default ``spawn`` of :class:`WorkerClient`. A replacement (tests use one
    over in-memory streams) returns an object with the same parts of :class:`trio.Process`:
    ``stdin`` (a SendStream), ``stdout`` (a ReceiveStream), ``pid``, ``wait()``,
    ``terminate()`` and ``kill()``.
    """
    cmd = [config.python, "-m", "server.workers", json.dumps(config.worker_argument())]
    return await trio.lowlevel.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            process_group=0)


#: The answer of a ping whose worker went away first.
_GONE = object()

#: Threads decoding big frames at once, all workers together (a flood of big answers waits
#: its turn rather than taking every thread of Trio's pool).
_DECODE_THREADS = 2
#: Big RESULT frames one worker's session decodes aside at once (a further one is
#: decoded in the router's way, so the worker's pipe pushes back and a worker cannot pile
#: up answers in the frontend's memory), in threads of their own limiter (so a router's
#: big STEP never queues behind them).
_ASIDES = 2


async def decode_frames(decoder: wire.FrameDecoder, data: bytes | bytearray,
                        aside: Callable[[bytes], bool] | None = None) -> list:
    """The messages ``data`` completed, in order. A frame of :data:`wire.BIG_FRAME` or
    more is decoded in a thread (:meth:`wire.FrameDecoder.decode_sliced`), the others
    here. With ``aside`` (the router's), a big RESULT frame is handed to
    ``aside(body)``: its answer concerns one round trip only, so the frames after it need
    not wait for it. It is decoded here when ``aside`` declines it (returns False: enough
    are being decoded aside). Raises :class:`wire.ProtocolError` as ``feed`` does (``messages``: the good ones
    before the bad one)."""
    error: wire.ProtocolError | None = None
    try:
        bodies = decoder.frames(data)
    except wire.ProtocolError as exc:
        bodies, error = exc.frames, exc
    messages: list = []
    try:
        for body in bodies:
            if len(body) < wire.BIG_FRAME:
                messages.append(decoder.decode(body))
            elif aside is not None and wire.is_result(body) and aside(body):
                pass
            else:
                messages.append(await decode_big(decoder, body))
    except wire.ProtocolError as exc:
        if exc.partial is not None:  # a STEP's rows before its bad one
            messages.append(exc.partial)
        exc.messages = messages
        raise
    if error is not None:
        error.messages = messages
        raise error
    return messages


async def decode_big(decoder: wire.FrameDecoder, body: bytes, *, aside: bool = False) -> list:
    """One big frame's message, decoded in a thread a piece per call (at most
    ``_DECODE_THREADS`` at once, and apart ``_ASIDES`` for frames decoded ``aside``);
    cancelled, the thread is left to finish alone."""
    limiter = (run_limiter("frame_decode_aside", _ASIDES) if aside
               else run_limiter("frame_decode", _DECODE_THREADS))
    return await trio.to_thread.run_sync(decoder.decode_sliced, body, limiter=limiter,
                                         abandon_on_cancel=True)


def _packed_request(request: dict) -> dict:
    """A CALL ``request`` for a worker that reads packed ids: a tokenize asks for its
    ids packed, a detokenize sends its ids packed (``wire.pack_ids``: a long list only)."""
    op = request.get("op")
    if op == "tokenize":
        return {**request, wire.PACKED_IDS_KEY: True}
    if op == "detokenize":
        return {**request, "tokens": wire.pack_ids(request.get("tokens"))}
    return request


def _answered(value) -> bool:
    return value is not None


_SessionEnded = SessionEnded

#: Seconds before LEAVING's deadline (as this frontend reckons it) from which a session's
#: end is the worker's cut, not an early end: LEAVING took that long to arrive, at most.
_LEAVE_SLACK = 1.0


def _kv_index(info: dict, routing: str, counts: list[int]) -> KVIndex | None:
    """An empty index of the worker's KV cache, if its HELLO says it sends KV events and
    the routing uses them."""
    events = info.get("kv_events")
    size = events.get("block_size") if type(events) is dict else None
    if routing != "prefix" or type(size) is not int or size < 1:
        return None
    return KVIndex(size, events=counts)


class WorkerClient:
    """The frontend's handle on one worker (and its successors after restarts): a process
    it spawns, or the worker listening at ``address`` (a
    :class:`~server.worker_protocol.handshake.WorkerAddress`)."""

    def __init__(self, index: int, config: EngineConfig, spawn=None, address=None) -> None:
        self.index = index
        self.config = config
        self._spawn = spawn or spawn_process
        self.address = address
        self._tls = (
            tls_context(config.worker_tls_ca)
            if address is not None and config.worker_tls_ca else None
        )
        #: rid -> Choice for every choice the worker holds (registered at dispatch).
        self.states: dict[int, Choice] = {}
        #: len(states), kept where it changes, to wait on (wait_released).
        self._held = AsyncValue(0)
        self.info: dict = {}
        #: Whether a worker process is up (said HELLO) and serving.
        self.alive = False
        self.pid: int | None = None
        #: Sessions that ended, but those of a worker that left as it said it would.
        self.restarts = 0
        #: Sessions that ended, all of them: each next one's worker holds another cache.
        self.generation = 0
        #: Over its restart budget at its last death (see over_budget), and when its
        #: current session began.
        self._over_budget = False
        self._session_start = -math.inf
        self.last_heard = -math.inf
        #: Silences past the heartbeat timeout not taken for hung (the frontend's loop was
        #: late or the host's CPU under pressure meanwhile: server.manager.silence), and
        #: the last one's start (each is counted and logged once).
        self.hang_excused = 0
        self._excused = -math.inf
        #: The router is decoding a big frame in a thread (the worker counts as heard).
        self._decoding = False
        self._asides = 0  # big RESULT frames being decoded aside (see _router)
        #: The shielded scopes of those decodes, and when they are cut off (the router's
        #: end plus shutdown_grace; inf while it runs).
        self._aside_scopes: set[trio.CancelScope] = set()
        self._asides_deadline = math.inf
        #: The worker's (running, waiting) request counts in its latest PONG (for metrics).
        self.running = 0
        self.waiting = 0
        #: A shared (remote) worker's requests from other frontends, as of its latest PONG.
        self.foreign = 0
        #: What the engine reports of itself (vLLM's statistics), for metrics.
        self.report = EngineReport()
        #: The blocks its KV cache holds, from its KV events (server.manager.kv_index),
        #: this session; None while it sends none (or the routing is not prefix-aware).
        self.kv_index: KVIndex | None = None
        #: KV events applied, over every session: stored, removed, cleared (metrics).
        self.kv_events = [0, 0, 0]
        #: This session's worker passes a SUBMIT's block names on to its other frontends,
        #: and sends us theirs (a listening worker whose HELLO says ROUTED_KEY, with prefix
        #: routing; docs/routing.md): SUBMITs then carry their prompt's block names.
        self.routed_notices = False
        #: Called as ``noticed(index, names)`` for each routed notice: another frontend sent
        #: this worker a prompt of the blocks ``names`` (the engine's router notes them).
        self.noticed: Callable[[int, list[bytes]], None] = lambda index, names: None
        self._outbox: list[bytes] = []
        self._outbox_ready = trio.Event()
        self._ping_seq = 0
        #: Round trips in flight (PING, CALL): seq -> the answer, or _GONE.
        self._pings: dict[int, AsyncValue] = {}
        #: When this worker's consumers are woken for news (pacing).
        self.pacer = Pacer(config.stream_interval)
        self._stdin_fd: int | None = None  # the pipe to the worker, while _writer runs
        self._writing = False  # _writer is in a write
        self._ready = trio.Event()
        #: Called as ``migrate(self, choices, cause)`` when a session ends with choices
        #: unfinished (not at a shutdown); returns those it could not move elsewhere.
        self.migrate: Callable[[WorkerClient, list[Choice], str], list[Choice]] | None = None
        #: The ops (LoRA adapters loaded and unloaded at run time) a fresh worker gets
        #: before any request: server.manager.adapters.AdapterRegistry.replay.
        self.replay: Callable[[], list[dict]] = list
        #: Its address left discovery (server.discovery.pool): no new request comes to
        #: it; ``removed`` once its drain's grace is over (its session then ends, and
        #: what it still runs moves on, as from a dead worker).
        self.retired = False
        self.removed = False
        #: Called after each session ends (discovery resolves the name again sooner).
        self.ended: Callable[[WorkerClient], None] = lambda worker: None
        #: The worker said LEAVING (it was told to stop): no new request comes to it; its
        #: session's end is a planned leave. Until a worker at its address says HELLO.
        self.leaving = False
        #: This session reads LEAVING (it subscribed to wire.LEAVING_TOPIC).
        self._reads_leaving = False
        #: When the leaving worker cuts what still runs (trio time; inf: not leaving).
        self._leaving_until = math.inf
        #: Whether this session's end was the leave LEAVING announced (None: not judged).
        self._planned: bool | None = None
        #: Called as ``resubmit(self, choices)`` for choices the worker refused as it left
        #: (never started): returns those it could not send to another worker.
        self.resubmit: Callable[[WorkerClient, list[Choice]], list[Choice]] = (
            lambda worker, choices: choices)

    # -- used by the request manager (plain def: never blocks) -------------------------------

    @property
    def routable(self) -> bool:
        """Up, still a member of the pool, and not leaving: new requests may come to it."""
        return self.alive and not self.retired and not self.leaving

    @property
    def outstanding(self) -> int:
        return len(self.states)

    @property
    def load(self) -> int:
        """Requests on this worker: ours, plus other frontends' on a shared worker."""
        return len(self.states) + self.foreign

    def submit_nowait(self, choices: list[Choice], frames: list[bytes]) -> None:
        """Register ``choices`` and queue their SUBMIT ``frames`` (encoded by the caller, so
        that a request that cannot be encoded registers nothing)."""
        states = self.states
        for choice in choices:
            states[choice.rid] = choice
        self._held.value = len(states)
        self._send_nowait(frames)

    def abort_nowait(self, choice: Choice) -> None:
        """Send one abort for ``choice``, unless it ended or was already aborted."""
        if choice.done or choice.abort_sent:
            return
        choice.abort_sent = True
        if self.alive:
            self._queue(wire.encode([wire.ABORT, choice.rid]))

    def forget(self, choice: Choice) -> None:
        """Stop routing output to ``choice``; what the worker still sends for it is dropped."""
        if self.states.get(choice.rid) is choice:
            del self.states[choice.rid]
            self._held.value = len(self.states)

    def _queue(self, frame: bytes) -> None:
        self._send_nowait([frame])

    def _send_nowait(self, frames: list[bytes]) -> None:
        """Send ``frames`` to the worker: written to its pipe at once when nothing else is
        waiting to be written (no task wakeup, no scheduler turn before the worker sees a
        new request), else, or for what the pipe does not take, queued for the writer."""
        outbox = self._outbox
        fd = self._stdin_fd
        if fd is None or outbox or self._writing:
            outbox.extend(frames)
        else:
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            try:
                sent = os.write(fd, data)
            except OSError:  # a full pipe (EAGAIN), or a broken one: the writer finds out
                sent = 0
            if sent == len(data):
                return
            outbox.append(data[sent:])
        self._outbox_ready.set()

    async def ping(self) -> tuple[int, int]:
        """Round-trip a ping; returns the worker's (running, waiting) request counts."""
        return await self._round_trip(lambda seq: [wire.PING, seq])

    async def call(self, request: dict) -> dict:
        """Round-trip a CALL request (see server.worker_protocol.wire); the worker answers
        between engine steps. Raises the worker's error (a client fault is a ClientError)."""
        if self.reads_packed:
            request = _packed_request(request)
        # (a refusal names the field at fault: a worker of this version adds it to err)
        request = {**request, wire.ERROR_PARAM_KEY: True}
        result, err = await self._round_trip(lambda seq: [wire.CALL, seq, request])
        if err is not None:
            raise error_from_wire(*err)
        return result

    @property
    def reads_packed(self) -> bool:
        """Whether this session's worker reads (and sends) long id lists packed
        (``wire.PACKED_IDS``; it said so in its HELLO): an older one gets lists."""
        return self.info.get(wire.PACKED_IDS_KEY) is True

    async def _round_trip(self, message):
        """Send ``message(seq)`` and wait for the answer the router files under ``seq``
        (ends with EngineError if the worker goes away first)."""
        if not self.alive:
            raise EngineError(f"worker {self.index} is not running")
        self._ping_seq += 1
        seq = self._ping_seq
        answer = self._pings[seq] = AsyncValue(None)
        try:
            self._queue(wire.encode(message(seq)))
            reply = await answer.wait_value(_answered)
        finally:
            self._pings.pop(seq, None)
        if reply is _GONE:
            raise EngineError(f"worker {self.index} went away before answering")
        return reply

    async def wait_released(self) -> None:
        """Wait until this worker holds no choice (each ended or forgotten), or is not
        alive (then it holds none: a worker that goes away ends its choices)."""
        await self._held.wait_value(lambda held: held == 0 or not self.alive)

    def _replay(self) -> list[tuple[dict, int, AsyncValue]]:
        """Queue the ops of :attr:`replay` (before the session is alive: ahead of any
        SUBMIT, so the worker applies them first); their answers come to
        :meth:`_replayed`."""
        pending = []
        for op in self.replay():
            self._ping_seq += 1
            seq = self._ping_seq
            pending.append((op, seq, AsyncValue(None)))
            self._pings[seq] = pending[-1][2]
            self._queue(wire.encode([wire.CALL, seq, op]))
        return pending

    async def _replayed(self, pending: list[tuple[dict, int, AsyncValue]]) -> None:
        """Log each replayed op the worker refused (its requests for that adapter get
        the worker's 404)."""
        for op, seq, answer in pending:
            try:
                reply = await answer.wait_value(_answered)
            finally:
                self._pings.pop(seq, None)
            if reply is not _GONE and reply[1] is not None:
                log.warning("worker %d: LoRA adapter %r: %s again failed: %s", self.index,
                            op.get("name"), op["op"], reply[1][1])

    async def wait_ready(self) -> None:
        """Wait until a process of this worker has said HELLO (once ever)."""
        await self._ready.wait()

    # -- the service -------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Keep a worker process running until cancelled; ``started(self)`` after the first
        HELLO. Raises :class:`WorkerStartupError` if the very first process fails to start.
        A spawned worker over its restart budget is retried at the capped backoff, never
        left down; a start that failed for the frontend's own reasons is not charged to it
        (:mod:`server.restarts`)."""
        config = self.config
        restarts = Restarts(config.max_restarts if self.address is None else None,
                            window=config.restart_window, first=config.restart_backoff,
                            cap=config.restart_backoff_max)
        first = True
        while True:
            started_at = self._session_start = trio.current_time()
            self._planned = None
            reason, charged = await self._session(task_status if first else None, first)
            self.ended(self)
            first = False
            now = trio.current_time()
            planned = self._planned is True
            # a planned leave, or the first try after one that failed (before HELLO): quiet;
            # from then on, tries are counted and warned about as any worker's
            quiet = planned or self.leaving
            self.leaving = planned  # (kept until a worker at its address says HELLO)
            restart = restarts.died(now, now - started_at, charged=charged and not quiet)
            self._over_budget = restarts.over_budget
            if quiet:
                log.info("worker %d: %s; trying its address again in %.2f s", self.index,
                         reason, restart.delay)
            elif restart.over_budget_now:
                log.error("worker %d: %d restarts in %.0f s (%s); retrying every %g s until "
                          "it stays up for %.0f s", self.index, restarts.charged(),
                          config.restart_window, reason, restart.delay, config.restart_window)
            else:
                log.warning("worker %d: %s; %s in %.2f s", self.index, reason,
                            "restarting" if self.address is None else "reconnecting",
                            restart.delay)
            await trio.sleep(restart.delay)
            self.generation += 1
            if not quiet:
                self.restarts += 1

    async def _open_link(self) -> Link:
        if self.address is None:
            return await open_spawned(self.config, self._spawn)
        return await open_connected(self.config, self.address, self._tls)

    def _startup_failed(self, first: bool, exc: SessionEnded | trio.TooSlowError) -> str:
        """The reason a session ended before HELLO; raises WorkerStartupError where that
        ends the server: a spawned worker's first start, or a remote worker that refuses
        our credentials when we first connect (a configuration error, said at once)."""
        reason = getattr(exc, "reason", "no HELLO in time")
        if self.address is None and first:
            raise WorkerStartupError(
                f"engine worker {self.index} failed to start ({reason}); "
                "see its message above"
            ) from None
        if self.address is not None:
            reason = f"{self.address}: {reason}"
            if first and getattr(exc, "refused", False):
                raise WorkerStartupError(f"engine worker {self.index} at {reason}") from None
            if getattr(exc, "refused", False):
                log.error("worker %d: %s", self.index, reason)
        return reason

    async def _session(self, task_status, first: bool) -> tuple[str, bool]:
        """One session, to its end: why it ended, and whether that counts against the
        worker's restart budget (not a spawn that failed for the frontend's own reasons)."""
        config = self.config
        try:
            link = await self._open_link()
        except OSError as exc:  # e.g. EAGAIN from fork: a failed start, not a crashed engine
            if first:
                raise WorkerStartupError(
                    f"engine worker {self.index} could not be started: {exc}"
                ) from exc
            if starter_fault(exc):  # (EMFILE: a flood of connections took the descriptors)
                return (f"could not be started, for want of the frontend's own resources "
                        f"({exc}): not counted against its restarts"), False
            return f"could not be started ({exc})", True
        except SessionEnded as exc:  # could not connect
            return self._startup_failed(first, exc), True
        self.pid = link.pid
        self._outbox.clear()
        reason = "stopped"
        cause = "stopped"
        eof = up = False
        self._leaving_until = math.inf
        try:
            try:
                with trio.fail_after(config.startup_timeout):
                    self.info = await link.handshake()
            except (_SessionEnded, trio.TooSlowError) as exc:
                reason = self._startup_failed(first, exc)
                return reason, True
            self.routed_notices = (config.routing == "prefix"
                                   and self.info.get(wire.ROUTED_KEY) is True)
            topics = [wire.routed_topic(NAMING)] if self.routed_notices else []
            self.leaving = False  # (a worker at its address said HELLO: back)
            self._reads_leaving = self.info.get(wire.LEAVING_KEY) is True
            if self._reads_leaving:  # told first when it is told to stop
                topics.append(wire.LEAVING_TOPIC)
            if self.info.get(wire.IMAGE_STATS_KEY) is True:  # its PONGs' image counters
                topics.append(wire.IMAGE_STATS_TOPIC)
            decoder = link.decoder  # (a pipe worker's joins already: it asked at its start)
            if (self.info.get(wire.PARTS_KEY) is True and isinstance(decoder, PartsDecoder)
                    and not decoder.joining):  # a listening worker's big answers, in parts
                decoder.joining = True
                topics.append(wire.PARTS_TOPIC)
            if topics:  # (ahead of any request)
                self._queue(wire.encode([wire.SUBSCRIBE, topics]))
            replaying = self._replay()  # queued ahead of any request
            self.kv_index = _kv_index(self.info, config.routing, self.kv_events)
            self.alive = up = True
            self.report.hello(self.info)
            self.last_heard = trio.current_time()
            self._ready.set()
            if task_status is not None:
                task_status.started(self)
            log.info("worker %d (%s) is up: %s", self.index, link.where, self.info)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._router, link, nursery)
                    nursery.start_soon(self._writer, link)
                    nursery.start_soon(self._heartbeat)
                    if replaying:
                        nursery.start_soon(self._replayed, replaying)
            except BaseExceptionGroup as group:  # a nursery's errors always come grouped
                ended, rest = group.split(_SessionEnded)
                if rest is not None:
                    raise rest from None
                assert ended is not None
                first_end = ended.exceptions[0]
                assert isinstance(first_end, _SessionEnded)
                reason = first_end.reason
                cause = first_end.cause
                eof = first_end.eof
            return reason, True
        finally:
            if reason == "stopped" and self.removed:  # (its requests move, not end)
                reason = cause = "removed"
            self.alive = False
            self.kv_index = None  # (the next session's cache is another)
            self.routed_notices = False  # (and its worker may be another, or older)
            self.running = self.waiting = self.foreign = 0
            self.report.down()
            planned = up and self._left_as_said(eof)
            if up and not planned:  # (it ended otherwise than it said: as a crash)
                self.leaving = False
            self._fail_all(reason, cause, planned)
            with trio.CancelScope(shield=True):
                try:
                    how = await link.aclose(config.shutdown_grace)
                finally:
                    self.pid = None
            if planned:
                log.info("worker %d (%s) left, as it said it would (%s): %s", self.index,
                         link.where, reason, how)
            elif reason == "removed":  # (it left discovery: the pool said so, not a fault)
                log.info("worker %d (%s) removed: %s", self.index, link.where, how)
            elif reason != "stopped" or link.escalated or link.returncode not in (None, 0):
                log.warning("worker %d (%s) %s", self.index, link.where, how)
            elif link.returncode == 0:  # (a clean stop of a process of ours: said, for an
                # operator who watches shutdowns; a remote worker goes on: nothing to say)
                log.info("worker %d (%s) stopped: %s", self.index, link.where, how)

    async def _router(self, link: Link, nursery: trio.Nursery) -> None:
        decoder = link.decoder
        decoder.reader = wire.REPLIES  # (after HELLO: what a worker may send)

        def aside(body: bytes) -> bool:
            if self._asides >= _ASIDES:
                return False
            self._asides += 1
            nursery.start_soon(self._decode_aside, decoder, body)
            return True

        self._asides_deadline = math.inf
        ended: _SessionEnded | None = None
        try:
            await self._route_frames(link, decoder, aside)
        except _SessionEnded as exc:
            ended = exc
            raise
        finally:  # the session ends: what is decoded aside gets a bounded grace
            self._asides_deadline = trio.current_time() + self.config.shutdown_grace
            for scope in self._aside_scopes:
                scope.deadline = self._asides_deadline
            if self._aside_scopes:  # the session waits for them: the rest ends now
                self._down_early(ended)

    def _down_early(self, ended: _SessionEnded | None) -> None:
        """The session has ended but waits (up to ``shutdown_grace``) for big answers decoded
        aside: meanwhile the worker is not picked nor asked anything (not alive, reported
        down), and the choices it held end (or move) now, where the router knows why the
        session ended; otherwise when the session does (:meth:`_fail_all`)."""
        self.alive = False
        self.report.down()
        if ended is not None:
            self._end_choices(ended.reason, ended.cause, self._left_as_said(ended.eof))

    async def _route_frames(self, link: Link, decoder: wire.FrameDecoder,
                            aside: Callable[[bytes], bool]) -> None:
        receive_some = link.receive.receive_some
        pacer = self.pacer
        big = wire.BIG_FRAME
        while True:
            # Paced consumers are woken when a frame arrives after they are due, or by time
            # when none comes (server.manager.pacing).
            data = None
            with trio.CancelScope(deadline=pacer.router_deadline()) as scope:
                pacer.router_scope = scope
                try:
                    data = await receive_some(1 << 20)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise _SessionEnded(f"the connection broke ({exc})",
                                        cause="disconnected") from None
                finally:
                    pacer.router_scope = None
            if data is None:
                pacer.wake_due(trio.current_time())
                continue
            if not data:
                raise _SessionEnded(link.eof_reason, cause=link.eof_cause, eof=True)
            self.last_heard = pacer.frame_time = trio.current_time()
            try:
                try:
                    if len(data) + decoder.buffered < big:  # (the hot path: no frame is big)
                        messages = decoder.feed(data)
                    else:  # the worker is heard all along: its frames wait behind this
                        self._decoding = True
                        try:
                            messages = await decode_frames(decoder, data, aside)
                        finally:
                            self._decoding = False
                        self.last_heard = trio.current_time()
                except wire.ProtocolError as exc:
                    self._route(exc.messages)  # what it said well before the garbage counts
                    raise
                self._route(messages)
            except wire.ProtocolError as exc:  # the worker's fault: it is treated as dead
                raise _SessionEnded(f"protocol violation: {exc}",
                                    cause="protocol_error") from None
            await self._wake_paced()

    async def _decode_aside(self, decoder: wire.FrameDecoder, body: bytes) -> None:
        """Decode a big RESULT frame (a /tokenize answer of millions of ids: seconds of
        decoding) and file its answer, while the router goes on routing the frames after it
        (the other streams' outputs would wait that long otherwise). Garbage ends the
        session, as it does in the router. The answer has fully arrived, so a session that
        ends meanwhile does not cut it off: the decode is shielded, until the router's end
        plus ``shutdown_grace`` (see the theory of operation)."""
        scope = trio.CancelScope(shield=True, deadline=self._asides_deadline)
        self._aside_scopes.add(scope)
        try:
            with scope:
                message = await decode_big(decoder, body, aside=True)
                self._route([message])
        except wire.ProtocolError as exc:
            raise _SessionEnded(f"protocol violation: {exc}", cause="protocol_error") from None
        finally:
            self._aside_scopes.discard(scope)
            self._asides -= 1

    async def _wake_paced(self) -> None:
        """Wake the paced consumers that are due, one scheduler turn after the router woke
        the urgent ones (first outputs, ends, errors): those run in a batch of their own
        instead of behind every stream's next event, which is what a new request's time to
        first token waits for under load."""
        pacer = self.pacer
        if not pacer.pending(trio.current_time()):
            return
        try:
            await trio.lowlevel.checkpoint()
        finally:
            for waker in pacer.take_soon():
                waker.wake_paced()
            pacer.wake_due(trio.current_time())

    def _route(self, messages: list) -> None:
        """Hand each output to its choice. A plain function, so that nothing it touched
        (the last choice, its waker) stays referenced by the router between frames. The
        messages come typed (wire.REPLIES: each decoded into its type, its shape checked).
        A STEP's rules across items (a row's ``finish`` and ``err``, a note's keys) are
        checked here, as each row is routed, so that the hot path walks the rows once. A
        bad one raises ProtocolError, which ends the session, after the rows before it are
        delivered, as the messages before a malformed one are
        (``ProtocolError.messages``)."""
        states = self.states
        final_ok = wire.final_ok
        unset = wire.UNSET
        for msg in messages:
            kind = type(msg)
            if kind is wire.Step:
                for rid, prompt_tokens in msg.accepts:
                    choice = states.get(rid)
                    if choice is not None:
                        choice.accept(prompt_tokens)
                if msg.notes is not unset:  # details that precede this frame's outputs
                    for rid, note in msg.notes:
                        if (rid is None or note.logprobs is not unset or note.kv_events
                                is not unset or note.routed is not unset
                                or note.prompt_logprobs is not unset) and not (
                                    wire.note_ok(rid, note)):  # (ids and counts: fine)
                            raise wire.malformed(msg)
                        if rid is None:  # the worker's own: KV events, routed notices
                            if self.kv_index is not None and note.kv_events is not unset:
                                self.kv_index.apply(note.kv_events)
                            if note.routed is not unset and self.routed_notices:
                                self.noticed(self.index, note.routed)
                            continue
                        choice = states.get(rid)
                        if choice is not None:
                            choice.note(note)
                refused = None
                for row in msg.outputs:
                    rid, text, ntok, finish, err = row
                    if (err is not None if finish is None else not final_ok(finish, err)):
                        raise wire.malformed(msg)
                    choice = states.get(rid)
                    if choice is None:
                        continue  # finished, aborted, or cut off: drop
                    if finish is not None:
                        del states[rid]
                        self._held.value = len(states)
                        if finish == "error" and err[0] == wire.LEAVING_KIND:
                            if refused is None:
                                refused = []
                            refused.append((choice, err))  # (sent elsewhere, below)
                            continue
                    choice.push(text, ntok, finish, err)
                if refused is not None:
                    self._refused(refused)
            elif kind is wire.Result:
                answer = self._pings.get(msg.seq)
                if answer is not None:
                    answer.value = (msg.result, msg.error)
            elif kind is wire.Leaving:
                self._told_leaving(msg)
            else:  # PONG
                if msg.seq == 0:  # unasked (the worker's pulse in a long step): heard, no
                    continue      # news (a listening worker's carries no engine stats)
                self.running, self.waiting = msg.running, msg.waiting
                stats = msg.stats
                self.report.pong(msg.waiting, None if stats is unset else wire.as_dict(stats))
                if msg.mine is not unset:  # a listening worker: ours of them
                    self.foreign = max(0, msg.running + msg.waiting - msg.mine)
                answer = self._pings.get(msg.seq)
                if answer is not None:
                    answer.value = (msg.running, msg.waiting)

    def _told_leaving(self, msg: wire.Leaving) -> None:
        """LEAVING: the worker was told to stop. Send it nothing new; let its streams run."""
        if not self._reads_leaving:  # (only to a session that subscribed)
            raise wire.ProtocolError("unexpected LEAVING")
        if not self.leaving:
            self.leaving = True
            self._leaving_until = trio.current_time() + msg.within
            log.info("worker %d (%s) is stopping: no new requests go to it; its %d may "
                     "finish there within %g s", self.index, self.address, len(self.states),
                     msg.within)

    def _refused(self, refused: list) -> None:
        """SUBMITs the leaving worker refused (sent before its LEAVING arrived): to another
        worker; a choice none can take ends with the worker's error (a 503)."""
        left = self.resubmit(self, [choice for choice, _ in refused])
        for choice, err in refused:
            if choice in left:
                choice.push("", 0, "error", err)

    async def _writer(self, link: Link) -> None:
        send_all = link.send.send_all
        try:
            # From here until the link is closed (after this task), _send_nowait may write
            # to it directly, when this task is not writing and nothing is queued.
            self._stdin_fd = link.fd
            while True:
                if not self._outbox:
                    await self._outbox_ready.wait()
                self._outbox_ready = trio.Event()
                data = b"".join(self._outbox)
                self._outbox.clear()
                self._writing = True
                try:
                    await send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise _SessionEnded("the link to the worker broke",
                                        cause="disconnected") from None
                finally:
                    self._writing = False
        finally:
            self._stdin_fd = None

    async def _heartbeat(self) -> None:
        """Ping every ``heartbeat_interval``; end the session when the worker has been
        silent past ``heartbeat_timeout``. The silence is counted less how late this task's
        own wakes were (the frontend's loop lag) or the host's CPU stall over it, whichever
        is larger, up to :data:`~server.manager.silence.MAX_STRETCH` times the timeout: a
        starved frontend or host is not a hung worker (:mod:`server.manager.silence`).
        The kernel's counter is in real seconds: not read under a mock clock."""
        config = self.config
        keep = config.heartbeat_timeout * MAX_STRETCH + config.heartbeat_interval
        lag, stall = LoopLag(keep), CpuStall(keep)
        # (a MockClock exists only where trio.testing was imported: the library does not
        # import a testing module to ask)
        testing = sys.modules.get("trio.testing")
        real_time = testing is None or not isinstance(trio.lowlevel.current_clock(),
                                                      testing.MockClock)
        while True:
            due = trio.current_time() + config.heartbeat_interval
            await trio.sleep_until(due)
            now = trio.current_time()
            lag.woke(now, now - due)
            stall.sample(now, read_cpu_stall() if real_time else None)
            silent = now - self.last_heard
            if silent > config.heartbeat_timeout and not self._decoding:
                # (not while decoding a big frame: its PONGs queue behind it)
                since = self.last_heard
                verdict = judge(silent, config.heartbeat_timeout, lag.within(since),
                                stall.within(since))
                if verdict.hung:
                    raise _SessionEnded(verdict.reason, cause="hung")
                if self._excused != since:  # (said once a silence)
                    self._excused = since
                    self.hang_excused += 1
                    log.warning("worker %d (pid %s): %s", self.index, self.pid,
                                verdict.reason)
            self._ping_seq += 1
            self._queue(wire.encode([wire.PING, self._ping_seq]))

    def _left_as_said(self, eof: bool) -> bool:
        """Whether the session's end is the leave its LEAVING announced (judged once): the
        worker closed cleanly (``eof``: not hung, broken or garbled), and either held none
        of our requests that it had accepted, or its deadline (LEAVING's ``within``) had
        passed. Otherwise (an OOM kill mid-drain, a protocol error) it is a crash."""
        if self._planned is None:
            self._planned = self.leaving and eof and (
                trio.current_time() >= self._leaving_until - _LEAVE_SLACK
                or not any(choice.accepted for choice in self.states.values()))
        return self._planned

    def _fail_all(self, reason: str, cause: str, planned: bool = False) -> None:
        """End every choice this worker held (the worker is gone; :meth:`_end_choices`) and
        every round trip still waiting for its answer."""
        self._end_choices(reason, cause, planned)
        for answer in self._pings.values():
            if answer.value is None:  # (one answered already keeps its answer)
                answer.value = _GONE
        self._pings.clear()

    def _end_choices(self, reason: str, cause: str, planned: bool = False) -> None:
        """End every choice this worker held: each one the engine's ``migrate`` hook moves
        to another worker goes on there (server.manager.migration); the others end with an
        error output (``abort`` for one whose abort was sent). After a ``planned`` leave,
        those the worker never accepted (sent after its drain) are sent again, uncounted
        (the ``resubmit`` hook), and what was cut moves with the cause ``left``."""
        states, self.states = self.states, {}
        self.pacer.clear()
        self._held.value = 0
        left = list(states.values())
        unplaced: list[Choice] = []  # (sent again, but no worker could take them)
        if planned:
            cause = "left"
            fresh = [choice for choice in left if not choice.accepted]
            if fresh:
                left = [choice for choice in left if choice.accepted]
                unplaced = self.resubmit(self, fresh)
        kind = "unavailable" if reason == "stopped" else "worker_died"
        message = (
            "the engine is shutting down"
            if reason == "stopped"
            else f"engine worker {self.index} failed: {reason}"
        )
        if self.migrate is not None and reason != "stopped" and left:
            left = self.migrate(self, left, cause)
        for choice in left + unplaced:
            choice.end("error", kind, message)

    # -- introspection -----------------------------------------------------------------------

    @property
    def over_budget(self) -> bool:
        """Over its restart budget (:mod:`server.restarts`): restarted at the capped
        backoff, until a session of it stays up for the restart window."""
        return self._over_budget and not (
            self.alive and trio.current_time() - self._session_start >= self.config.restart_window
        )

    def healthy(self) -> bool:
        """Alive and heard from within three heartbeat periods, or decoding a big frame
        from it (its PONGs queue behind that frame, as the heartbeat check knows)."""
        return self.alive and (
            self._decoding
            or trio.current_time() - self.last_heard < 3 * self.config.heartbeat_interval + 0.5
        )
