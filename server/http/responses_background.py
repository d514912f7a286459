"""Background responses (``POST /v1/responses`` with ``background: true``): the service
that runs them, the cancel that stops them, and the stream that follows them.

Theory of operation
-------------------
The request stores the response (``status: queued``, its meta ``background``, its
``holder`` and a ``lease_until_ms``) and answers at once. The generation runs in the
service's nursery, which the app's lifespan owns, never in the request's: a client that
goes away leaves it running. At most ``limit`` run on one frontend; past that the request
is a 503 naming the bound (``--max-background-responses``).

Every engine batch's events are appended to the store as they are made, one write per
batch (outputs that arrive during the write join the next). ``GET ...?stream=true``
follows them: it reads the store, waits for this frontend's job to say "more" (or polls
every :data:`POLL_S`, for a job another frontend holds) and ends after the terminal
event. The status and the Response object change by compare-and-set
(``update(expect=...)``) on ``status``, ``holder`` and ``lease_until_ms``, so of a holder's
write and a cancel one wins.

One task renews every job's lease every :data:`RENEW_S`. A renewal that loses its
compare-and-set means someone else wrote the record: a cancel (any frontend's), a delete,
or a sweep that took an expired lease. The job then stops: leaving its stream's scope
aborts its engine request, once. A cancel on the holder's own frontend stops it at once.

A server that stops (drain) first lets the engine finish or abort what runs (its drain
deadline), then cancels what is left: each such job marks its response ``failed`` (a
``response.failed`` event, the error saying the server stopped). A server that dies
leaves its leases to expire: every frontend's sweep (at start, then every
:data:`SWEEP_S`) marks a response whose lease expired ``failed`` the same way, so none
stays ``in_progress``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import ClientError, EngineError, ServerError, ServiceUnavailable, printable
from ..openai.encode import dumps
from ..openai.responses import ResponsesRequest
from ..openai.responses_events import ResponseEvents, new_response, response_usage, \
    split_events
from ..openai.responses_items import record_body, response_of
from ..openai.responses_progress import ProgressCache, ended, response_so_far
from ..state import Record, StateStore, StoreFull
from ..state.service import LifespanService
from .answer import failure
from .owners import store_error
from .post import off_loop
from .responses_store import KIND, not_found

__all__ = ["BackgroundCollector", "BackgroundResponses", "BackgroundService",
           "BackgroundStatistics", "LEASE_S", "POLL_S", "RENEW_S", "SWEEP_S"]

log = logging.getLogger("server.http")

#: Seconds a holder's lease lasts: how long a dead server's responses stay in progress.
LEASE_S = 10.0
#: How often leases are renewed (and a cancel from another frontend is noticed).
RENEW_S = 1.0
#: How often a follower of another frontend's job reads the store for new events.
POLL_S = 0.25
#: How often the sweep looks for expired leases (also once at start).
SWEEP_S = 5.0
#: Seconds a stopped job may take to mark its response failed.
STOP_TIMEOUT_S = 10.0
#: The most running records one sweep reads (oldest first): past the frontends' running
#: responses (``--max-background-responses`` each), so that an expired lease is always found.
SWEEP_LIMIT = 10_000

_ENDED = ("completed", "incomplete", "failed", "cancelled")
_TERMINAL = (b"event: response.completed\n", b"event: response.incomplete\n",
             b"event: response.failed\n")
_CAS_KEYS = ("status", "holder", "lease_until_ms")


def _lease(seconds: float = LEASE_S) -> int:
    """A lease's end, ``seconds`` from now, in unix milliseconds."""
    return int((time.time() + seconds) * 1000)


def _terminal(event: bytes) -> bool:
    return event.startswith(_TERMINAL)


def _expect(meta: dict) -> dict:
    return {k: meta.get(k) for k in _CAS_KEYS}


@dataclass(frozen=True, slots=True)
class BackgroundStatistics:
    """``running``: jobs on this frontend now; ``aborted``: jobs stopped by a cancel,
    delete or lost lease (each its engine request's one abort); ``events_folded``: below."""

    running: int
    aborted: int
    #: Stored events folded into polled or cancelled responses' output so far: each
    #: once per frontend while the response runs (server.openai.responses_progress).
    events_folded: int = 0


@dataclass(eq=False)
class _Job:
    id: str
    owner: str
    status: str
    lease_until_ms: int  # (an integer: compared for equality, in every store)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    lock: trio.Lock = field(default_factory=trio.Lock)
    changed: trio.Event = field(default_factory=trio.Event)
    #: The record is no longer ours to write (cancelled, deleted, swept) or is final.
    done: bool = False

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class BackgroundResponses:
    """The app's background responses (module docstring). :meth:`run` is the service."""

    def __init__(self, app, store: StateStore, limit: int) -> None:
        self.app = app
        self.store = store
        self.limit = limit
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._jobs: dict[str, _Job] = {}
        self._nursery: trio.Nursery | None = None
        self._aborted = 0
        #: The output of each running response as last polled (server.openai.responses_progress).
        self.progress = ProgressCache()
        self._events_folded = 0

    def statistics(self) -> BackgroundStatistics:
        return BackgroundStatistics(running=len(self._jobs), aborted=self._aborted,
                                    events_folded=self._events_folded)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The service: sweeps, renews leases and runs the jobs until cancelled; then each
        job still running marks its response failed (shielded, bounded)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renew_leases)
            nursery.start_soon(self._sweep_expired)
            self._nursery = nursery
            task_status.started(self)
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    # -- starting --------------------------------------------------------------------------

    async def start(self, req: ResponsesRequest, engine, adapter: str | None,
                    response_id: str, model: str) -> bytes:
        """Store the queued response and start its job: the Response object to answer."""
        if self._nursery is None:
            raise ServiceUnavailable("The server is shutting down.", code="shutting_down")
        if len(self._jobs) >= self.limit:
            raise ServiceUnavailable(
                f"This server runs at most {self.limit} background responses at once "
                "(--max-background-responses): try again later.",
                code="too_many_background_responses")
        now = time.time()
        config = self.app.server_config
        response = new_response(response_id, int(now), model, req.echo)
        response.update(status="queued", background=True)
        job = _Job(response_id, req.owner, "queued", _lease())
        self._jobs[job.id] = job  # (the slot is taken before the first await)
        try:
            await self.store.put(Record(
                kind=KIND, id=job.id, owner=job.owner, created_at=int(now),
                meta=self._meta(job), body=record_body(response, req.items)))
        except StoreFull as exc:
            del self._jobs[job.id]
            raise store_error(exc) from None
        except BaseException:
            del self._jobs[job.id]
            raise
        queued = dumps(response)
        events = ResponseEvents(response, reasoning_parser=config.reasoning_parser,
                                tools=req.chat.tools, thinking=req.chat.thinking)
        assert self._nursery is not None
        self._nursery.start_soon(self._run_job, job, req, engine, adapter, events, req.items)
        return queued

    def _meta(self, job: _Job) -> dict:
        return {"status": job.status, "background": True, "holder": self.holder,
                "lease_until_ms": job.lease_until_ms}

    # -- one job ---------------------------------------------------------------------------

    async def _run_job(self, job: _Job, req, engine, adapter, events: ResponseEvents,
                       items: list) -> None:
        config = self.app.server_config
        try:
            with job.scope:
                stream = engine.generate_many(
                    req.prompts, req.params, timeout=config.request_timeout,
                    errors_as_outputs=True, adapter=adapter,
                    queue_timeout=self.app.models.of_engine(engine).max_queue_time)
                async with stream:
                    await self._generate(job, stream, events, items)
        except Exception:
            log.exception("internal error in background response %s", job.id)
        finally:
            if not job.done:  # (stopped by the server, or a bug: never left in progress)
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + STOP_TIMEOUT_S
                    stopped = ServiceUnavailable("The server stopped before the response "
                                             "finished.", code="server_stopped")
                    head = events.start() if job.status == "queued" else b""
                    await self._end(job, events, items, "failed", head + events.fail(stopped))
            del self._jobs[job.id]
            job.done = True
            job.notify()
            self.progress.end(job.owner, job.id)  # (its record is final or not ours)

    async def _generate(self, job: _Job, stream, events: ResponseEvents,
                        items: list) -> None:
        try:
            per_choice = await stream.wait_started(math.inf)
        except ServerError as exc:
            await self._end(job, events, items, "failed", events.start() + events.fail(exc))
            return
        events.response["status"] = "in_progress"
        if not await self._write(job, "in_progress", events.response, items):
            return
        await self._append(job, events.start())
        while outs := await stream.next_batch():
            body = b""
            for o in outs:
                ended = o.finish_reason is not None
                body += events.feed(o.text, last=ended and o.finish_reason != "error")
                failed = failure(stream, o)
                if failed is not None:
                    await self._end(job, events, items, "failed", body + events.fail(failed))
                    return
                if ended:
                    usage = response_usage(per_choice[0], o.completion_tokens,
                                           o.cached_tokens)
                    tail = events.end(o.finish_reason, usage)
                    await self._end(job, events, items, events.response["status"],
                                    body + tail)
                    return
            if body:
                await self._append(job, body)
        await self._end(job, events, items, "failed", events.fail(
            EngineError("The engine ended the request without an answer.")))

    async def _write(self, job: _Job, status: str, response: dict | None,
                     items: list) -> bool:
        """Compare-and-set the record's status (and Response object), renewing the lease;
        False (and the job stops) when someone else wrote it since."""
        async with job.lock:
            if job.done:
                return False
            expect = self._meta(job)
            lease = _lease()
            meta = {**expect, "status": status, "lease_until_ms": lease}
            body = None if response is None else record_body(response, items)
            if await self.store.update(KIND, job.owner, job.id, meta=meta, body=body,
                                       expect=_expect(expect)):
                job.status, job.lease_until_ms = status, lease
                return True
        self._lost(job)
        return False

    async def _end(self, job: _Job, events: ResponseEvents, items: list, status: str,
                   tail: bytes) -> None:
        """The final status, then the last events: a follower that sees the status waits
        for the terminal event."""
        events.response["status"] = status
        if await self._write(job, status, events.response, items):
            job.done = True
            await self._append(job, tail)

    async def _append(self, job: _Job, data: bytes) -> None:
        if data:
            await self.store.append_events(KIND, job.owner, job.id, split_events(data))
            job.notify()

    def _lost(self, job: _Job) -> None:
        """The record is no longer this job's: stop it (its engine request is aborted
        when its stream's scope exits)."""
        if not job.done:
            job.done = True
            self._aborted += 1
            job.scope.cancel()
            job.notify()

    async def _renew_leases(self) -> None:
        while True:
            await trio.sleep(RENEW_S)
            for job in list(self._jobs.values()):
                try:
                    await self._write(job, job.status, None, [])
                except Exception as exc:  # a database gone away: the next round retries
                    log.warning("background response %s: renewing its lease failed: %r",
                                job.id, exc)

    # -- the sweep -------------------------------------------------------------------------

    async def _sweep_expired(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception as exc:
                log.warning("background responses: the sweep failed: %r", exc)
            await trio.sleep(SWEEP_S)

    async def sweep(self) -> int:
        """Mark ``failed`` every background response whose holder's lease expired (its
        server stopped): the number marked."""
        marked = 0
        now = _lease(0.0)
        ticket = self.progress.ticket()
        for record in await self.store.with_status(KIND, ["queued", "in_progress"],
                                                   limit=SWEEP_LIMIT):
            meta = record.meta
            if not meta.get("background") or meta.get("lease_until_ms", 0) >= now:
                continue
            response, items, count = await self._so_far(record, ticket)
            response["status"] = "failed"
            response["error"] = {"code": "server_stopped", "message": (
                "The server that ran this response stopped before it finished.")}
            if await self.store.update(KIND, record.owner, record.id,
                                       meta={**meta, "status": "failed"},
                                       body=record_body(response, items),
                                       expect=_expect(meta)):
                self.progress.end(record.owner, record.id)
                event = {"type": "response.failed", "response": response,
                         "sequence_number": count}
                await self.store.append_events(KIND, record.owner, record.id, [
                    b"event: response.failed\ndata: " + dumps(event) + b"\n\n"])
                log.warning("background response %s: its server stopped; marked failed",
                            record.id)
                marked += 1
        return marked

    async def so_far(self, record: Record, ticket: int) -> tuple[dict, list, int]:
        """A running record's Response object with the output its events made so far (a
        poll's answer: server.openai.responses_progress), its input items, and how many
        events it has. Folds only the events stored since this frontend's last fold.
        ``ticket``: ``progress.ticket()`` taken before ``record`` was read."""
        response, items = await off_loop(len(record.body), response_of, record.body)
        owner, rid = record.owner, record.id
        start, count = self.progress.start(owner, rid, response)
        events = await self.store.read_events(KIND, owner, rid, after=count - 1)
        if not events:
            return start, items, count
        response = await off_loop(sum(map(len, events)), response_so_far, start, events)
        self._events_folded += len(events)
        self.progress.keep(owner, rid, count + len(events), response, ended(events), ticket)
        return response, items, count + len(events)

    async def _so_far(self, record: Record, ticket: int) -> tuple[dict, list, int]:
        """:meth:`so_far`, the open item ``incomplete``: a cancel or a sweep keeps what was
        generated, as a poll showed it, and as a drain's ``response.failed`` does."""
        response, items, count = await self.so_far(record, ticket)
        output = [{**item, "status": "incomplete"} if item.get("status") == "in_progress"
                  else item for item in response.get("output") or ()]
        return {**response, "output": output}, items, count

    # -- cancel and follow -----------------------------------------------------------------

    async def cancel(self, owner: str, response_id: str) -> bytes:
        """Cancel a queued or in-progress background response: the Response object."""
        for _ in range(10):
            ticket = self.progress.ticket()
            record = await self.store.get(KIND, owner, response_id)
            if record is None:
                raise not_found(response_id)
            meta = record.meta
            if not meta.get("background"):
                raise ClientError("Only responses created with background=true can be "
                                  "cancelled.", code="not_background")
            status = meta.get("status")
            if status == "cancelled":
                return dumps(response_of(record.body)[0])
            if status in _ENDED:
                raise ClientError(f"Response '{printable(response_id)}' is already "
                                  f"{status}: it cannot be cancelled.",
                                  code="response_already_ended")
            response, items, _ = await self._so_far(record, ticket)
            response["status"] = "cancelled"
            if await self.store.update(KIND, owner, response_id,
                                       meta={**meta, "status": "cancelled"},
                                       body=record_body(response, items),
                                       expect=_expect(meta)):
                self.progress.end(owner, response_id)
                job = self._jobs.get(response_id)
                if job is not None and job.owner == owner:
                    self._lost(job)
                return dumps(response)
            await trio.lowlevel.checkpoint()  # (a lease renewed meanwhile: read it again)
        raise ServiceUnavailable("The response changed too often to cancel: try again.")

    async def follow(self, record: Record, after: int):
        """The events of ``record`` after ``after``, as they are appended, until its
        terminal event (or its cancel): an async iterator of bytes."""
        kind, owner, rid = KIND, record.owner, record.id
        background = bool(record.meta.get("background"))
        ended_polls = 0  # polls that saw a final status without its terminal event
        while True:
            events = await self.store.read_events(kind, owner, rid, after=after)
            if events:
                after += len(events)
                yield b"".join(events)
                if _terminal(events[-1]) or not background:
                    return
                continue
            if not background:
                return
            now = await self.store.get(kind, owner, rid)
            if now is None:
                return
            if now.meta.get("status") == "cancelled":
                # (the cancel kept the text of every event stored before it; those stored
                # since the read above go out first, or the stream would miss that text)
                events = await self.store.read_events(kind, owner, rid, after=after)
                if events:
                    yield b"".join(events)
                return
            if now.meta.get("status") in _ENDED:
                # (ended: its last events follow the status at once, unless its holder
                # died between the two writes; past the last event there is nothing to wait for)
                last = await self.store.read_events(kind, owner, rid, after=after - 1)
                if len(last) > 1:
                    continue  # (more came meanwhile: send them first)
                if (after >= 0 and not last) or (last and _terminal(last[0])):
                    return
                ended_polls += 1
                if ended_polls * POLL_S > LEASE_S:
                    return
            job = self._jobs.get(rid)
            if job is None:
                await trio.sleep(POLL_S)
            else:
                with trio.move_on_after(RENEW_S):
                    await job.changed.wait()


class BackgroundService(LifespanService[BackgroundResponses]):
    """The app's handle on its :class:`BackgroundResponses`: :meth:`start` runs it in the
    lifespan's nursery once the store is open (none without a store); :meth:`stop`, after
    the engine stopped and before the store closes, ends it and waits (shielded) while its
    jobs mark what they left failed. ``responses``: the running service, else None."""

    def __init__(self, app) -> None:
        super().__init__()
        self.app = app

    @property
    def responses(self) -> BackgroundResponses | None:
        return self.running

    async def start(self, nursery: trio.Nursery, store: StateStore | None) -> None:
        if store is None:
            return
        limit = self.app.server_config.max_background_responses
        await self._start(nursery, BackgroundResponses(self.app, store, limit).run)


class BackgroundCollector:
    """``/metrics``: ``trio_llm:background_responses_running`` (a gauge) and
    ``trio_llm:background_responses_aborted`` (a counter) of this frontend's service, read at
    scrape time; no series while it does not run. Labelled as the state store's are."""

    def __init__(self, service: BackgroundService, model_name: str) -> None:
        self._service = service
        self._labels = [model_name]

    def describe(self) -> list:
        return []  # (registered before the service starts)

    def collect(self):
        responses = self._service.responses
        if responses is None:
            return
        stats = responses.statistics()
        running = GaugeMetricFamily("trio_llm:background_responses_running",
                                    "Background responses this frontend runs now.",
                                    labels=["model_name"])
        running.add_metric(self._labels, stats.running)
        yield running
        aborted = CounterMetricFamily(
            "trio_llm:background_responses_aborted",
            "Background responses stopped by a cancel, a delete or a lost lease (each its "
            "engine request's one abort).", labels=["model_name"])
        aborted.add_metric(self._labels, stats.aborted)
        yield aborted
