"""State that outlives a request: stored responses, files, batches (issue 44).

Theory of operation
-------------------
One small interface, :class:`StateStore` (:mod:`.records`), names every stored object by
``(kind, owner, id)``: callers choose the kind (``"response"``, ``"file"``, ...) and the id,
and the owner is :func:`owner_of` the request's API key (``""`` without keys). Every read
takes the owner, so another key's object is simply not there (callers answer 404, never
403: no existence oracle). A record carries a small JSON ``meta`` (its status, for the
compare-and-set of :meth:`~StateStore.update`), a ``body`` and, beside it, an append-only
list of events (a response's stream, replayed from any point).

Two backends run the same SQL (:mod:`.sql`, :mod:`.schema`), each over one blocking
connection used by one worker thread at a time, off the event loop:

- SQLite (:mod:`.sqlite`, the default): ``--state-dir DIR`` holds ``state.sqlite3`` in WAL
  mode. Every ``--api-servers`` frontend of a host opens the same file (the supervisor gives
  them the same directory) and sees the others' writes at once; a server restarted on the
  same directory finds everything it stored.
- PostgreSQL (:mod:`.postgres`): ``--state-url postgresql://...`` for frontends on several
  hosts (psycopg 3, the ``state-postgres`` extra).

Bounded (:mod:`.retention`): a record is visible for ``--state-retention`` after it was
stored (30 days by default, as OpenAI keeps responses); past that it is invisible at once
and a background sweep deletes it. ``--state-max-bytes`` bounds the whole store and
``--state-max-bytes-per-key`` each owner: a write that would pass a bound first removes every
expired record, and if it still does not fit it is refused with :class:`StoreFull` (with
``.owner`` set for an owner's quota). An update of a record's meta alone (its status,
lease, counts) is never refused, so that a record can always record its end. A put may
also bound how many records its owner holds in some statuses (:class:`AtMost`:
``--max-batches-per-key``), refused with :class:`TooMany`.
Nothing live is ever evicted to make room: a client's stored objects stay until they expire
or it deletes them. What the sweeps and the room-making remove, and what is refused, is
counted (:meth:`StateStore.statistics`, in ``/metrics``).
"""

from .opening import DEFAULT_RETENTION_S, StateConfig, StateStoreError, open_state_store
from .records import AtMost, Record, StateStore, StoreFull, StoreStatistics, TooMany, owner_of

__all__ = [
    "AtMost",
    "DEFAULT_RETENTION_S",
    "Record",
    "StateConfig",
    "StateStore",
    "StateStoreError",
    "StoreFull",
    "StoreStatistics",
    "TooMany",
    "open_state_store",
    "owner_of",
]
