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
from typing import Callable

import trio

from ..config import ServerConfig
from ..private_dir import make_private_directory
from .opening import StateConfig, open_state_store
from .sql import SQLStore

__all__ = ["CLOSE_TIMEOUT_S", "SWEEP_INTERVAL_S", "StateService", "default_directory",
           "run_state_store", "state_config"]

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


class StateService:
    """The app's handle on its store: :meth:`start` runs :func:`run_state_store` in the
    app's nursery and waits until the store is open; :meth:`stop` closes it and waits
    (shielded). ``store`` is the open store, None before and after."""

    def __init__(self, config: StateConfig) -> None:
        self.config = config
        self.store: SQLStore | None = None
        self._scope = trio.CancelScope()
        self._started = False
        self._stopped = trio.Event()

    async def start(self, nursery: trio.Nursery) -> None:
        """Raises :class:`~server.state.StateStoreError` when the store cannot be opened."""
        self._started = True
        self.store = await nursery.start(self._run)

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._scope:
                await run_state_store(self.config, task_status=task_status)
        finally:
            self.store = None
            self._stopped.set()

    async def stop(self) -> None:
        self._scope.cancel()
        if self._started:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()


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
