"""The app's handle on its :class:`~server.batches.runner.BatchRunner`: started in the
ASGI lifespan's nursery once the state store is open (none without a store), stopped
before the engine drains, so that batch lines do not hold a server's shutdown: the
lines in flight are aborted and the leases released, for the next server to resume."""

from __future__ import annotations

import trio

from ..state import StateStore
from ..state.service import LifespanService
from .runner import BatchRunner

__all__ = ["BatchService"]


class BatchService(LifespanService[BatchRunner]):
    """``runner``: the running :class:`BatchRunner`, else None. :meth:`stop` ends it and
    waits (shielded) while it releases its leases."""

    def __init__(self, app) -> None:
        super().__init__()
        self.app = app

    @property
    def runner(self) -> BatchRunner | None:
        return self.running

    async def start(self, nursery: trio.Nursery, store: StateStore | None) -> None:
        if store is None:
            return
        concurrency = self.app.server_config.batch_concurrency
        await self._start(nursery, BatchRunner(self.app, store, concurrency=concurrency).run)
