"""Moving a dead worker's unfinished requests to another worker, where they resume.

Theory of operation
-------------------
When a worker's session ends (the process died, the connection to a listening worker
closed, it hung or broke the protocol), its :class:`~server.manager.worker.WorkerClient`
hands the choices it still held to :meth:`Migrator.migrate`, in its own task, before it
ends them. The choices of one request (those sharing one waker) move together, to one
worker, as they were dispatched together. The migrator picks that worker with the
engine's routing policy and submits to it, at once and without blocking, a *continuation*
of each choice. A continuation is the same prompt and wire params (seed and sampling
fields included), with ``max_tokens`` reduced by the tokens already generated, and
``"resume": {"token_ids": [...], "text_chars": k}``. Those are the ids of the tokens
generated (the worker sent them as notes, because the params asked with ``"token_ids":
true``) and how many characters of text the client already has. The worker resumes from there: it prefills the
prompt and the generated tokens, replays its generator through them where it can, and
sends only text the client does not have (see the engine's docs). The choice keeps its
state (counters, pending text, the consumer's waker): the consumer sees nothing but a
pause of about one prefill, and the usage counts each token once.

No task is started: a migration is a few dictionary updates and one pipe write, done in
the dying session's task. Afterwards the choice's ``worker`` is the new one, so an abort,
a client disconnect or a timeout reaches whichever worker holds the request, once.

A choice is not moved, and ends with the ``worker_died`` error as without migration, when

* it already moved ``max_migrations`` times;
* the worker did not send the ids of every token it produced (an engine that cannot say
  them, or that cannot resume: ``"resume"`` not in its HELLO);
* or no other live worker can take it (one that honours a client's ``priority``, for a
  request that carries one: server.manager.batch_priority).

A batch line's priority is the frontend's: the new worker gets it only if it schedules by
priority, whatever the dead one was sent.

A choice whose abort was already sent (its client left, or the server aborted it) ends
with ``abort`` instead: nothing is resumed for a consumer that is going away.

*Resubmitting.* A listening worker that was told to stop refuses the SUBMITs that reach
it after it said LEAVING (server.manager.worker). :meth:`Migrator.resubmit` sends those
choices, which never started, to another worker the same way, with the cause ``left``.
That is not a migration: no limit applies and none is counted against the choice, and it
works with ``--max-migrations 0`` too.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ClientError, ServiceUnavailable
from ..worker_protocol import wire
from .batch_priority import scheduled

if TYPE_CHECKING:
    from .engine import Engine
    from .stream import Choice
    from .worker import WorkerClient

__all__ = ["MigrationStatistics", "Migrator", "continuation"]

log = logging.getLogger("server.migration")


@dataclass
class MigrationStatistics:
    """Sequences moved to another worker, by the cause of the end of their worker's
    session (``exited``, ``disconnected``, ``hung``, ``protocol_error``, ``removed``,
    ``left``: the worker said it was stopping), and sequences
    that could not be moved, by reason (``limit``, ``not_resumable``, ``no_worker``)."""

    migrations: collections.Counter = field(default_factory=collections.Counter)
    failed: collections.Counter = field(default_factory=collections.Counter)


def continuation(choice: Choice) -> dict:
    """The wire params that resume ``choice`` on another worker (sans-IO)."""
    params = dict(choice.params or {})
    done = choice.completion_tokens
    if done:
        assert choice.token_ids is not None and len(choice.token_ids) == done
        if params.get("max_tokens") is not None:
            params["max_tokens"] -= done
        params["resume"] = {"token_ids": list(choice.token_ids), "text_chars": choice.text_chars}
        params.pop("prompt_logprobs", None)  # sent once, with the first output
    return params


def _resumable(choice: Choice) -> bool:
    """Whether the worker told us every token the choice produced (then it can resume)."""
    ids = choice.token_ids
    return choice.completion_tokens == 0 or (
        ids is not None and len(ids) == choice.completion_tokens
    )


class Migrator:
    """The engine's ``migrate`` hook (see the module docstring)."""

    def __init__(self, engine: Engine, max_migrations: int) -> None:
        self.engine = engine
        self.max_migrations = max_migrations
        self.stats = MigrationStatistics()

    def migrate(self, dead: WorkerClient, choices: list[Choice], cause: str) -> list[Choice]:
        """Move what can be moved of ``choices`` (held by ``dead``, whose session ended with
        ``cause``); return the others, for the caller to end with its error."""
        requests: dict[int, list[Choice]] = {}
        for choice in choices:
            requests.setdefault(id(choice.waker), []).append(choice)
        left: list[Choice] = []
        for group in requests.values():
            left.extend(self._move(dead, group, cause))
        return left

    def resubmit(self, leaving: WorkerClient, choices: list[Choice]) -> list[Choice]:
        """Send ``choices``, which ``leaving`` refused before they started, to other
        workers (a request's together); return those no worker could take."""
        requests: dict[int, list[Choice]] = {}
        for choice in choices:
            requests.setdefault(id(choice.waker), []).append(choice)
        left: list[Choice] = []
        for group in requests.values():
            left.extend(self._move(leaving, group, "left", again=True))
        return left

    def _move(self, dead: WorkerClient, group: list[Choice], cause: str, *,
              again: bool = False) -> list[Choice]:
        """Move one request's choices to one worker; returns those left to fail.
        ``again``: choices that never started, sent again (no migration is counted)."""
        stats = self.stats.failed
        movable = []
        left = []
        for choice in group:
            if choice.abort_sent or choice.waker.closed:
                choice.end("abort")
            elif not again and choice.migrations >= self.max_migrations:
                stats["limit"] += 1
                left.append(choice)
            elif not _resumable(choice):
                stats["not_resumable"] += 1
                left.append(choice)
            else:
                movable.append(choice)
        if not movable:
            return left
        engine = self.engine
        resuming = any(c.completion_tokens for c in movable)
        exclude: Sequence[int] = [dead.index] + [
            w.index for w in engine.workers if resuming and not w.info.get("resume")
        ]
        try:
            first = movable[0]  # (its blocks keyed as its first pick keyed them)
            worker, _ = engine.pick_worker(first.prompt, exclude, params=first.params,
                                           adapter=first.adapter, migrating=True)
        except (ServiceUnavailable, ClientError):  # (a client's priority: none honours it)
            stats["no_worker"] += len(movable)
            return left + movable
        frames = []
        packs = worker.reads_packed
        for choice in movable:
            prompt = wire.pack_ids(choice.prompt) if packs else choice.prompt
            params = scheduled(continuation(choice), choice.batch, worker.info)
            message = [wire.SUBMIT, choice.rid, prompt, params]
            if choice.adapter is not None:  # (a LoRA adapter: every worker of the pool has it)
                message.append(choice.adapter)
            frames.append(wire.encode(message))
        for choice in movable:
            choice.worker = worker
            choice.abort_sent = False
            choice.migrations += not again
        worker.submit_nowait(movable, frames)
        waker = movable[0].waker
        waker.pacer = worker.pacer  # its news now comes from that worker's router
        waker.deferred = False  # (the dead worker's pacer forgot it)
        if waker.ready:
            waker.wake()
        self.stats.migrations[cause] += len(movable)
        log.info("worker %d (%s): %d sequence(s) of a request %s to worker %d", dead.index,
                 cause, len(movable), "sent again" if again else "moved", worker.index)
        return left
