"""The state store (server/state), on both backends: SQLite in a temporary directory, and a
real PostgreSQL server these tests start themselves (tests/postgres_server.py; skipped with
the reason when PostgreSQL or psycopg is absent). Time is a clock the tests move, so expiry
is exact, not timed."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import replace

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.cli import build_parser, config_from_args
from server.config import ServerConfig
from server.http.app import create_app
from server.http.serve import serve
from server.observability.state_metrics import StateStoreCollector
from server.private_dir import PREFIX
from server.state import (
    AtMost,
    Record,
    StateConfig,
    StateStoreError,
    StoreFull,
    TooMany,
    open_state_store,
    owner_of,
)
from server.state.service import default_directory, run_state_store, state_config
from tests.conftest import running_server
from tests.postgres_server import state_database

#: Hang guard for one test (a real database server; CI's machine is busy).
TIMEOUT_S = 120



class Clock:
    """Unix seconds the test sets."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgres"])
def location(request, tmp_path) -> StateConfig:
    """Where one test's store lives: a new SQLite directory, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return StateConfig(directory=str(tmp_path / "state"))
    return StateConfig(url=request.getfixturevalue("postgres_server").new_database())


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def open_store(location, clock):
    """``await open_store(**bounds)``: a store at this test's location (several may be open
    at once: several frontends), closed after the test."""
    opened = []

    async def open_(**bounds):
        config = StateConfig(directory=location.directory, url=location.url, **bounds)
        with trio.fail_after(TIMEOUT_S):
            store = await open_state_store(config, clock=clock)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.aclose()


def rec(id: str, owner: str = "alice", *, kind: str = "response", created_at: int = 1,
        status: str = "queued", body: bytes = b"{}") -> Record:
    return Record(kind=kind, id=id, owner=owner, created_at=created_at,
                  meta={"status": status}, body=body)


async def test_put_get_and_replace(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        assert await store.get("response", "alice", "r1") is None
        record = Record(kind="response", id="r1", owner="alice", created_at=7,
                        meta={"status": "queued", "n": [1, "é"]}, body=b"\x00\xffbody")
        await store.put(record)
        assert await store.get("response", "alice", "r1") == record
        assert await store.get("file", "alice", "r1") is None  # kinds are separate
        await store.append_events("response", "alice", "r1", [b"e0"])
        replaced = rec("r1", status="completed", body=b"new")
        await store.put(replaced)
        assert await store.get("response", "alice", "r1") == replaced
        assert await store.read_events("response", "alice", "r1") == [b"e0"]  # events stay
        assert store.statistics().records == 1


async def test_another_owner_sees_nothing(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        await store.put(rec("r1", "alice"))
        await store.append_events("response", "alice", "r1", [b"e0"])
        assert await store.get("response", "bob", "r1") is None
        assert await store.list("response", "bob") == []
        assert not await store.update("response", "bob", "r1", meta={"status": "cancelled"})
        assert await store.read_events("response", "bob", "r1") == []
        assert await store.append_events("response", "bob", "r1", [b"x"]) == 0
        assert not await store.delete("response", "bob", "r1")
        assert (await store.get("response", "alice", "r1")).meta == {"status": "queued"}
        assert await store.read_events("response", "alice", "r1") == [b"e0"]


async def test_update_compare_and_set(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        await store.put(rec("r1", body=b"old"))
        assert not await store.update("response", "alice", "r1", meta={"status": "completed"},
                                      expect_status="in_progress")
        assert (await store.get("response", "alice", "r1")).meta["status"] == "queued"
        assert await store.update("response", "alice", "r1", meta={"status": "cancelled"},
                                  expect_status="queued")
        got = await store.get("response", "alice", "r1")
        assert (got.meta, got.body) == ({"status": "cancelled"}, b"old")
        assert await store.update("response", "alice", "r1", body=b"newer")
        got = await store.get("response", "alice", "r1")
        assert (got.meta, got.body) == ({"status": "cancelled"}, b"newer")
        assert not await store.update("response", "alice", "missing", meta={})


async def test_update_compare_and_set_on_meta_keys(open_store):
    # A lease: only the holder that read it (holder and expiry unchanged since) takes it.
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        lease = {"status": "in_progress", "holder": "a", "lease_until": 10}
        await store.put(Record(kind="batch", id="b1", owner="alice", created_at=1,
                               meta=lease, body=b""))
        taken = {**lease, "holder": "b", "lease_until": 20}
        assert await store.update("batch", "alice", "b1", meta=taken, expect=lease)
        late = {**lease, "holder": "c", "lease_until": 20}
        assert not await store.update("batch", "alice", "b1", meta=late, expect=lease)
        assert (await store.get("batch", "alice", "b1")).meta == taken
        assert not await store.update("batch", "alice", "b1", meta={"status": "done"},
                                      expect={"missing": 1})
        assert await store.update("batch", "alice", "b1", meta={"status": "done"},
                                  expect={"missing": None, "holder": "b"},
                                  expect_status="in_progress")
        assert (await store.get("batch", "alice", "b1")).meta == {"status": "done"}


async def test_with_status_finds_every_owners_records(open_store, clock):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(retention_s=100)
        await store.put(rec("r3", "bob", created_at=3, status="in_progress"))
        await store.put(rec("r1", "alice", created_at=1, status="queued"))
        await store.put(rec("r2", "alice", created_at=2, status="completed"))
        await store.put(rec("f1", "alice", kind="file", created_at=1, status="queued"))
        await store.put(Record(kind="response", id="r4", owner="carol", created_at=4,
                               meta={"status": 5}, body=b""))  # (not a string: no status)

        async def ids(*statuses, limit=100):
            found = await store.with_status("response", statuses, limit=limit)
            return [(r.owner, r.id) for r in found]

        assert await ids("queued", "in_progress") == [("alice", "r1"), ("bob", "r3")]
        assert await ids("queued", "in_progress", limit=1) == [("alice", "r1")]
        assert await ids("completed") == [("alice", "r2")]
        assert await ids() == []
        # the status follows meta through update (and put)
        await store.update("response", "alice", "r1", meta={"status": "completed"})
        await store.update("response", "alice", "r2", body=b"x")  # (meta kept: its status too)
        assert await ids("completed") == [("alice", "r1"), ("alice", "r2")]
        await store.put(rec("r3", "bob", created_at=3, status="failed"))
        assert await ids("queued", "in_progress") == []
        clock.now += 100  # expired: not found
        assert await ids("completed", "failed") == []


async def test_delete_takes_the_events(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        await store.put(rec("r1"))
        await store.append_events("response", "alice", "r1", [b"a", b"b"])
        assert await store.delete("response", "alice", "r1")
        assert not await store.delete("response", "alice", "r1")
        assert await store.get("response", "alice", "r1") is None
        await store.put(rec("r1"))
        assert await store.read_events("response", "alice", "r1") == []
        assert await store.append_events("response", "alice", "r1", [b"c"]) == 1
        assert store.statistics().records == 1


async def test_list_pages(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        # equal created_at for r2/r3: insertion order breaks the tie
        for id, created in [("r1", 1), ("r2", 2), ("r3", 2), ("r4", 3), ("r5", 4)]:
            await store.put(rec(id, created_at=created))
        await store.put(rec("f1", kind="file", created_at=9))
        await store.put(rec("b1", owner="bob", created_at=9))

        async def ids(**kw):
            return [r.id for r in await store.list("response", "alice", **kw)]

        assert await ids() == ["r5", "r4", "r3", "r2", "r1"]
        assert await ids(limit=2) == ["r5", "r4"]
        assert await ids(limit=2, after="r4") == ["r3", "r2"]
        assert await ids(limit=2, after="r2") == ["r1"]
        assert await ids(after="r1") == []
        assert await ids(newest_first=False, limit=3) == ["r1", "r2", "r3"]
        assert await ids(newest_first=False, after="r3") == ["r4", "r5"]
        assert await ids(after="nope") == []


async def test_events_numbered_in_order(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        assert await store.append_events("response", "alice", "r1", [b"x"]) == 0  # no record
        await store.put(rec("r1"))
        assert await store.read_events("response", "alice", "r1") == []
        assert await store.append_events("response", "alice", "r1", [b"e0", b"e1"]) == 2
        assert await store.append_events("response", "alice", "r1", []) == 2
        assert await store.append_events("response", "alice", "r1", [b"e2"]) == 3
        assert await store.read_events("response", "alice", "r1") == [b"e0", b"e1", b"e2"]
        assert await store.read_events("response", "alice", "r1", after=0) == [b"e1", b"e2"]
        assert await store.read_events("response", "alice", "r1", after=2) == []


async def test_expired_records_are_invisible_then_swept(open_store, clock):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(retention_s=100)
        await store.put(rec("old", body=b"x" * 50))
        await store.append_events("response", "alice", "old", [b"e" * 10])
        clock.now += 50
        await store.put(rec("young"))
        await store.append_events("response", "alice", "young", [b"y"])
        before = store.statistics().bytes
        clock.now += 60  # "old" is 110 s old, "young" 60 s
        assert await store.get("response", "alice", "old") is None
        assert await store.read_events("response", "alice", "old") == []
        assert [r.id for r in await store.list("response", "alice")] == ["young"]
        assert not await store.update("response", "alice", "old", meta={})
        assert await store.sweep() == 1
        assert await store.sweep() == 0
        stats = store.statistics()
        assert (stats.records, stats.expired) == (1, 1)
        assert stats.expired_bytes == before - stats.bytes > 60
        assert await store.get("response", "alice", "young") is not None
        clock.now += 100
        await store.put(rec("young"))  # past its retention: a new object, without events
        assert await store.read_events("response", "alice", "young") == []
        assert store.statistics().expired == 2


async def test_a_sweep_deletes_in_batches(open_store, clock):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(retention_s=10)
        for n in range(5):
            await store.put(rec(f"r{n}", owner=f"o{n % 2}"))
            await store.append_events("response", f"o{n % 2}", f"r{n}", [b"e"])
        await store.put(rec("kept", created_at=2))
        clock.now += 5
        await store.put(rec("kept"))  # (stored again: from now)
        clock.now += 6
        assert await store.sweep(batch=2) == 5
        stats = store.statistics()
        assert (stats.records, stats.expired) == (1, 5)
        assert await store.get("response", "alice", "kept") is not None


async def test_no_retention_keeps_records(open_store, clock):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(retention_s=0)
        await store.put(rec("r1"))
        clock.now += 10 * 365 * 86400
        assert await store.get("response", "alice", "r1") is not None
        assert await store.sweep() == 0


async def test_budget_removes_expired_then_refuses(open_store, clock):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(retention_s=100, max_bytes=1000)
        await store.put(rec("a", body=b"x" * 600))
        clock.now += 90
        await store.put(rec("b", owner="bob", body=b"x" * 300))
        with pytest.raises(StoreFull) as full:
            await store.put(rec("c", body=b"x" * 300))
        assert full.value.owner is None
        with pytest.raises(StoreFull):
            await store.append_events("response", "bob", "b", [b"x" * 300])
        assert store.statistics().refused == 2
        assert await store.get("response", "alice", "c") is None
        clock.now += 20  # "a" expired: removed to make room
        await store.put(rec("c", body=b"x" * 300))
        stats = store.statistics()
        assert (stats.records, stats.expired) == (2, 1)
        assert stats.bytes <= 1000
        # what /metrics shows of it (the collector the app registers: the live test below)
        registry = CollectorRegistry()
        registry.register(StateStoreCollector(store.statistics, "sim"))
        shown = {s.name: s.value for family in text_string_to_metric_families(
            generate_latest(registry).decode()) for s in family.samples}
        assert (shown["trio_llm:state_expired_records_total"],
                shown["trio_llm:state_expired_bytes_total"],
                shown["trio_llm:state_refused_writes_total"]) == (1, stats.expired_bytes, 2)
        assert stats.expired_bytes > 600


async def test_a_record_put_with_its_events_is_kept_whole_or_not_at_all(open_store):
    """A finished response and its stream in one put: over the owner's quota, neither is
    kept (the record alone would fit); within it, both, the events numbered after any
    the record had."""
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(max_bytes_per_key=500)
        with pytest.raises(StoreFull):
            await store.put(rec("r1", body=b"x" * 100), events=[b"e" * 300, b"e" * 200])
        assert await store.get("response", "alice", "r1") is None
        assert store.statistics().bytes == 0
        await store.put(rec("r1", body=b"x" * 100), events=[b"e0", b"e1"])
        assert await store.append_events("response", "alice", "r1", [b"e2"]) == 3
        await store.put(rec("r1", status="completed", body=b"x" * 100), events=[b"e3"])
        assert await store.read_events("response", "alice", "r1") == [b"e0", b"e1", b"e2", b"e3"]
        assert (await store.get("response", "alice", "r1")).meta["status"] == "completed"


async def test_events_put_with_a_shrunk_record_over_a_lowered_quota_keep_neither(open_store):
    """An owner over its quota (lowered since it stored) puts a smaller record with events:
    refused as their append would be, and the record stays as it was (not written without
    its events)."""
    with trio.fail_after(TIMEOUT_S):
        roomy = await open_store()
        await roomy.put(rec("r1", body=b"x" * 400))
        await roomy.put(rec("r2", body=b"x" * 400))
        store = await open_store(max_bytes_per_key=500)
        with pytest.raises(StoreFull):
            await store.put(rec("r1", status="completed", body=b"x" * 100), events=[b"e" * 10])
        kept = await store.get("response", "alice", "r1")
        assert kept is not None and kept.body == b"x" * 400 and kept.meta["status"] == "queued"
        assert await store.read_events("response", "alice", "r1") == []


async def test_events_of_a_store_made_before_streams_are_read(open_store, location, clock):
    """A store written before trio_llm_streams existed keeps each event as a row: the new
    code reads them, appends after them, deletes and expires them, beside records whose
    put kept their events as one row."""
    old_events = [b"event %d\n\n" % n for n in range(5)]
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(retention_s=100)
        await store.put(rec("old"))  # (what an older put(events=...) wrote: a row each)
        assert await store.append_events("response", "alice", "old", old_events) == 5
        await store.put(rec("gone"))
        await store.append_events("response", "alice", "gone", [b"g"])
        await store.aclose()

        def drop_streams() -> None:
            db = state_database(location.directory, location.url)
            try:
                with db.write():
                    db.execute("DROP TABLE trio_llm_streams")
            finally:
                db.close()

        await trio.to_thread.run_sync(drop_streams)
        store = await open_store(retention_s=100)
        assert await store.read_events("response", "alice", "old") == old_events
        assert await store.read_events("response", "alice", "old", after=2) == old_events[3:]
        assert await store.read_events("response", "alice", "old", after=4) == []
        await store.put(rec("old", status="completed"), events=[b"more"])
        assert await store.read_events("response", "alice", "old", after=3) == [
            old_events[4], b"more"]
        assert await store.delete("response", "alice", "gone")
        new_events = [b"new %d" % n for n in range(4)]
        await store.put(rec("new", status="completed"), events=new_events)
        assert await store.read_events("response", "alice", "new") == new_events
        assert await store.read_events("response", "alice", "new", after=1) == new_events[2:]
        assert await store.append_events("response", "alice", "new", [b"late"]) == 5
        assert await store.read_events("response", "alice", "new", after=2) == [
            new_events[3], b"late"]
        sizes = sum(map(len, old_events + [b"more"] + new_events + [b"late"]))
        records = 2 * (2 + len(b'{"status":"completed"}'))
        assert store.statistics().bytes == sizes + records
        assert await store.delete("response", "alice", "new")
        await store.put(rec("new"), events=[b"again"])  # (its old events all gone)
        assert await store.read_events("response", "alice", "new") == [b"again"]
        clock.now += 200
        assert await store.sweep() == 2
        assert store.statistics().bytes == 0
        await store.put(rec("new"), events=[b"third"])
        await store.put(rec("old"), events=[b"fourth"])
        assert await store.read_events("response", "alice", "new") == [b"third"]
        assert await store.read_events("response", "alice", "old") == [b"fourth"]


async def test_a_streams_row_an_older_server_left_does_not_block_a_put(open_store, location):
    """A server from before trio_llm_streams, sharing the store during an upgrade, deletes
    a record and leaves its row there (it knows only trio_llm_events): a later put of that
    id, a new record, drops the row first. With events, the put does not fail on the row's
    key; without, the record reads only the events appended to it."""
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        await store.put(rec("r1"), events=[b"first\n\n"])

        def delete_as_an_older_server() -> None:
            db = state_database(location.directory, location.url)
            try:
                with db.write():
                    for table in ("trio_llm_events", "trio_llm_records"):
                        db.execute(f"DELETE FROM {table} WHERE id = ?", ("r1",))
            finally:
                db.close()

        await trio.to_thread.run_sync(delete_as_an_older_server)
        await store.put(rec("r1"), events=[b"again\n\n", b"more\n\n"])
        assert await store.read_events("response", "alice", "r1") == [
            b"again\n\n", b"more\n\n"]
        await trio.to_thread.run_sync(delete_as_an_older_server)
        await store.put(rec("r1"))  # (no events: a background response's first put)
        assert await store.read_events("response", "alice", "r1") == []
        await store.append_events("response", "alice", "r1", [b"its own\n\n"])
        assert await store.read_events("response", "alice", "r1") == [b"its own\n\n"]


async def test_quota_per_owner(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(max_bytes_per_key=500)
        await store.put(rec("a1", "alice", body=b"x" * 400))
        with pytest.raises(StoreFull) as full:
            await store.put(rec("a2", "alice", body=b"x" * 200))
        assert full.value.owner == "alice"
        with pytest.raises(StoreFull):
            await store.update("response", "alice", "a1", body=b"x" * 600)
        await store.put(rec("b1", "bob", body=b"x" * 400))  # bob's own quota
        await store.put(rec("a1", "alice", body=b"x" * 450))  # a replacement counts once
        assert await store.delete("response", "alice", "a1")
        await store.put(rec("a2", "alice", body=b"x" * 450))


async def test_an_update_of_meta_alone_is_never_refused(open_store):
    """A record's meta is the server's bookkeeping (a batch's status and errors): an owner
    at its quota can still record that its batch failed there. The bytes count."""
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(max_bytes_per_key=500)
        await store.put(rec("a1", "alice", body=b"x" * 470))
        failed = {"status": "failed", "errors": "storage_full " * 10}
        assert await store.update("response", "alice", "a1", meta=failed)
        assert (await store.get("response", "alice", "a1")).meta == failed
        assert store.statistics().bytes == 470 + len(json.dumps(failed, separators=(",", ":")))
        with pytest.raises(StoreFull):  # (a body is the client's: still refused)
            await store.update("response", "alice", "a1", body=b"x" * 471)


async def test_two_frontends_share_the_store(open_store):
    with trio.fail_after(TIMEOUT_S):
        first, second = await open_store(), await open_store()
        await first.put(rec("r1"))
        assert await second.get("response", "alice", "r1") == rec("r1")
        assert await second.update("response", "alice", "r1", meta={"status": "done"},
                                   expect_status="queued")
        assert not await first.update("response", "alice", "r1", meta={"status": "cancelled"},
                                      expect_status="queued")
        assert await second.append_events("response", "alice", "r1", [b"e0"]) == 1
        assert await first.append_events("response", "alice", "r1", [b"e1"]) == 2
        assert await first.read_events("response", "alice", "r1") == [b"e0", b"e1"]


async def test_budget_holds_under_concurrent_frontends(open_store):
    with trio.fail_after(TIMEOUT_S):
        stores = [await open_store(max_bytes=2000), await open_store(max_bytes=2000)]
        refused = 0

        async def put(store, n):
            nonlocal refused
            try:
                await store.put(rec(f"r{n}", body=b"x" * 190))  # 190 + meta: ~210 bytes
            except StoreFull:
                refused += 1

        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(put, stores[n % 2], n)
        stored = len(await stores[0].list("response", "alice", limit=100))
        assert stored + refused == 20
        assert 0 < stored < 10
        await stores[0].sweep()  # reads the totals
        assert stores[0].statistics().bytes <= 2000


async def test_at_most_bounds_an_owners_records_in_some_statuses(open_store, clock):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store(retention_s=60)
        bound = AtMost(2, ("queued", "running"))
        await store.put(rec("a1", status="queued"), at_most=bound)
        await store.put(rec("a2", status="running"), at_most=bound)
        await store.put(rec("a1", status="queued"), at_most=bound)  # (itself: not counted)
        with pytest.raises(TooMany) as refused:
            await store.put(rec("a3"), at_most=bound)
        assert refused.value.held == 2 and store.statistics().too_many == 1
        assert await store.get("response", "alice", "a3") is None  # (nothing stored)
        await store.put(rec("b1", "bob"), at_most=bound)  # (bob's own count)
        await store.put(rec("a0", kind="file"), at_most=bound)  # (another kind's)
        await store.update("response", "alice", "a1", meta={"status": "done"})
        await store.put(rec("a3"), at_most=bound)  # (a1 ended)
        clock.now += 61  # (every one expired: none counts)
        await store.put(rec("a4"), at_most=AtMost(1, ("queued",)))


async def test_check_counts_an_owners_live_records_in_some_statuses(open_store, clock):
    """check: the owner's live records of the kind in the statuses, every frontend's; a
    TooMany at the bound, counted as a put's, that stores and changes nothing."""
    with trio.fail_after(TIMEOUT_S):
        store, other = await open_store(retention_s=60), await open_store(retention_s=60)
        running = AtMost(3, ("queued", "running"))
        assert await store.check("response", "alice", running) == 0
        await store.put(rec("a1", status="queued"))
        await other.put(rec("a2", status="running"))  # (another frontend's write)
        await store.put(rec("a3", status="done"))  # (another status)
        await store.put(rec("a4", kind="file", status="queued"))  # (another kind)
        await store.put(rec("b1", "bob", status="queued"))  # (another owner)
        assert await store.check("response", "alice", running) == 2
        assert await other.check("response", "bob", running) == 1
        assert await store.check("response", "alice", AtMost(3, ("done",))) == 1
        assert await store.check("response", "alice", AtMost(3, ())) == 0
        with pytest.raises(TooMany) as refused:
            await store.check("response", "alice", AtMost(2, ("queued", "running")))
        assert refused.value.held == 2 and store.statistics().too_many == 1
        assert (await store.get("response", "alice", "a1")).meta == {"status": "queued"}
        await store.update("response", "alice", "a1", meta={"status": "done"})
        assert await store.check("response", "alice", AtMost(2, ("queued", "running"))) == 1
        clock.now += 61  # (expired: none counts)
        assert await store.check("response", "alice", AtMost(1, ("running", "done"))) == 0
        assert store.statistics().too_many == 1


async def test_at_most_holds_exactly_under_concurrent_frontends(open_store):
    """Twenty puts at once on two stores (two frontends), at most 3: exactly 3 stored."""
    with trio.fail_after(TIMEOUT_S):
        stores = [await open_store(), await open_store()]
        refused = 0

        async def put(store, n):
            nonlocal refused
            try:
                await store.put(rec(f"r{n}"), at_most=AtMost(3, ("queued",)))
            except TooMany:
                refused += 1

        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(put, stores[n % 2], n)
        assert len(await stores[0].list("response", "alice", limit=100)) == 3
        assert refused == 17
        assert sum(s.statistics().too_many for s in stores) == 17


async def test_reopened_store_keeps_its_records(open_store):
    with trio.fail_after(TIMEOUT_S):
        store = await open_store()
        await store.put(rec("r1", body=b"kept"))
        await store.append_events("response", "alice", "r1", [b"e0"])
        await store.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await store.get("response", "alice", "r1")
        again = await open_store()
        assert again.statistics().records == 1
        assert (await again.get("response", "alice", "r1")).body == b"kept"
        assert await again.read_events("response", "alice", "r1") == [b"e0"]


def test_owner_of():
    assert owner_of(None) == ""
    assert owner_of("sk-one") == owner_of("sk-one")
    assert owner_of("sk-one") != owner_of("sk-two")
    assert len(owner_of("sk-one")) == 32 and "sk-one" not in owner_of("sk-one")


async def test_the_service_sweeps_and_closes(location, clock):
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            config = StateConfig(directory=location.directory, url=location.url,
                                 retention_s=100)
            store = await nursery.start(
                functools.partial(run_state_store, config, sweep_interval=0.01, clock=clock))
            await store.put(rec("r1"))
            await store.put(rec("r2"))
            clock.now += 101
            while store.statistics().expired < 2:  # (the sweeps' count)
                await trio.sleep(0.01)
            assert store.statistics().records == 0
            nursery.cancel_scope.cancel()
        with pytest.raises(trio.ClosedResourceError):
            await store.get("response", "alice", "r1")


async def test_the_default_store_is_temporary():
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            store = await nursery.start(run_state_store, StateConfig())
            await store.put(rec("r1"))
            directory = os.path.dirname(store._db.path)  # (SQLite's file's)
            assert exists(directory)
            assert os.path.basename(os.path.dirname(directory)).startswith(PREFIX)
            nursery.cancel_scope.cancel()
        assert not exists(directory)


async def test_postgres_connection_lost_is_made_again(postgres_server, tmp_path, clock):
    import psycopg

    with trio.fail_after(TIMEOUT_S):
        async with await open_state_store(StateConfig(url=postgres_server.new_database()),
                                          clock=clock) as store:
            await store.put(rec("r1"))
            await trio.to_thread.run_sync(postgres_server.restart)
            with pytest.raises(psycopg.OperationalError):  # the one that finds it broken
                await store.get("response", "alice", "r1")
            assert await store.get("response", "alice", "r1") == rec("r1")


def exists(path: str) -> bool:
    return os.path.exists(path)


def test_frontends_share_their_supervisors_directory(tmp_path):
    assert default_directory(str(tmp_path)) == str(tmp_path / "state")
    assert default_directory(None) is None


async def test_the_app_holds_its_store_while_it_serves(tmp_path):
    directory = str(tmp_path / "state")
    with trio.fail_after(TIMEOUT_S):
        async with running_server(state_dir=directory) as url:
            app = url.app
            await app.state_store.put(rec("r1"))
            async with httpx.AsyncClient() as client:
                metrics = (await client.get(url + "/metrics")).text
            assert 'trio_llm:state_records{model_name="sim"} 1.0' in metrics
        assert app.state_store is None  # closed with the server
        async with await open_state_store(StateConfig(directory=directory)) as store:
            assert await store.get("response", "alice", "r1") == rec("r1")  # and kept


async def test_no_state_store_keeps_nothing(tmp_path):
    with pytest.raises(SystemExit, match="--state-dir: not with --no-state-store"):
        config_from_args(build_parser().parse_args(
            ["--no-state-store", "--state-dir", str(tmp_path)]))
    assert not config_from_args(build_parser().parse_args(["--no-state-store"])).state_store
    with trio.fail_after(TIMEOUT_S):
        async with running_server(state_store=False) as url:
            assert url.app.state_store is None
            async with httpx.AsyncClient() as client:
                body = {"model": "sim", "input": "a"}
                r = await client.post(url + "/v1/responses", json=body)
                assert r.status_code == 200 and r.json()["store"] is False, r.text
                r = await client.post(url + "/v1/responses", json={**body, "store": True})
                assert r.status_code == 400 and r.json()["error"]["param"] == "store", r.text


async def test_a_store_that_cannot_open_stops_the_server(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    config = ServerConfig(port=0, state_dir=str(blocked / "state"), shutdown_timeout=0)
    app = create_app(config)
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(StateStoreError, match="cannot open the state store at sqlite:"):
            try:
                await serve(config, app=app)
            except BaseExceptionGroup as group:  # (as the CLI does: a leaf of the nurseries)
                (leaf,) = group.exceptions
                raise leaf from None
    assert not app._engine_started.is_set()  # no engine was started


def test_the_state_options(tmp_path):
    args = build_parser().parse_args(
        ["--state-dir", "rel/dir", "--state-retention", "12h", "--state-max-bytes", "2G",
         "--state-max-bytes-per-key", "64M"])
    config = config_from_args(args)
    assert config.state_dir == os.path.abspath("rel/dir")  # (frontends get the same)
    assert (config.state_retention, config.state_max_bytes, config.state_max_bytes_per_key) \
        == (12 * 3600, 2 << 30, 64 << 20)
    assert state_config(config).directory == os.path.abspath("rel/dir")
    defaults = config_from_args(build_parser().parse_args([]))
    assert (defaults.state_retention, defaults.state_max_bytes) == (30 * 86400, 4 << 30)
    assert state_config(defaults).directory is None  # a temporary one
    assert state_config(replace(defaults, frontend_dir="/run/x")).directory == "/run/x/state"
    url = config_from_args(build_parser().parse_args(["--state-url", "postgresql://h/db"]))
    assert (state_config(url).url, state_config(url).directory) == ("postgresql://h/db", None)
    for bad in (["--state-url", "mysql://h/db"], ["--state-retention", "soon"],
                ["--state-max-bytes", "-1"], ["--state-dir", "d", "--state-url", "postgres://h"]):
        with pytest.raises(SystemExit):
            config_from_args(build_parser().parse_args(bad))
