"""The store's tables, written once for both backends (``{blob}`` and ``{serial}`` are each
backend's spelling of a byte string and of an auto-numbered key)."""

from __future__ import annotations

__all__ = ["statements"]

_SCHEMA = (
    # seq: the order of first insertion (list's tie-break between equal created_at)
    "CREATE TABLE IF NOT EXISTS trio_llm_records ("
    " seq {serial}, kind TEXT NOT NULL, owner TEXT NOT NULL, id TEXT NOT NULL,"
    " created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, meta TEXT NOT NULL,"
    " body {blob} NOT NULL, size BIGINT NOT NULL, events BIGINT NOT NULL,"
    " events_size BIGINT NOT NULL, status TEXT NOT NULL, UNIQUE (kind, owner, id))",
    "CREATE INDEX IF NOT EXISTS trio_llm_records_list"
    " ON trio_llm_records (kind, owner, created_at, seq)",
    "CREATE INDEX IF NOT EXISTS trio_llm_records_expiry ON trio_llm_records (expires_at)",
    # (status: meta's "status", for with_status: work a runner claims, every owner's)
    "CREATE INDEX IF NOT EXISTS trio_llm_records_status"
    " ON trio_llm_records (kind, status, created_at, seq)",
    "CREATE TABLE IF NOT EXISTS trio_llm_events ("
    " kind TEXT NOT NULL, owner TEXT NOT NULL, id TEXT NOT NULL, n BIGINT NOT NULL,"
    " data {blob} NOT NULL, PRIMARY KEY (kind, owner, id, n))",
    # (the events a put stored with its record, as one row: their bytes end to end and
    # their lengths, 4 bytes each, little-endian; numbered 0..k-1, before any in trio_llm_events.
    # Added later: a store made before it has its events in trio_llm_events alone)
    "CREATE TABLE IF NOT EXISTS trio_llm_streams ("
    " kind TEXT NOT NULL, owner TEXT NOT NULL, id TEXT NOT NULL, data {blob} NOT NULL,"
    " lengths {blob} NOT NULL, PRIMARY KEY (kind, owner, id))",
    "CREATE TABLE IF NOT EXISTS trio_llm_owners ("
    " owner TEXT PRIMARY KEY, bytes BIGINT NOT NULL, records BIGINT NOT NULL)",
)


def statements(*, blob: str, serial: str) -> list[str]:
    """The ``CREATE ... IF NOT EXISTS`` statements, in order."""
    return [s.format(blob=blob, serial=serial) for s in _SCHEMA]
