"""The store as a service of the server's nursery: :func:`run_state_store` opens it, hands
it over (``task_status.started(store)``), deletes what is past its retention every
``SWEEP_INTERVAL_S``, and closes it when cancelled (shielded, bounded by
``CLOSE_TIMEOUT_S``).

Without ``--state-dir`` and ``--state-url`` the store is SQLite in a private temporary
directory that lives as long as the server: the directory of ``--api-servers``' supervisor
(``DIR/state``, shared by its frontends; the supervisor removes it at exit), or, for a
server on its own, one made here (:mod:`server.private_dir`: mode 0700, locked, removed at
the end, and by the next server's start if this one was killed). Stored responses then work
out of the box (OpenAI's ``store`` defaults to true) but end with the server: give
``--state-dir`` for state that survives a restart.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable, Generic, TypeVar

import trio

from ..config import ServerConfig
from ..private_dir import make_private_directory
from .opening import StateConfig, open_state_store
from .sql import SQLStore

__all__ = ["CLOSE_TIMEOUT_S", "LifespanService", "SWEEP_INTERVAL_S", "StateService",
           "default_directory", "run_state_store", "state_config"]

log = logging.getLogger("server.state")

#: How often expired records are deleted (they are invisible from the moment they expire).
SWEEP_INTERVAL_S = 60.0
#: How long closing may wait for the operation in flight.
CLOSE_TIMEOUT_S = 10.0

_SUBDIRECTORY = "state"


def default_directory(frontend_dir: str | None) -> str | None:
    """Where a server keeps its state without ``--state-dir``/``--state-url``: its
    supervisor's private directory's, or None (a temporary one of its own)."""
    return os.path.join(frontend_dir, _SUBDIRECTORY) if frontend_dir else None


def state_config(config: ServerConfig) -> StateConfig:
    """The store a server's options (``--state-*``) name."""
    directory = None
    if not config.state_url:
        directory = config.state_dir or default_directory(config.frontend_dir)
    return StateConfig(directory=directory, url=config.state_url,
                       retention_s=config.state_retention, max_bytes=config.state_max_bytes,
                       max_bytes_per_key=config.state_max_bytes_per_key)


def in_virtual_time() -> bool:
    """Whether this Trio run's clock is a test's :class:`trio.testing.MockClock` (virtual
    time). Then an app opens no store: a store's every read runs in a thread, and an
    autojump clock jumps to its next deadline while one runs, so the sweep loop would spin
    and every timeout of the test fire early. A MockClock exists only where trio.testing
    was imported, so the library does not import it to ask."""
    testing = sys.modules.get("trio.testing")
    return testing is not None and isinstance(trio.lowlevel.current_clock(), testing.MockClock)


T = TypeVar("T")


class LifespanService(Generic[T]):
    """One service of the app's lifespan nursery that the app stops itself, at its own step
    of the shutdown: the state store, and the batch runner and background responses on it.

    Why not just let the nursery's end cancel them: their order matters. The batch runner
    stops before the drain, background jobs after the engine, the store after both. So
    each runs in a cancel scope of its own; :meth:`stop` cancels it and waits, shielded,
    until its cleanup ends. ``running`` is what the service handed to
    ``task_status.started``, None before it started and once it ended."""

    def __init__(self) -> None:
        self.running: T | None = None
        self._scope = trio.CancelScope()
        self._stopped: trio.Event | None = None

    async def _start(self, nursery: trio.Nursery, run: Callable[..., Awaitable[Any]],
                     *args: Any) -> None:
        """Run ``run(*args, task_status=...)`` in ``nursery`` until :meth:`stop`, and wait
        until it has started; raises what it raised before that."""
        self._stopped = stopped = trio.Event()
        value = await nursery.start(self._run, run, *args)
        if not stopped.is_set():  # (not ended already, before this resumed)
            self.running = value

    async def _run(self, run: Callable[..., Awaitable[Any]], *args: Any,
                   task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._scope:
                await run(*args, task_status=task_status)
        finally:
            self.running = None
            assert self._stopped is not None
            self._stopped.set()

    async def stop(self) -> None:
        """End the service and wait (shielded) while it cleans up; at once if it never
        started."""
        self._scope.cancel()
        if self._stopped is not None:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()


class StateService(LifespanService[SQLStore]):
    """The app's handle on its store: :meth:`start` runs :func:`run_state_store` in the
    app's nursery and waits until the store is open; :meth:`stop` closes it and waits
    (shielded). ``store`` is the open store, None before and after."""

    def __init__(self, config: StateConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def store(self) -> SQLStore | None:
        return self.running

    async def start(self, nursery: trio.Nursery) -> None:
        """Raises :class:`~server.state.StateStoreError` when the store cannot be opened."""
        await self._start(nursery, run_state_store, self.config)


async def run_state_store(config: StateConfig, *, sweep_interval: float = SWEEP_INTERVAL_S,
                          clock: Callable[[], float] = time.time,
                          task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the store of ``config`` until cancelled (module docstring). ``clock``: unix
    seconds (tests move it)."""
    temporary: tuple[str, int] | None = None
    if not config.url and not config.directory:
        temporary = await trio.to_thread.run_sync(make_private_directory)
        config = replace(config, directory=os.path.join(temporary[0], _SUBDIRECTORY))
    try:
        store = await open_state_store(config, clock=clock)
        try:
            log.info("state store: %s%s", config.describe(),
                     " (temporary: removed at exit; --state-dir keeps it)" if temporary else "")
            task_status.started(store)
            while True:
                try:
                    await _sweep(store)
                except Exception as exc:  # a database gone away: try again next time
                    log.warning("state store: the sweep of expired records failed: %r", exc)
                await trio.sleep(sweep_interval)
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + CLOSE_TIMEOUT_S
                await store.aclose()
    finally:
        if temporary is not None:  # (on the loop: at exit, one small directory)
            shutil.rmtree(temporary[0], ignore_errors=True)
            os.close(temporary[1])


async def _sweep(store: SQLStore) -> None:
    removed = await store.sweep()
    if removed:
        log.info("state store: deleted %d expired records", removed)
