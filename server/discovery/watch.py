"""Keep one DNS name's workers current: re-resolve on a period, and sooner on failures.

Theory of operation
-------------------
:meth:`DnsWatch.run` resolves the name, hands a changed set of addresses to ``changed``,
then sleeps until the next resolution: the records' TTL, held between ``min_interval`` and
``max_interval``. :meth:`poke` (a worker of the name could not be reached) wakes it
sooner, never sooner than ``min_interval`` after the last resolution. So however a record
flaps, the set changes at most once per ``min_interval``: the frontend cannot be made to
churn connections faster than that.

A failed resolution (no answer, SERVFAIL, NXDOMAIN) keeps the last set: a DNS outage does
not empty the pool. It is logged, counted (:class:`WatchStatistics`, in /metrics), and
retried after ``min_interval``, doubling up to ``max_interval`` while it fails. An answer
with no address is an empty set: every worker of the name is drained.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ..worker_protocol.handshake import WorkerAddress
from .dns import Resolved, ResolveError, resolve
from .names import DnsName

__all__ = ["DnsWatch", "WatchStatistics"]

log = logging.getLogger("server.discovery")


@dataclass
class WatchStatistics:
    #: Resolutions that answered, and those that failed (the last set was kept).
    resolutions: int = 0
    failures: int = 0
    #: Answers whose set of addresses differed from the last one.
    changes: int = 0
    #: The addresses of the last answer.
    addresses: int = 0
    #: Why the last resolution failed; None once one answered again.
    last_error: str | None = None


class DnsWatch:
    """One name's workers (see the module docstring). ``changed(addresses)`` is called
    (plain def: never blocks) with each new set, the first answer's included."""

    def __init__(self, target: DnsName, server: tuple[str, int], *, min_interval: float,
                 max_interval: float,
                 changed: Callable[[DnsName, frozenset[WorkerAddress]], None],
                 resolver: Callable[[DnsName, tuple[str, int]], Awaitable[Resolved]] = resolve,
                 ) -> None:
        self.target = target
        self._resolve = resolver
        self.server = server
        self.min_interval = min_interval
        self.max_interval = max(max_interval, min_interval)
        self.changed = changed
        self.addresses: frozenset[WorkerAddress] | None = None  # (None: never answered)
        self.stats = WatchStatistics()
        self._poked = trio.Event()

    def poke(self) -> None:
        """Resolve again soon (no sooner than ``min_interval`` after the last time)."""
        self._poked.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Resolve until cancelled; ``started()`` after the first resolution, answered or
        not (then the name's workers come with the first answer)."""
        backoff = self.min_interval
        while True:
            last = trio.current_time()
            self._poked = trio.Event()
            try:
                resolved = await self._resolve(self.target, self.server)
                wait = self._resolved(resolved.addresses, resolved.ttl)
                backoff = self.min_interval
            except ResolveError as exc:
                self._failed(str(exc))
                wait = backoff
                backoff = min(backoff * 2, self.max_interval)
            task_status.started()
            task_status = trio.TASK_STATUS_IGNORED
            with trio.move_on_at(last + wait):
                await self._poked.wait()
            await trio.sleep_until(last + self.min_interval)

    def _resolved(self, addresses: frozenset[WorkerAddress], ttl: int) -> float:
        """Note an answer; the seconds until the next resolution."""
        stats = self.stats
        stats.resolutions += 1
        stats.last_error = None
        stats.addresses = len(addresses)
        if addresses != self.addresses:
            if self.addresses is not None:
                stats.changes += 1
            gone = sorted(map(str, (self.addresses or frozenset()) - addresses))
            new = sorted(map(str, addresses - (self.addresses or frozenset())))
            log.info("%s: %d workers (new: %s; gone: %s)", self.target, len(addresses),
                     ", ".join(new) or "none", ", ".join(gone) or "none")
            self.addresses = addresses
            self.changed(self.target, addresses)
        return min(max(float(ttl), self.min_interval), self.max_interval)

    def _failed(self, reason: str) -> None:
        stats = self.stats
        stats.failures += 1
        if stats.last_error != reason:  # (once per new reason: an outage is not a flood)
            log.warning("%s: cannot resolve (%s); keeping its %d known workers", self.target,
                        reason, len(self.addresses or ()))
        stats.last_error = reason
