"""The store's logic, in SQL that SQLite and PostgreSQL both run: :class:`SQLStore` over a
:class:`Database` (one connection, blocking; :mod:`.sqlite` and :mod:`.postgres` make one).

Every operation is one short function run in a worker thread (``trio.to_thread.run_sync``)
under the store's own :class:`trio.CapacityLimiter` of one thread: the connection is used by
one thread at a time, and an operation, once started, runs to its end (a cancelled caller
does not leave a transaction half-done). Writes are transactions that hold the database's
write lock from their start (SQLite ``BEGIN IMMEDIATE``, a PostgreSQL advisory lock), so the
size checks of two frontends writing at once cannot both pass, nor the count of a put's
:class:`~.records.AtMost` (two creates at a key's last free batch: one is refused).

Sizes: a record's bytes are its body's plus its meta's JSON, and its events' bytes are kept
beside them. ``trio_llm_owners`` holds each owner's total, changed in the same transaction
as the records, so the budget checks read a few rows and never sum the records.

Events: those a ``put`` stores with a record that has none yet (a finished response's
stream) are one row of ``trio_llm_streams``, their bytes end to end and their lengths:
one row of a few kilobytes costs the thread a third of what 260 rows cost. Those appended
later, and all of a running background response's or a batch's, are one row each in
``trio_llm_events``, numbered after the put's. A store written before ``trio_llm_streams``
existed has every event there; both are read, so its records replay as before.
"""

from __future__ import annotations

import builtins
import json
import struct
from contextlib import AbstractContextManager
from itertools import accumulate
from typing import Any, Callable, Protocol, Sequence, TypeVar

import trio

from .records import AtMost, Record, StoreFull, StoreStatistics, TooMany

__all__ = ["Database", "NEVER", "SQLStore", "SWEEP_BATCH"]

T = TypeVar("T")

#: ``expires_at`` of a record kept until deleted (no retention).
NEVER = 2**62
#: Expired records deleted per transaction by a sweep.
SWEEP_BATCH = 500

_COLUMNS = "kind, id, owner, created_at, meta, body"
#: Where a record's events are (see the module's docstring).
_EVENT_TABLES = ("trio_llm_streams", "trio_llm_events")


class Database(Protocol):
    """One blocking connection, used from one thread at a time."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> builtins.list[tuple]:
        """Run ``sql`` (``?`` placeholders); its rows ([] for a statement without)."""
        ...

    def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run ``sql`` once per row of parameters, in one call (a response's events)."""
        ...

    def write(self) -> AbstractContextManager[None]:
        """A transaction holding the store's write lock; commits at the end, also when
        :class:`StoreFull` leaves it (what it removed to make room stays removed)."""
        ...

    def close(self) -> None: ...


def _record(row: tuple) -> Record:
    kind, id, owner, created_at, meta, body = row
    return Record(kind=kind, id=id, owner=owner, created_at=int(created_at),
                  meta=json.loads(meta), body=bytes(body))


def _dump(meta: dict) -> str:
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=False)


def _packed(events: builtins.list[bytes]) -> tuple[bytes, bytes]:
    """``events`` as one ``trio_llm_streams`` row: their bytes, and their lengths."""
    return b"".join(events), struct.pack(f"<{len(events)}I", *map(len, events))


def _unpacked(data: bytes, lengths: bytes, after: int) -> builtins.list[bytes]:
    """The events of a ``trio_llm_streams`` row numbered past ``after``."""
    ends = list(accumulate(struct.unpack(f"<{len(lengths) // 4}I", lengths)))
    starts = [0, *ends[:-1]]
    first = max(after + 1, 0)
    return [data[start:end] for start, end in zip(starts[first:], ends[first:])]


def _status(meta: dict) -> str:
    """The ``status`` column: meta's ``"status"`` when a string (with_status reads it)."""
    status = meta.get("status")
    return status if isinstance(status, str) else ""


class SQLStore:
    """A :class:`~server.state.records.StateStore` over a :class:`Database`.

    ``retention_s``: seconds a record stays visible after its ``put`` (0: until deleted).
    ``max_bytes`` / ``max_bytes_per_key``: the size budget overall and per owner (0: none).
    ``clock``: unix seconds now (tests move it).
    """

    def __init__(self, db: Database, *, retention_s: int, max_bytes: int = 0,
                 max_bytes_per_key: int = 0, clock: Callable[[], float]) -> None:
        self._db = db
        self._retention_s = retention_s
        self._max_bytes = max_bytes
        self._max_bytes_per_key = max_bytes_per_key
        self._clock = clock
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False
        self._records = 0
        self._bytes = 0
        self._expired = 0
        self._expired_bytes = 0
        self._refused = 0
        self._too_many = 0
        #: The counts as of the last operation's end (the counters above change in the
        #: worker thread, mid-operation).
        self._published = StoreStatistics()

    # -- plumbing -------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise trio.ClosedResourceError("the state store is closed")

        def run() -> T:
            if self._closed:  # (queued behind aclose: its connection is gone)
                raise trio.ClosedResourceError("the state store is closed")
            try:
                return fn(*args)
            finally:  # (after its transaction: statistics() never sees one half-done)
                self._published = StoreStatistics(
                    records=self._records, bytes=self._bytes, expired=self._expired,
                    expired_bytes=self._expired_bytes, refused=self._refused,
                    too_many=self._too_many)

        return await trio.to_thread.run_sync(run, limiter=self._limiter)

    def _now(self) -> int:
        return int(self._clock())

    def _expires_at(self, now: int) -> int:
        return now + self._retention_s if self._retention_s > 0 else NEVER

    def _account(self, owner: str, grow: int, records: int) -> None:
        if grow or records:
            self._db.execute(
                "INSERT INTO trio_llm_owners(owner, bytes, records) VALUES (?, ?, ?) "
                "ON CONFLICT(owner) DO UPDATE SET bytes = trio_llm_owners.bytes + excluded.bytes,"
                " records = trio_llm_owners.records + excluded.records",
                (owner, grow, records))

    def _totals(self, owner: str | None = None) -> int:
        if owner is None:
            rows = self._db.execute(
                "SELECT COALESCE(SUM(bytes), 0), COALESCE(SUM(records), 0) FROM trio_llm_owners")
            self._bytes, self._records = int(rows[0][0]), int(rows[0][1])
            return self._bytes
        rows = self._db.execute("SELECT bytes FROM trio_llm_owners WHERE owner = ?", (owner,))
        return int(rows[0][0]) if rows else 0

    def _over(self, owner: str, grow: int) -> StoreFull | None:
        if self._max_bytes and self._totals() + grow > self._max_bytes:
            return StoreFull(f"the state store is full ({self._max_bytes} bytes, "
                             "--state-max-bytes)")
        if self._max_bytes_per_key and self._totals(owner) + grow > self._max_bytes_per_key:
            return StoreFull(f"this API key's stored objects would pass its quota of "
                             f"{self._max_bytes_per_key} bytes (--state-max-bytes-per-key)",
                             owner=owner)
        return None

    def _make_room(self, owner: str, grow: int, now: int, always: bool = False) -> None:
        """Raise :class:`StoreFull` unless ``grow`` more bytes of ``owner`` fit; removes the
        expired records (everyone's, oldest first: all of them) before refusing. A ``grow``
        of 0 or less always fits, unless ``always``: an owner over its bound (lowered since)
        may shrink a record, but not append events."""
        if (grow <= 0 and not always) or self._over(owner, grow) is None:
            return
        self._purge(now)
        full = self._over(owner, grow)
        if full is not None:
            self._refused += 1
            raise full

    def _purge(self, now: int, limit: int = -1) -> int:
        """Delete the records past their retention (the ``limit`` that expired first; -1:
        all), and their events: how many."""
        batch = ("SELECT seq FROM trio_llm_records WHERE expires_at <= ? "
                 "ORDER BY expires_at LIMIT ?")
        if limit < 0:
            batch, limit = "SELECT seq FROM trio_llm_records WHERE expires_at <= ?", 0
        params = (now, limit) if limit else (now,)
        groups = self._db.execute(
            "SELECT owner, COUNT(*), SUM(size + events_size) FROM trio_llm_records "
            f"WHERE seq IN ({batch}) GROUP BY owner", params)
        if not groups:
            return 0
        for table in _EVENT_TABLES:
            self._db.execute(
                f"DELETE FROM {table} WHERE (kind, owner, id) IN "
                f"(SELECT kind, owner, id FROM trio_llm_records WHERE seq IN ({batch}))", params)
        self._db.execute(f"DELETE FROM trio_llm_records WHERE seq IN ({batch})", params)
        count = 0
        for owner, records, size in groups:
            self._account(owner, -int(size), -int(records))
            count += int(records)
            self._expired_bytes += int(size)
        self._expired += count
        return count

    def _drop_events(self, key: tuple[str, str, str]) -> None:
        for table in _EVENT_TABLES:
            self._db.execute(f"DELETE FROM {table} WHERE kind = ? AND owner = ? AND id = ?", key)

    def _live(self, kind: str, owner: str, id: str, now: int, columns: str) -> tuple | None:
        rows = self._db.execute(
            f"SELECT {columns} FROM trio_llm_records WHERE kind = ? AND owner = ? AND id = ? "
            "AND expires_at > ?", (kind, owner, id, now))
        return rows[0] if rows else None

    # -- the interface --------------------------------------------------------------------

    async def put(self, record: Record, *, at_most: AtMost | None = None,
                  events: Sequence[bytes] = ()) -> None:
        await self._call(self._put, record, _dump(record.meta), at_most, list(events))

    def _put(self, record: Record, meta: str, at_most: AtMost | None,
             events: builtins.list[bytes]) -> None:
        now = self._now()
        key = (record.kind, record.owner, record.id)
        size = len(record.body) + len(meta.encode())
        with self._db.write():
            if at_most is not None:
                self._check_count(record, at_most, now)
            rows = self._db.execute(
                "SELECT size, events_size, expires_at FROM trio_llm_records "
                "WHERE kind = ? AND owner = ? AND id = ?", key)
            old = 0
            if rows and int(rows[0][2]) <= now:  # an expired one: gone, events and all
                self._drop_events(key)
                self._db.execute("DELETE FROM trio_llm_records WHERE kind = ? AND owner = ? "
                                 "AND id = ?", key)
                self._account(record.owner, -int(rows[0][0]) - int(rows[0][1]), -1)
                self._expired += 1
                self._expired_bytes += int(rows[0][0]) + int(rows[0][1])
                rows = []
            if rows:
                old = int(rows[0][0])
            else:  # a streams row of a new record's key is stale: an older server deleted it
                self._db.execute("DELETE FROM trio_llm_streams WHERE kind = ? AND owner = ? "
                                 "AND id = ?", key)
            # (its events' room too, before anything is written: a refusal commits. Checked
            # as their append would be, even where the record shrinks: else that append's
            # own check could refuse them after the record was written)
            self._make_room(record.owner, size - old + sum(map(len, events)), now,
                            always=bool(events))
            self._db.execute(
                "INSERT INTO trio_llm_records(kind, owner, id, created_at, expires_at, meta, "
                "body, size, events, events_size, status) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, 0, ?) "
                "ON CONFLICT(kind, owner, id) DO UPDATE SET created_at = excluded.created_at, "
                "expires_at = excluded.expires_at, meta = excluded.meta, body = excluded.body, "
                "size = excluded.size, status = excluded.status",
                (*key, record.created_at, self._expires_at(now), meta, record.body, size,
                 _status(record.meta)))
            self._account(record.owner, size - old, 0 if rows else 1)
            if events:  # (one transaction: never a record without its first events)
                self._add_events(record.kind, record.owner, record.id, events, now,
                                 whole=True)
            else:
                self._totals()

    def _check_count(self, record: Record, at_most: AtMost, now: int) -> None:
        """Raise :class:`TooMany` (before anything is written) when ``record``'s owner holds
        ``at_most.most`` live records of its kind in ``at_most.statuses``, besides it."""
        self._refuse_past(self._held(record.kind, record.owner, at_most.statuses, now,
                                     besides=record.id), at_most)

    def _held(self, kind: str, owner: str, statuses: tuple[str, ...], now: int, *,
              besides: str | None = None) -> int:
        """How many live records of ``kind`` ``owner`` holds in ``statuses`` (but the one
        named ``besides``): read through the ``status`` index."""
        if not statuses:
            return 0
        marks = ", ".join("?" * len(statuses))
        params: builtins.list[Any] = [kind, *statuses, owner, now]
        where = f"kind = ? AND status IN ({marks}) AND owner = ? AND expires_at > ?"
        if besides is not None:
            where += " AND id <> ?"
            params.append(besides)
        rows = self._db.execute(f"SELECT COUNT(*) FROM trio_llm_records WHERE {where}", params)
        return int(rows[0][0])

    def _refuse_past(self, held: int, at_most: AtMost) -> None:
        if at_most.statuses and held >= at_most.most:
            self._too_many += 1
            raise TooMany(held, at_most)

    async def check(self, kind: str, owner: str, at_most: AtMost) -> int:
        return await self._call(self._check, kind, owner, at_most)

    def _check(self, kind: str, owner: str, at_most: AtMost) -> int:
        held = self._held(kind, owner, tuple(at_most.statuses), self._now())
        self._refuse_past(held, at_most)
        return held

    async def get(self, kind: str, owner: str, id: str) -> Record | None:
        return await self._call(self._get, kind, owner, id)

    def _get(self, kind: str, owner: str, id: str) -> Record | None:
        row = self._live(kind, owner, id, self._now(), _COLUMNS)
        return _record(row) if row else None

    async def update(self, kind: str, owner: str, id: str, *, meta: dict | None = None,
                     body: bytes | None = None, expect_status: str | None = None,
                     expect: dict | None = None) -> bool:
        expected = dict(expect or {})
        if expect_status is not None:
            expected["status"] = expect_status
        return await self._call(self._update, kind, owner, id,
                                None if meta is None else _dump(meta),
                                None if meta is None else _status(meta), body, expected)

    def _update(self, kind: str, owner: str, id: str, meta: str | None, status: str | None,
                body: bytes | None, expected: dict) -> bool:
        now = self._now()
        with self._db.write():
            row = self._live(kind, owner, id, now, "meta, length(body), size, status")
            if row is None:
                return False
            if expected:
                old = json.loads(row[0])
                if any(old.get(key) != value for key, value in expected.items()):
                    return False
            new_meta = row[0] if meta is None else meta
            new_status = row[3] if status is None else status
            size = len(new_meta.encode()) + (int(row[1]) if body is None else len(body))
            if body is None:  # (meta alone is the server's bookkeeping: never refused)
                self._db.execute("UPDATE trio_llm_records SET meta = ?, status = ?, size = ? "
                                 "WHERE kind = ? AND owner = ? AND id = ?",
                                 (new_meta, new_status, size, kind, owner, id))
            else:
                self._make_room(owner, size - int(row[2]), now)
                self._db.execute("UPDATE trio_llm_records SET meta = ?, status = ?, body = ?, "
                                 "size = ? WHERE kind = ? AND owner = ? AND id = ?",
                                 (new_meta, new_status, body, size, kind, owner, id))
            self._account(owner, size - int(row[2]), 0)
            self._totals()
            return True

    async def delete(self, kind: str, owner: str, id: str) -> bool:
        return await self._call(self._delete, kind, owner, id)

    def _delete(self, kind: str, owner: str, id: str) -> bool:
        now = self._now()
        key = (kind, owner, id)
        with self._db.write():
            rows = self._db.execute(
                "SELECT size + events_size, expires_at FROM trio_llm_records "
                "WHERE kind = ? AND owner = ? AND id = ?", key)
            if not rows:
                return False
            self._drop_events(key)
            self._db.execute("DELETE FROM trio_llm_records WHERE kind = ? AND owner = ? "
                             "AND id = ?", key)
            self._account(owner, -int(rows[0][0]), -1)
            self._totals()
            return int(rows[0][1]) > now  # an expired one was already invisible

    async def list(self, kind: str, owner: str, *, after: str | None = None,
                   limit: int = 20, newest_first: bool = True) -> builtins.list[Record]:
        return await self._call(self._list, kind, owner, after, limit, newest_first)

    def _list(self, kind: str, owner: str, after: str | None, limit: int,
              newest_first: bool) -> builtins.list[Record]:
        now = self._now()
        where = "kind = ? AND owner = ? AND expires_at > ?"
        params: builtins.list[Any] = [kind, owner, now]
        order, past = ("DESC", "<") if newest_first else ("ASC", ">")
        if after is not None:
            cursor = self._live(kind, owner, after, now, "created_at, seq")
            if cursor is None:
                return []
            where += f" AND (created_at, seq) {past} (?, ?)"
            params += [cursor[0], cursor[1]]
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM trio_llm_records WHERE {where} "
            f"ORDER BY created_at {order}, seq {order} LIMIT ?", (*params, max(0, limit)))
        return [_record(row) for row in rows]

    async def with_status(self, kind: str, statuses: Sequence[str], *,
                          limit: int = 100) -> builtins.list[Record]:
        return await self._call(self._with_status, kind, tuple(statuses), limit)

    def _with_status(self, kind: str, statuses: tuple[str, ...],
                     limit: int) -> builtins.list[Record]:
        if not statuses or limit <= 0:
            return []
        marks = ", ".join("?" * len(statuses))
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM trio_llm_records WHERE kind = ? AND status IN ({marks}) "
            "AND expires_at > ? ORDER BY created_at, seq LIMIT ?",
            (kind, *statuses, self._now(), limit))
        return [_record(row) for row in rows]

    async def append_events(self, kind: str, owner: str, id: str, events: builtins.list[bytes]) -> int:
        return await self._call(self._append_events, kind, owner, id, list(events))

    def _append_events(self, kind: str, owner: str, id: str, events: builtins.list[bytes]) -> int:
        with self._db.write():
            return self._add_events(kind, owner, id, events, self._now())

    def _add_events(self, kind: str, owner: str, id: str, events: builtins.list[bytes],
                    now: int, *, whole: bool = False) -> int:
        """:meth:`append_events`' work, in the write transaction of its caller. ``whole``
        (a put's): the events of a record that has none go in as one row."""
        row = self._live(kind, owner, id, now, "events")
        if row is None:
            return 0
        count = int(row[0])
        if not events:
            return count
        grow = sum(len(event) for event in events)
        self._make_room(owner, grow, now)
        if whole and count == 0:
            self._db.execute("INSERT INTO trio_llm_streams(kind, owner, id, data, lengths) "
                             "VALUES (?, ?, ?, ?, ?)", (kind, owner, id, *_packed(events)))
        else:
            self._db.execute_many("INSERT INTO trio_llm_events(kind, owner, id, n, data) "
                                  "VALUES (?, ?, ?, ?, ?)",
                                  [(kind, owner, id, n, event)
                                   for n, event in enumerate(events, count)])
        self._db.execute("UPDATE trio_llm_records SET events = ?, events_size = events_size "
                         "+ ? WHERE kind = ? AND owner = ? AND id = ?",
                         (count + len(events), grow, kind, owner, id))
        self._account(owner, grow, 0)
        self._totals()
        return count + len(events)

    async def read_events(self, kind: str, owner: str, id: str, *,
                          after: int = -1) -> builtins.list[bytes]:
        return await self._call(self._read_events, kind, owner, id, after)

    def _read_events(self, kind: str, owner: str, id: str, after: int) -> builtins.list[bytes]:
        live = self._live(kind, owner, id, self._now(), "events")
        if live is None:
            return []
        key = (kind, owner, id)
        events: builtins.list[bytes] = []
        stream = self._db.execute("SELECT data, lengths FROM trio_llm_streams WHERE kind = ? "
                                  "AND owner = ? AND id = ?", key)
        if stream:
            lengths = bytes(stream[0][1])
            events = _unpacked(bytes(stream[0][0]), lengths, after)
            if len(lengths) // 4 >= int(live[0]):  # (none appended after the put's)
                return events
        rows = self._db.execute("SELECT data FROM trio_llm_events WHERE kind = ? AND owner = ? "
                                "AND id = ? AND n > ? ORDER BY n", (*key, after))
        return events + [bytes(row[0]) for row in rows]

    def statistics(self) -> StoreStatistics:
        return self._published

    async def read_statistics(self) -> StoreStatistics:
        """Read the store's totals now (on open: what earlier runs stored)."""
        await self._call(self._totals)
        return self._published

    async def sweep(self, batch: int = SWEEP_BATCH) -> int:
        """Delete the records past their retention now: how many (the retention service
        calls this; they were invisible already). ``batch`` records per transaction, so
        that a sweep of many holds the write lock in short turns."""
        now = self._now()
        total = 0
        while True:
            count = await self._call(self._sweep, now, batch)
            total += count
            if count < batch:
                return total

    def _sweep(self, now: int, batch: int) -> int:
        with self._db.write():
            count = self._purge(now, batch)
            self._totals()
            return count

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._db.close, limiter=self._limiter)

    async def __aenter__(self) -> SQLStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
