"""The state store's interface: :class:`Record`, :class:`StateStore`, :class:`StoreFull`,
:class:`StoreStatistics` and :func:`owner_of`. No I/O here; the backends implement it."""

from __future__ import annotations

import builtins

import hashlib
from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = ["AtMost", "Record", "StateStore", "StoreFull", "StoreStatistics", "TooMany",
           "owner_of"]


@dataclass(frozen=True, slots=True)
class Record:
    """One stored object. ``(kind, owner, id)`` names it; ``put`` of the same three replaces
    it (its events stay)."""

    kind: str  # "response", "file", "batch", ... (callers choose)
    id: str  # the caller's id ("resp_...", "file-...")
    owner: str  # owner_of(api_key); "" when the server has no API key
    created_at: int  # unix seconds
    meta: dict  # a small JSON-able dict (status, filename, purpose, bytes, ...)
    body: bytes  # the payload (a response's JSON, a file's content)


def owner_of(api_key: str | None) -> str:
    """Who owns what a request with ``api_key`` stores: the first 32 hex digits (128 bits)
    of the key's SHA-256, ``""`` for no key. Plain, not keyed: the same key is the same owner
    on every host and after every restart (frontends on several hosts share PostgreSQL), and
    the store never holds the key itself. Keys are long random secrets, so a digest prefix
    read out of the database does not give one back."""
    if api_key is None:
        return ""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


class StoreFull(Exception):
    """A write would take the store past its size budget (``owner is None``: the overall
    ``--state-max-bytes``) or an owner past its quota (``--state-max-bytes-per-key``:
    ``owner`` is that owner). Callers answer 507 (overall) or 413 (the owner's quota)."""

    def __init__(self, message: str, *, owner: str | None = None) -> None:
        super().__init__(message)
        self.owner = owner
        self.message = message


@dataclass(frozen=True, slots=True)
class AtMost:
    """A bound on a ``put`` of a new record: the owner may hold at most ``most`` live records
    of its kind whose status is one of ``statuses`` (the new one included). Checked in the
    put's own write transaction, which holds the store's write lock: exact across every
    frontend of the store, however many put at once (``--max-batches-per-key``)."""

    most: int
    statuses: tuple[str, ...]


class TooMany(Exception):
    """A ``put`` refused by its :class:`AtMost`: the owner holds ``held`` such records
    already (nothing was stored). Callers answer 429."""

    def __init__(self, held: int, bound: AtMost) -> None:
        super().__init__(f"{held} records in {bound.statuses}, at most {bound.most}")
        self.held = held
        self.bound = bound


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """What this store instance saw: ``records`` and ``bytes`` as of its last write or sweep
    (the whole store's, every frontend's), and what this instance removed: records past
    their retention (``expired``, with their bytes: by the sweep, or to make room) and the
    writes refused with :class:`StoreFull`."""

    records: int = 0
    bytes: int = 0
    expired: int = 0
    expired_bytes: int = 0
    refused: int = 0  # writes refused with StoreFull
    too_many: int = 0  # puts and checks refused with TooMany (--max-batches-per-key)


class StateStore(Protocol):
    """Every method is a checkpoint and does its blocking I/O off the event loop. A record
    past its retention is invisible at once (as if deleted), and one of another owner too:
    callers answer 404 either way (no existence oracle)."""

    async def put(self, record: Record, *, at_most: AtMost | None = None,
                  events: Sequence[bytes] = ()) -> None:
        """Insert or replace ``record`` (its events, if any, stay), and append ``events`` to
        its events, all or nothing (one operation: a finished response and its stream).
        Raises :class:`StoreFull`, or :class:`TooMany` when the owner's records already
        fill ``at_most``."""
        ...

    async def get(self, kind: str, owner: str, id: str) -> Record | None:
        """The record, or None when missing, expired, or another owner's."""
        ...

    async def update(self, kind: str, owner: str, id: str, *, meta: dict | None = None,
                     body: bytes | None = None, expect_status: str | None = None,
                     expect: dict | None = None) -> bool:
        """Replace meta and/or body; False when missing, or when ``expect_status`` is given
        and ``meta["status"]`` differs, or ``expect`` is and a key's value in meta differs
        (a missing key is None): compare-and-set, for cancel/finish races and leases.
        An update of ``meta`` alone is never refused for room, though its bytes count. It
        is the server's bookkeeping of a stored record (status, lease, counts, errors). A
        batch refused for its key's quota must still be able to say so."""
        ...

    async def delete(self, kind: str, owner: str, id: str) -> bool:
        """Delete the record and its events; False when there was none to delete."""
        ...

    async def list(self, kind: str, owner: str, *, after: str | None = None,
                   limit: int = 20, newest_first: bool = True) -> builtins.list[Record]:
        """Up to ``limit`` records of ``owner``, in creation order (newest first unless told),
        those past the record ``after`` (an id) when given: [] if ``after`` names no visible
        record."""
        ...

    async def with_status(self, kind: str, statuses: Sequence[str], *,
                          limit: int = 100) -> builtins.list[Record]:
        """Up to ``limit`` live records of ``kind`` whose ``meta["status"]`` is one of
        ``statuses``, every owner's, oldest first: for a runner that claims work, or a sweep
        that finds what a stopped server left running (a lease in meta that expired)."""
        ...

    async def check(self, kind: str, owner: str, at_most: AtMost) -> int:
        """How many live records of ``kind`` ``owner`` holds whose status is one of
        ``at_most.statuses``; raises :class:`TooMany` (counted as a put's) when they already
        fill ``at_most``. A read, without the write lock: a cheap refusal before costly work
        (a batch's input file read and parsed), which a concurrent write can race, so the
        ``put`` with the same bound stays the authority."""
        ...

    async def append_events(self, kind: str, owner: str, id: str, events: builtins.list[bytes]) -> int:
        """Append events to the record's (numbered 0..n-1 in order); the new count, or 0
        when the record is missing (nothing stored). Raises :class:`StoreFull`."""
        ...

    async def read_events(self, kind: str, owner: str, id: str, *,
                          after: int = -1) -> builtins.list[bytes]:
        """The record's events numbered > ``after``, in order; [] when missing."""
        ...

    def statistics(self) -> StoreStatistics:
        """Counts for /metrics (no I/O)."""
        ...

    async def aclose(self) -> None:
        """Close the connection (waits for the operation in flight)."""
        ...
