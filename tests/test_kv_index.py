"""The frontend's exact index of a worker's KV cache (server.manager.kv_index), sans-IO, and
the names of blocks both sides compute (server.worker_protocol.kv_blocks), against
brute-force models: a block's name against the chained hash written out longhand, and an
index fed a cache's events against "the longest run of leading blocks the cache holds".
Also the KV events' shape on the wire, and the router's use of exact scores."""

from __future__ import annotations

import hashlib
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.manager.kv_index import KVIndex, prefix_tokens
from server.manager.routing import Router
from server.worker_protocol import wire
from server.worker_protocol.kv_blocks import (
    CLEARED, REMOVED, STORED, block_digests, seed_of,
)


def _typed(events: list) -> list[wire.KvEvent]:
    """KV events as a STEP's note carries them to the router: typed, and so checked."""
    return msgspec.convert(events, list[wire.KvEvent])

ids_lists = st.lists(st.integers(min_value=0, max_value=2**40), max_size=40)


def longhand(ids, size, seed=b"", parent=None):
    prev = seed if parent is None else parent
    out = []
    for i in range(len(ids) // size):
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in ids[i * size:(i + 1) * size])
        prev = hashlib.blake2b(prev + data, digest_size=8).digest()
        out.append(prev)
    return out


@settings(max_examples=200, deadline=None)
@given(ids_lists, st.integers(min_value=1, max_value=7), st.sampled_from([(), ("lora",),
                                                                       ("lora", "salt")]))
def test_block_names_are_the_chained_hash_of_whole_blocks(ids, size, keys):
    seed = seed_of(keys)
    names = block_digests(ids, size, seed)
    assert names == longhand(ids, size, seed)
    # a chain continued from a block's name is the same chain
    if len(names) > 1:
        assert block_digests(ids[size:], size, parent=names[0]) == names[1:]


def test_seeds_keep_adapters_and_salts_apart():
    ids = list(range(8))
    plain = block_digests(ids, 4)
    assert block_digests(ids, 4, seed_of(["a"])) != plain
    assert block_digests(ids, 4, seed_of(["a"])) != block_digests(ids, 4, seed_of(["a", "s"]))
    assert seed_of([None, None]) == b""


class ModelCache:
    """A brute-force engine cache: the block-aligned token prefixes it holds, and the KV
    events (on the wire's terms) each change makes, as the worker sends them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.held: set[tuple] = set()

    def store(self, ids) -> list:
        prefixes = [tuple(ids[:(i + 1) * self.size]) for i in range(len(ids) // self.size)]
        names = block_digests(ids, self.size)
        new = [n for p, n in zip(prefixes, names) if p not in self.held]
        self.held.update(prefixes)
        return [[STORED, new]] if new else []

    def evict(self, rng: random.Random) -> list:
        if not self.held:
            return []
        gone = rng.sample(sorted(self.held), rng.randint(1, len(self.held)))
        self.held.difference_update(gone)
        names = [block_digests(list(p), self.size)[-1] for p in gone]
        return [[REMOVED, names]]

    def match(self, ids) -> int:
        n = 0
        while (n + 1) * self.size <= len(ids) and tuple(ids[:(n + 1) * self.size]) in self.held:
            n += 1
        return n


@pytest.mark.parametrize("seed", range(30))
def test_index_fed_events_matches_the_cache(seed):
    rng = random.Random(seed)
    size = rng.choice([1, 2, 4])
    cache = ModelCache(size)
    index = KVIndex(size)
    late = None  # a second frontend, given the snapshot (the cache's state) midway
    pieces = [[rng.randrange(5) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    for step in range(60):
        op = rng.random()
        if op < 0.6:
            events = cache.store(sum(rng.choices(pieces, k=rng.randint(0, 5)), []))
        elif op < 0.95:
            events = cache.evict(rng)
        else:
            cache.held.clear()
            events = [[CLEARED]]
        events = _typed(events)  # (and checked: as a STEP's note carries them)
        index.apply(events)
        if late is not None:
            late.apply(events)
        if step == 30:
            late = KVIndex(size)
            late.apply(_typed([[STORED, [block_digests(list(p), size)[-1]
                                         for p in cache.held]]]))
        for _ in range(5):
            query = sum(rng.choices(pieces, k=rng.randint(0, 5)), [])
            names = block_digests(query, size)
            assert index.match(names) == cache.match(query)
            if late is not None:
                assert late.match(names) == cache.match(query)
        assert len(index) == len(cache.held)


def test_an_index_past_its_capacity_forgets_rather_than_grows():
    index = KVIndex(4, capacity=3)
    index.apply(_typed([[STORED, [b"a" * 8, b"b" * 8]]]))
    assert len(index) == 2
    index.apply(_typed([[STORED, [b"c" * 8, b"d" * 8]]]))
    assert len(index) == 0


def test_kv_events_on_the_wire():
    good = [wire.STEP, [], [], [[None, {"kv_events": [[STORED, [b"12345678"]], [REMOVED, []],
                                                      [CLEARED]]}]]]
    assert wire.check_reply(good) is good
    assert wire.FrameDecoder(wire.check_reply).feed(wire.encode(good)) == [good]
    for bad in (
        [[None, {"kv_events": [[STORED, [b"short"]]]}]],       # not a digest
        [[None, {"kv_events": [[CLEARED, []]]}]],             # cleared takes nothing
        [[None, {"kv_events": [[7, []]]}]],                   # no such event
        [[None, {"cached_tokens": 3}]],                       # a request's item, no rid
        [[1, {"kv_events": []}]],                             # the worker's item, a rid
        [["1", {"token_ids": [1]}]],
    ):
        with pytest.raises(wire.ProtocolError):
            wire.check_reply([wire.STEP, [], [], bad])


def test_prefix_tokens_exact_where_reported_else_predicted():
    ids = list(range(40))
    a, b = KVIndex(8), KVIndex(4)
    a.apply(_typed([[STORED, block_digests(ids[:24], 8)]]))       # 3 blocks of 8
    b.apply(_typed([[STORED, block_digests(ids[:8], 4)[:1]]]))    # 1 block of 4
    assert prefix_tokens(ids, b"", [a, b, None], [0, 0, 16]) == [24, 4, 16]
    # another seed (an adapter, a salt): not the same blocks
    assert prefix_tokens(ids, seed_of(["x"]), [a, b], [0, 0]) == [0, 0]
    # ids no engine holds: no prefix, no error
    assert prefix_tokens([2**70] * 16, b"", [a], [0]) == [0]


def test_router_picks_by_exact_scores_within_the_balance():
    router = Router(3, balance=2, window=0)
    # worker 1 holds the most; equally loaded: it wins
    assert router.pick([], [0, 0, 0], scores=[16, 64, 0]).worker == 1
    # too loaded: the least loaded takes it, for the balance
    decision = router.pick([], [0, 3, 1], scores=[16, 64, 0])
    assert (decision.worker, decision.reason, decision.matched) == (0, "balance", 16)
    # nobody holds any: by load
    assert router.pick([], [2, 1, 3], scores=[0, 0, 0]).reason == "load"
    # excluded or down: not picked
    assert router.pick([], [0, None, 0], exclude=[0], scores=[16, 64, 8]).worker == 2
