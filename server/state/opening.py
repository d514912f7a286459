"""How a server opens its store: :class:`StateConfig` (from ``--state-dir``, ``--state-url``,
``--state-retention``, ``--state-max-bytes``, ``--state-max-bytes-per-key``) and
:func:`open_state_store`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import trio

from .sql import SQLStore

__all__ = ["DEFAULT_RETENTION_S", "StateConfig", "StateStoreError", "open_state_store"]

#: 30 days, as OpenAI keeps stored responses.
DEFAULT_RETENTION_S = 30 * 24 * 3600


class StateStoreError(Exception):
    """The store could not be opened (its directory, its database); the message says where
    and why, in one line (a configuration error: the server does not start)."""


@dataclass(frozen=True, slots=True)
class StateConfig:
    """Where the state lives and its bounds. ``url`` (``postgresql://...``) wins over
    ``directory`` (SQLite); one of them must be set. 0 for a bound means none."""

    directory: str | None = None
    url: str | None = None
    retention_s: int = DEFAULT_RETENTION_S
    max_bytes: int = 0
    max_bytes_per_key: int = 0

    def describe(self) -> str:
        """Where, for the log (a URL without its password)."""
        if self.url:
            from .postgres import redact

            return redact(self.url)
        return f"sqlite:{self.directory}"


async def open_state_store(config: StateConfig, *,
                           clock: Callable[[], float] = time.time) -> SQLStore:
    """Open (and create if missing) the store ``config`` names; close it with ``aclose``
    (or ``async with``). Connects in a worker thread. Raises :class:`StateStoreError`."""
    try:
        return await _open(config, clock)
    except Exception as exc:
        raise StateStoreError(f"cannot open the state store at {config.describe()}: "
                              f"{' '.join(str(exc).split()) or type(exc).__name__}") from exc


async def _open(config: StateConfig, clock: Callable[[], float]) -> SQLStore:
    bounds = dict(retention_s=config.retention_s, max_bytes=config.max_bytes,
                  max_bytes_per_key=config.max_bytes_per_key, clock=clock)
    if config.url:
        from .postgres import PostgresDatabase

        url = config.url
        pg = await trio.to_thread.run_sync(lambda: PostgresDatabase(url))
        return await _ready(SQLStore(pg, **bounds))  # type: ignore[arg-type]
    if not config.directory:
        raise ValueError("StateConfig needs a directory (SQLite) or a postgresql:// url")
    from .sqlite import SQLiteDatabase

    directory = config.directory
    db = await trio.to_thread.run_sync(lambda: SQLiteDatabase(directory))
    return await _ready(SQLStore(db, **bounds))  # type: ignore[arg-type]


async def _ready(store: SQLStore) -> SQLStore:
    try:
        await store.read_statistics()
    except BaseException:
        await store.aclose()
        raise
    return store
