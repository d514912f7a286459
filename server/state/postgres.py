"""The PostgreSQL backend (``--state-url postgresql://...``): frontends on several hosts
share one database. psycopg 3 (``pip install 'trio-llm-server[state-postgres]'``), one
connection per store, in autocommit between the store's own transactions.

Every write transaction first takes one transaction-scoped advisory lock
(``pg_advisory_xact_lock``): writes are serialized across every frontend, as SQLite's are,
so two frontends' size checks cannot both pass. Reads take no lock. A connection the server
lost (PostgreSQL restarted) is opened again by the next operation; the one that found it
broken fails.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

from .records import StoreFull
from .schema import statements

__all__ = ["PostgresDatabase", "redact", "LOCK_KEY"]

#: The advisory lock every write holds ("trio" in ASCII).
LOCK_KEY = 0x7472696F
#: Seconds a connection may take to be made (libpq waits forever by default).
CONNECT_TIMEOUT_S = 10


def redact(url: str) -> str:
    """``url`` without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))


class PostgresDatabase:
    """A :class:`~server.state.sql.Database` on the PostgreSQL database at ``url`` (its
    tables made if missing). Blocking: open it in a worker thread."""

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("--state-url postgresql://... needs psycopg 3: pip install "
                               "'trio-llm-server[state-postgres]'") from exc
        self._psycopg = psycopg
        self._url = url
        self._conn = psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        try:
            with self.write():
                for statement in statements(blob="BYTEA", serial="BIGSERIAL PRIMARY KEY"):
                    self._conn.execute(statement)
        except BaseException:
            self._conn.close()
            raise

    def _connection(self) -> Any:
        if self._conn.broken or self._conn.closed:
            self._conn = self._psycopg.connect(self._url, autocommit=True,
                                               connect_timeout=CONNECT_TIMEOUT_S)
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        cursor = self._connection().execute(sql.replace("?", "%s"), params)
        return cursor.fetchall() if cursor.description is not None else []

    def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._connection().cursor() as cursor:
            cursor.executemany(sql.replace("?", "%s"), rows)

    @contextmanager
    def write(self) -> Iterator[None]:
        full: StoreFull | None = None
        conn = self._connection()
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            try:
                yield
            except StoreFull as exc:  # commit what was removed to make room, then refuse
                full = exc
        if full is not None:
            raise full

    def close(self) -> None:
        self._conn.close()
