"""The app's handle on its :class:`~server.batches.runner.BatchRunner`: started in the
ASGI lifespan's nursery once the state store is open (none without a store), stopped
before the engine drains, so that batch lines do not hold a server's shutdown: the
lines in flight are aborted and the leases released, for the next server to resume."""

from __future__ import annotations

import trio

from ..state import StateStore
from .runner import BatchRunner

__all__ = ["BatchService"]


class BatchService:
    """``runner``: the running :class:`BatchRunner`, else None."""

    def __init__(self, app) -> None:
        self.app = app
        self.runner: BatchRunner | None = None
        self._scope = trio.CancelScope()
        self._stopped: trio.Event | None = None

    async def start(self, nursery: trio.Nursery, store: StateStore | None) -> None:
        if store is None:
            return
        self._stopped = trio.Event()
        concurrency = self.app.server_config.batch_concurrency
        self.runner = await nursery.start(self._run, BatchRunner(
            self.app, store, concurrency=concurrency))

    async def _run(self, runner: BatchRunner, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._scope:
                await runner.run(task_status=task_status)
        finally:
            self.runner = None
            assert self._stopped is not None
            self._stopped.set()

    async def stop(self) -> None:
        """End the runner and wait (shielded) while it releases its leases."""
        self._scope.cancel()
        if self._stopped is not None:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()
