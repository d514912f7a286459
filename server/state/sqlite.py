"""The SQLite backend: one file, ``DIR/state.sqlite3``, in WAL mode, shared by every
frontend on the host (each process opens its own connection; SQLite's file locks order their
writes, and a writer waits up to ``BUSY_TIMEOUT_S`` for another's lock).

WAL lets readers run beside the one writer; ``synchronous=NORMAL`` keeps each commit durable
against a crash of the process (not of the machine's power: the last commits may go then).
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from .records import StoreFull
from .schema import statements

__all__ = ["SQLiteDatabase", "FILENAME", "BUSY_TIMEOUT_S"]

FILENAME = "state.sqlite3"
BUSY_TIMEOUT_S = 30.0


class SQLiteDatabase:
    """A :class:`~server.state.sql.Database` on ``directory/state.sqlite3`` (made, with the
    directory, if missing). Blocking: open it in a worker thread."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.path = os.path.join(directory, FILENAME)
        # autocommit (isolation_level=None): transactions are the explicit BEGINs below;
        # check_same_thread=False: the store hands it to one worker thread at a time
        self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                     check_same_thread=False)
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            with self.write():
                for statement in statements(blob="BLOB",
                                            serial="INTEGER PRIMARY KEY AUTOINCREMENT"):
                    self._conn.execute(statement)
        except BaseException:
            self._conn.close()
            raise

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return self._conn.execute(sql, params).fetchall()

    def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    @contextmanager
    def write(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except StoreFull:
            self._end("COMMIT")
            raise
        except BaseException:
            self._end("ROLLBACK")
            raise
        self._end("COMMIT")

    def _end(self, how: str) -> None:
        """End the transaction (``COMMIT`` or ``ROLLBACK``). A COMMIT that fails (a full
        disk, a busy lock past the timeout) is rolled back, so the connection never keeps
        an open transaction that every later ``BEGIN`` would fail on; a transaction SQLite
        already rolled back itself (after some errors) is not ended twice, which would
        hide the error that ended it."""
        if not self._conn.in_transaction:
            return
        try:
            self._conn.execute(how)
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._conn.close()
