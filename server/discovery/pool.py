"""The engine's workers found by DNS: join as their addresses appear, drain as they vanish.

Theory of operation
-------------------
A :class:`~.watch.DnsWatch` per name reports each new set of addresses; the pool compares
the union of every name's set with its members:

* an address that appeared becomes a worker (:meth:`Engine.add_worker`): a new index, or
  the index of one that left and whose service ended (so a pool that keeps replacing pods
  does not grow). Its prefix index starts empty. Its service runs in the pool's nursery.
* a member whose address vanished is *retired*: the router sends it nothing new, its
  running streams go on. Once it holds none, or after ``dns_drain_grace`` seconds, it is
  *removed*: its session ends, what it still runs moves to other workers (migration,
  cause ``removed``), and its index is free. Its prefix index is forgotten with it (it is
  cleared when the index is reused).
* a retired member whose address comes back before it is removed is a member again: the
  connection is kept (a flapping record costs no reconnection).

A member whose session ends (it could not be reached, its connection dropped) pokes its
name's watch: the name is resolved again soon, since a rescheduled pod has a new address.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ..manager.worker import WorkerClient, WorkerStartupError
from ..worker_protocol.handshake import WorkerAddress
from .dns import ResolveError, system_dns_server
from .names import DnsName, parse_dns_server
from .watch import DnsWatch, WatchStatistics

if TYPE_CHECKING:
    from ..manager.engine import Engine

__all__ = ["DiscoveredPool"]

log = logging.getLogger("server.discovery")


class DiscoveredPool:
    """The workers of ``names`` in ``engine`` (see the module docstring)."""

    def __init__(self, engine: Engine, names: list[DnsName]) -> None:
        self.engine = engine
        self.names = names
        self.watches: dict[DnsName, DnsWatch] = {}
        #: Each name's last answer, and the workers of their union, by address.
        self._wanted: dict[DnsName, frozenset[WorkerAddress]] = {}
        self._members: dict[WorkerAddress, WorkerClient] = {}
        self._scopes: dict[WorkerClient, trio.CancelScope] = {}
        self._free: set[int] = set()  # indexes of removed workers whose service ended
        self._nursery: trio.Nursery | None = None

    def owns(self, worker: WorkerClient) -> bool:
        return worker in self._scopes or worker.index in self._free

    def statistics(self) -> tuple[tuple[str, WatchStatistics], ...]:
        return tuple((str(name), watch.stats) for name, watch in self.watches.items())

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Watch every name until cancelled; ``started()`` once each was resolved once
        (answered or not), its workers added."""
        config = self.engine.config
        try:
            server = (parse_dns_server(config.dns_server) if config.dns_server
                      else await system_dns_server())
        except (ValueError, ResolveError) as exc:
            raise ValueError(f"--dns-server: {exc}") from None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for name in self.names:
                watch = self.watches[name] = DnsWatch(
                    name, server, min_interval=config.dns_min_interval,
                    max_interval=config.dns_max_interval, changed=self._changed)
                await nursery.start(watch.run)
            task_status.started()

    def _changed(self, name: DnsName, addresses: frozenset[WorkerAddress]) -> None:
        self._wanted[name] = addresses
        # One worker per address, however many names find it (its TLS certificate is checked
        # against the first name that found it).
        wanted: dict[WorkerAddress, WorkerAddress] = {}
        for found in self._wanted.values():
            for address in sorted(found, key=lambda a: a.name or ""):
                wanted.setdefault(_key(address), address)
        for key, w in list(self._members.items()):
            if key not in wanted and not w.retired:
                self._retire(w)
        for key in sorted(wanted.keys() - self._members.keys(), key=str):
            self._join(wanted[key])
        for key in wanted:
            w = self._members[key]
            if w.retired and not w.removed:
                w.retired = False
                log.info("worker %d (%s) is back in discovery: kept", w.index, w.address)

    def _join(self, address: WorkerAddress) -> None:
        assert self._nursery is not None
        slot = min(self._free) if self._free else None
        self._free.discard(slot)  # type: ignore[arg-type]
        w = self.engine.add_worker(address, slot)
        w.ended = self._ended
        self._members[_key(address)] = w
        self._scopes[w] = trio.CancelScope()
        log.info("worker %d (%s) joins the pool", w.index, address)
        self._nursery.start_soon(self._serve, w)

    async def _serve(self, w: WorkerClient) -> None:
        """Run ``w``'s service until it is removed; then free its index."""
        try:
            with self._scopes[w]:
                await w.run()
        except WorkerStartupError as exc:  # (a worker that refuses our credentials)
            log.error("%s", exc)
        finally:
            w.retired = w.removed = True
            del self._scopes[w]
            if self._members.get(_key(w.address)) is w:
                del self._members[_key(w.address)]
            self.engine.router.reset(w.index)  # (its cache is none of ours now)
            self._free.add(w.index)

    def _retire(self, w: WorkerClient) -> None:
        """Stop routing to ``w``; remove it once drained, or after the grace."""
        assert self._nursery is not None
        w.retired = True
        log.info("worker %d (%s) left discovery: draining (%d requests)", w.index,
                 w.address, w.outstanding)
        self._nursery.start_soon(self._drain, w)

    async def _drain(self, w: WorkerClient) -> None:
        with trio.move_on_after(self.engine.config.dns_drain_grace):
            while w.retired and w.outstanding:
                await w.wait_released()
                if w.outstanding:  # (down meanwhile: its choices moved; wait for the rest)
                    await trio.sleep(0.1)
        if w.retired and not w.removed and w in self._scopes:  # (not back meanwhile)
            w.removed = True
            if self._members.get(_key(w.address)) is w:
                del self._members[_key(w.address)]
            log.info("worker %d (%s) removed from the pool (%d requests move)", w.index,
                     w.address, w.outstanding)
            self._scopes[w].cancel()

    def _ended(self, w: WorkerClient) -> None:
        """A member's session ended: resolve its names again soon."""
        if not w.removed:
            for name, addresses in self._wanted.items():
                if _key(w.address) in {_key(a) for a in addresses}:
                    self.watches[name].poke()


def _key(address: WorkerAddress) -> WorkerAddress:
    """A member's key: its address without the name it was found by (the same worker may
    be found by two names: one member, not two connections to it)."""
    return address._replace(name=None)
