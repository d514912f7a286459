"""The batch runner: the service that runs every stored batch's lines, on one frontend
of the several that may share the state store.

Theory of operation
-------------------
A batch is created ``validating`` (:mod:`server.http.batches`) and pokes the runner. The
runner looks for work at start, when poked, and every :data:`POLL_S`: the store's
batches in an active status (``with_status``), every owner's, oldest first. It claims one
whose ``holder`` is None or whose lease (``lease_until_ms``) has expired by a
compare-and-set on ``status``, ``holder`` and ``lease_until_ms``: of several frontends
that saw the same batch, one takes it; a dead server's batch is taken over once its lease
expires. The holder renews its lease every :data:`RENEW_S` (with the ``request_counts``
so far); a renewal that loses its compare-and-set re-reads the record: ``cancelling``
under our hold is a cancel, anything else means the batch is no longer ours and its task
stops.

Lines are read from the input file at each claim. Each finished line is appended as an
event of the batch's record (its output line, a write for whatever finished meanwhile), so
a SIGKILL loses only lines in flight or not yet written: whoever resumes the batch skips
every ``custom_id`` an event already holds, and so each appears exactly once at the end.
Those events count against the owner's stored bytes: a write the store refuses (the key's
quota, the store's budget) stops the lines and ends the batch ``failed``, ``storage_full``.

Priority: lines fill idle capacity only. At most ``concurrency`` lines run at once, all
batches of this frontend together, and none starts while a worker reports requests
waiting in its queue or a pool is at its admission limit (interactive requests first).
A vllm worker with priority scheduling also gets the lines at a priority below interactive
requests (:mod:`server.manager.batch_priority`), so vLLM preempts lines, not clients.

At the end the batch is ``finalizing``: the events become the output file (answered 2xx)
and the error file (the rest), file records of purpose ``batch_output``, in input order;
then ``completed`` (or ``cancelled``, ``expired``) with its counts and file ids, and the
lease released. A server that stops releases its leases (shielded, bounded) so that the
next one resumes at once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import trio

from ..http import file_store
from ..openai.batch_input import BatchLine, batch_lines
from ..openai.encode import dumps
from ..state import StateStore, StoreFull
from .calls import call_line, owner_key, refused_in_batch
from .objects import (
    ACTIVE, COMPLETION_WINDOW_S, ENDED, KIND, error_line, is_error_line, output_line,
)

__all__ = ["BatchRunner", "BatchStatistics", "LEASE_S", "POLL_S", "RENEW_S"]

log = logging.getLogger("server.batches")

#: Seconds a holder's lease lasts: how long a dead server's batch waits to be taken over.
LEASE_S = 10.0
#: How often a holder renews its leases (and notices a cancel from another frontend).
RENEW_S = 1.0
#: How often the runner looks for batches to claim (also when poked, and at start).
POLL_S = 2.0
#: How often a line waiting for idle capacity looks again.
GATE_S = 0.02
#: Seconds a stopping runner may take to release its leases.
RELEASE_TIMEOUT_S = 5.0

_CAS_KEYS = ("status", "holder", "lease_until_ms")


def _lease(seconds: float = LEASE_S) -> int:
    return int((time.time() + seconds) * 1000)


def _expect(meta: dict) -> dict:
    return {key: meta.get(key) for key in _CAS_KEYS}


@dataclass(frozen=True, slots=True)
class BatchStatistics:
    """What this frontend's runner does now: batches held, lines in flight, lines run
    (``/metrics``: server.observability.batch_metrics)."""

    batches: int
    lines_in_flight: int
    lines_done: int
    #: Line calls refused by an admission limit that interactive requests reached between
    #: the line's start and its admission: run again once there is room, not failed.
    lines_retried: int = 0
    #: Of ``lines_done``: those answered 2xx (the output file's), and the rest.
    lines_completed: int = 0
    lines_failed: int = 0
    #: The store's batches in each active status (every frontend's; each of
    #: :data:`~server.batches.objects.ACTIVE` present), as of this runner's last look.
    active: dict[str, int] = field(default_factory=dict)
    #: Batches this runner brought to each final status (each of ``ENDED`` present).
    ended: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Job:
    owner: str
    id: str
    created_at: int
    meta: dict
    lock: trio.Lock = field(default_factory=trio.Lock)
    lines_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    renew_now: trio.Event = field(default_factory=trio.Event)
    completed: int = 0
    failed: int = 0
    total: int = 0
    cancelling: bool = False
    #: Why the store refused a line's answer (the owner's quota or the store's budget):
    #: the batch then ends ``failed``, ``storage_full``, as when its files do not fit.
    full: str | None = None


class BatchRunner:
    """Runs batches on ``app`` out of ``store`` (see the module docstring). Start it with
    ``nursery.start(runner.run)``; :meth:`poke` after a create, :meth:`nudge` after a
    cancel."""

    def __init__(self, app, store: StateStore, *, concurrency: int) -> None:
        self.app = app
        self.store = store
        self.concurrency = concurrency
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._slots = trio.Semaphore(concurrency)
        self._poked = trio.Event()
        self._jobs: dict[str, _Job] = {}
        self._in_flight = 0
        self._retried = 0
        self._completed = 0
        self._failed = 0
        self._active: dict[str, int] = dict.fromkeys(ACTIVE, 0)
        self._ended: dict[str, int] = dict.fromkeys(ENDED, 0)

    def statistics(self) -> BatchStatistics:
        return BatchStatistics(len(self._jobs), self._in_flight,
                               self._completed + self._failed, self._retried,
                               self._completed, self._failed, dict(self._active),
                               dict(self._ended))

    def poke(self) -> None:
        """A batch was created: look for work now."""
        self._poked.set()

    def nudge(self, batch_id: str) -> None:
        """A batch was cancelled: its holder, if on this frontend, notices at once."""
        job = self._jobs.get(batch_id)
        if job is not None:
            job.renew_now.set()
        self._poked.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Claim and run batches until cancelled; then release the leases held."""
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self)
                while True:
                    await self._claim(nursery)
                    with trio.move_on_after(POLL_S):
                        await self._poked.wait()
                    self._poked = trio.Event()
        finally:
            with trio.move_on_after(RELEASE_TIMEOUT_S) as bound:
                bound.shield = True
                for job in list(self._jobs.values()):
                    await self._release(job)
                self._jobs.clear()

    # -- claiming ---------------------------------------------------------------------------

    async def _claim(self, nursery: trio.Nursery) -> None:
        now = int(time.time() * 1000)
        records = await self.store.with_status(KIND, ACTIVE, limit=10_000)
        self._active = {**dict.fromkeys(ACTIVE, 0),
                        **Counter(str(r.meta.get("status")) for r in records)}
        for record in records:
            meta = record.meta
            if record.id in self._jobs or (meta.get("holder") is not None
                                           and (meta.get("lease_until_ms") or 0) > now):
                continue
            claimed = {**meta, "holder": self.holder, "lease_until_ms": _lease()}
            if meta["status"] == "validating":
                claimed.update(status="in_progress", in_progress_at=int(time.time()))
            if await self.store.update(KIND, record.owner, record.id, meta=claimed,
                                       expect=_expect(meta)):
                job = _Job(record.owner, record.id, record.created_at, claimed)
                self._jobs[job.id] = job
                nursery.start_soon(self._run_job, job)

    async def _release(self, job: _Job) -> None:
        """Give the batch back (a stopping server): the next runner resumes it at once."""
        async with job.lock:
            meta = {**job.meta, "holder": None, "lease_until_ms": None}
            if await self.store.update(KIND, job.owner, job.id, meta=meta,
                                       expect=_expect(job.meta)):
                job.meta = meta

    async def _write_meta(self, job: _Job, **changes) -> bool:
        """Compare-and-set the batch's meta under our lease; False: it is not ours now."""
        async with job.lock:
            if job.meta.get("holder") != self.holder:
                return False  # (released or finished: nothing more to write)
            meta = {**job.meta, **changes}
            if not await self.store.update(KIND, job.owner, job.id, meta=meta,
                                           expect=_expect(job.meta)):
                return False
            job.meta = meta
            if changes.get("status") in self._ended:
                self._ended[changes["status"]] += 1
            return True

    async def _renew(self, job: _Job) -> None:
        while True:
            with trio.move_on_after(RENEW_S):
                await job.renew_now.wait()
            job.renew_now = trio.Event()
            if await self._write_meta(job, lease_until_ms=_lease(),
                                      request_counts=self._counts(job)):
                continue
            record = await self.store.get(KIND, job.owner, job.id)
            if record is not None and record.meta.get("holder") == self.holder \
                    and record.meta["status"] == "cancelling":
                async with job.lock:
                    job.meta = record.meta
                job.cancelling = True
                job.lines_scope.cancel()
                continue
            log.info("batch %s: no longer held here (lease lost)", job.id)
            job.scope.cancel()
            return

    @staticmethod
    def _counts(job: _Job) -> dict:
        return {"total": job.total, "completed": job.completed, "failed": job.failed}

    # -- running one batch ------------------------------------------------------------------

    async def _run_job(self, job: _Job) -> None:
        """One batch, to its end or until it is not ours. A runner that stops cancels it
        from outside: it stays in ``_jobs`` for :meth:`run` to release."""
        try:
            with job.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._renew, job)
                    await self._work(job)
                    nursery.cancel_scope.cancel()
        except Exception:
            log.exception("batch %s: failed", job.id)
            with trio.move_on_after(RELEASE_TIMEOUT_S) as bound:
                bound.shield = True
                await self._write_meta(job, status="failed", failed_at=int(time.time()),
                                       holder=None, lease_until_ms=None,
                                       errors=_errors("server_error", "The server failed "
                                                      "while running the batch."))
        self._jobs.pop(job.id, None)

    async def _work(self, job: _Job) -> None:
        content = await file_store.file_content(self.store, job.owner, job.meta["input_file_id"])
        if content is None:
            await self._write_meta(job, status="failed", failed_at=int(time.time()),
                                   holder=None, lease_until_ms=None,
                                   errors=_errors("file_not_found", "The input file is gone."))
            return
        lines = await trio.to_thread.run_sync(lambda: list(batch_lines(content)))
        job.total = len(lines)
        done = await self._done_ids(job)
        job.cancelling = job.meta["status"] == "cancelling"
        if job.meta["status"] == "in_progress":
            await self._run_lines(job, [line for line in lines if line.custom_id not in done])
        if job.full is not None:
            await self._write_meta(job, status="failed", failed_at=int(time.time()),
                                   holder=None, lease_until_ms=None,
                                   errors=_errors("storage_full", f"Not stored: {job.full}"))
            return
        expired = _expired(job)
        await self._finish(job, lines, expired)

    async def _done_ids(self, job: _Job) -> set[str]:
        done: set[str] = set()
        job.completed = job.failed = 0
        for event in await self.store.read_events(KIND, job.owner, job.id):
            line = json.loads(event)
            if line["custom_id"] in done:
                continue
            done.add(line["custom_id"])
            if is_error_line(line):
                job.failed += 1
            else:
                job.completed += 1
        return done

    async def _run_lines(self, job: _Job, pending: list[BatchLine]) -> None:
        api_key = owner_key(self.app.accepted_keys, job.owner) \
            if self.app.api_keys is not None else None
        send, receive = trio.open_memory_channel[tuple[bytes, bool]](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._append, job, receive)
            async with send:
                with job.lines_scope:
                    async with trio.open_nursery() as lines:
                        for line in pending:
                            if _expired(job):
                                break
                            await self._slot()
                            lines.start_soon(self._line, job, line, api_key, send)

    async def _slot(self) -> None:
        """Take a line's slot once there is idle capacity (module docstring)."""
        await self._slots.acquire()
        try:
            await self._wait_idle()
        except BaseException:
            self._slots.release()
            raise

    async def _wait_idle(self) -> None:
        while True:  # (polled: a worker's queue is known from its heartbeats)
            if not self._interactive_waiting():
                return
            await trio.sleep(GATE_S)

    def _interactive_waiting(self) -> bool:
        for pool in self.app.models.pools:
            engine = pool.engine
            if engine is None or not pool.healthy():
                return True  # (not started, no worker up, or draining: not now)
            if self.app.saturated(pool):
                return True
            if any(w.waiting for w in engine.statistics().workers):
                return True
        return False

    async def _line(self, job: _Job, line: BatchLine, api_key: str | None, send) -> None:
        self._in_flight += 1
        try:
            request_id = "batch_req_" + os.urandom(12).hex()
            answer = refused_in_batch(line.body, request_id)
            while answer is None:
                answer = await call_line(self.app, line.url, dumps(line.body), api_key,
                                         request_id)
                if _overloaded(answer) and not _expired(job):  # (not now: run it later)
                    answer = None
                    self._retried += 1
                    await trio.sleep(GATE_S)
                    await self._wait_idle()
            send.send_nowait((output_line(line.custom_id, answer.status, answer.request_id,
                                          answer.body), 200 <= answer.status < 300))
        finally:
            self._in_flight -= 1
            self._slots.release()

    async def _append(self, job: _Job, receive) -> None:
        """Append finished lines as events, each write taking whatever finished meanwhile.
        A write the store refuses (full) stops the lines; what finishes after is dropped."""
        async with receive:
            async for first in receive:
                batch = [first]
                while True:
                    try:
                        batch.append(receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                if job.full is not None:
                    continue
                try:
                    with trio.CancelScope(shield=True):  # (a line's answer is not lost halfway)
                        await self.store.append_events(KIND, job.owner, job.id,
                                                       [line for line, _ in batch])
                except StoreFull as exc:
                    log.info("batch %s: failed: %s", job.id, exc.message)
                    job.full = exc.message
                    job.lines_scope.cancel()
                    continue
                for _, ok in batch:
                    if ok:
                        job.completed += 1
                        self._completed += 1
                    else:
                        job.failed += 1
                        self._failed += 1

    # -- the end ----------------------------------------------------------------------------

    async def _finish(self, job: _Job, lines: list[BatchLine], expired: bool) -> None:
        now = int(time.time())
        if job.cancelling:
            final = {"status": "cancelled", "cancelled_at": now}
        elif expired:
            final = {"status": "expired", "expired_at": now}
        else:
            final = {"status": "completed", "completed_at": now}
            if job.meta["status"] != "finalizing" and not await self._write_meta(
                    job, status="finalizing", finalizing_at=now):
                return
        order = {line.custom_id: line.number for line in lines}
        outputs: dict[str, tuple[bytes, bool]] = {}
        for event in await self.store.read_events(KIND, job.owner, job.id):
            parsed = json.loads(event)
            outputs.setdefault(parsed["custom_id"], (event, is_error_line(parsed)))
        if expired and not job.cancelling:
            for line in lines:
                if line.custom_id not in outputs:
                    outputs[line.custom_id] = (error_line(
                        line.custom_id, "batch_expired", "This line was not run within the "
                        "batch's completion window."), True)
        ordered = sorted(outputs.items(), key=lambda item: order.get(item[0], 0))
        good = [event for _, (event, bad) in ordered if not bad]
        bad = [event for _, (event, bad) in ordered if bad]
        files = {}
        try:
            if good:
                files["output_file_id"] = await self._store_file(job, "output", good)
            if bad:
                files["error_file_id"] = await self._store_file(job, "error", bad)
        except StoreFull as exc:
            await self._write_meta(job, status="failed", failed_at=now, holder=None,
                                   lease_until_ms=None,
                                   errors=_errors("storage_full", f"Not stored: {exc.message}"))
            return
        counts = {"total": len(lines), "completed": len(good), "failed": len(bad)}
        if not await self._write_meta(job, **final, **files, request_counts=counts,
                                      holder=None, lease_until_ms=None):
            for file_id in files.values():
                await file_store.delete_file(self.store, job.owner, file_id)

    async def _store_file(self, job: _Job, which: str, lines: list[bytes]) -> str:
        record = await file_store.store_file(self.store, job.owner, f"{job.id}_{which}.jsonl",
                                             "batch_output", b"\n".join(lines) + b"\n")
        return record.id


def _expired(job: _Job) -> bool:
    """Whether the batch's completion window (24 h from its creation) is over."""
    return time.time() >= job.created_at + COMPLETION_WINDOW_S


def _overloaded(answer) -> bool:
    """Whether a line's answer is a 503: "not now" (an admission limit, a drain, no worker
    up yet), no answer to the line, which runs again once there is room."""
    return answer.status == 503


def _errors(code: str, message: str) -> dict:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                        "line": None}]}
