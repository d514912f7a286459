"""Routing decisions, sans-IO (server.manager.routing), checked against brute-force models:
the prefix index against "longest common block prefix with any prompt sent", LRU eviction
against a list, and pick() against the policy written out longhand. Also the sim engine's
prefix cache (server.engines.sim.cache), against vLLM's rules."""

from __future__ import annotations

import collections

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.manager.routing import (
    BLOCK_TOKENS,
    PrefixIndex,
    Router,
    canonical_text,
    prompt_blocks,
)
from server.engines.sim.engine import SimEngine

B = 8  # characters per block in these tests

# prompts built from a few shared pieces, so that they share prefixes of many lengths
pieces = st.sampled_from(["abcdefgh", "ABCDEFGH", "0123", "xy", "zzzzzzzzzzzz"])
prompts = st.lists(pieces, min_size=0, max_size=8).map("".join)


def common_blocks(a: str, b: str) -> int:
    """Brute force: full blocks of ``B`` characters the two strings share from the start."""
    n = 0
    while (n + 1) * B <= min(len(a), len(b)) and a[n * B : (n + 1) * B] == b[n * B : (n + 1) * B]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(st.lists(prompts, max_size=12), prompts)
def test_index_match_is_the_longest_common_block_prefix(sent, query):
    index = PrefixIndex(capacity=10_000)
    for p in sent:
        index.insert(prompt_blocks(p, B).hashes)
    expected = max((common_blocks(p, query) for p in sent), default=0)
    assert index.match(prompt_blocks(query, B).hashes) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(prompts, max_size=12), st.integers(1, 12))
def test_index_evicts_least_recently_used_blocks(sent, capacity):
    index = PrefixIndex(capacity)
    model: list[bytes] = []  # most recent last
    for p in sent:
        for h in prompt_blocks(p, B).hashes:
            if h in model:
                model.remove(h)
            model.append(h)
        del model[: max(0, len(model) - capacity)]
        index.insert(prompt_blocks(p, B).hashes)
    assert len(index) == len(model)
    assert all(h in index for h in model)


def test_blocks_of_text_chat_and_token_ids():
    a = prompt_blocks("x" * 20, B)
    assert len(a.hashes) == 2 and a.units == 20 and a.size == B
    assert prompt_blocks("x" * 16, B).hashes == a.hashes  # only full blocks count
    assert prompt_blocks("y" + "x" * 19, B).hashes[1] != a.hashes[1]  # chained
    ids = prompt_blocks(list(range(3 * BLOCK_TOKENS + 1)))
    assert len(ids.hashes) == 3 and ids.size == BLOCK_TOKENS
    # a block of ids is named by the chained hash of each id as 8 little-endian bytes
    parent = b""
    for i, h in enumerate(ids.hashes):
        block = range(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in block)
        parent = hashlib.blake2b(parent + data, digest_size=8).digest()
        assert h == parent
    # a chat's next turn extends its canonical text, so the earlier blocks carry over
    turn1 = {"messages": [{"role": "system", "content": "s" * 300},
                          {"role": "user", "content": "hi"}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "yo"},
                                              {"role": "user", "content": "more"}]}
    t1, t2 = canonical_text(turn1), canonical_text(turn2)
    assert t1 is not None and t2 is not None and t2.startswith(t1)
    h1 = prompt_blocks(turn1).hashes
    assert h1 and prompt_blocks(turn2).hashes[: len(h1)] == h1
    # other fields (tools, template options) come first: different tools, different blocks
    assert prompt_blocks({**turn1, "tools": [{"x": 1}]}).hashes[0] != h1[0]


def brute_pick(router: Router, query: str, loads, exclude=()):
    """The prefix policy written out longhand."""
    cands = [i for i, load in enumerate(loads) if load is not None and i not in exclude]
    if not cands:
        return None
    hashes = prompt_blocks(query, B).hashes
    least = min(cands, key=lambda i: (loads[i], i))
    scores = {i: router.indexes[i].match(hashes) for i in cands}
    top = max(scores.values())
    if not top:
        return least, "load"
    best = min((i for i in cands if scores[i] == top), key=lambda i: (loads[i], -i))
    if loads[best] - loads[least] > router.balance:
        return least, "balance"
    return best, "prefix"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), prompts), max_size=16),
    prompts,
    st.lists(st.one_of(st.none(), st.integers(0, 10)), min_size=4, max_size=4),
    st.integers(0, 5),
    st.sets(st.integers(0, 3), max_size=2),
)
def test_pick_follows_the_prefix_policy(history, query, loads, balance, exclude):
    router = Router(4, "prefix", balance=balance, block_chars=B, window=0)
    for worker, p in history:
        router.routed(worker, router.blocks(p).hashes)
    decision = router.pick(router.blocks(query).hashes, loads, tuple(exclude))
    expected = brute_pick(router, query, loads, exclude)
    if expected is None:
        assert decision is None
        return
    assert decision is not None
    got = (decision.worker, decision.reason)
    # among equally good, equally loaded workers, any is right
    if got != expected:
        w = decision.worker
        hashes = router.blocks(query).hashes
        e = expected[0]
        assert decision.reason == expected[1]
        assert loads[w] == loads[e]
        assert router.indexes[w].match(hashes) == router.indexes[e].match(hashes)
    assert router.stats.decisions[decision.reason] == 1


def test_follow_up_goes_to_the_worker_holding_the_prefix_unless_it_is_too_loaded():
    router = Router(3, "prefix", balance=2, block_chars=B, window=0)
    conv = "system prompt. " * 4
    first = router.pick(router.blocks(conv).hashes, [0, 0, 0])
    assert first is not None and first.reason == "load"
    router.routed(first.worker, router.blocks(conv).hashes)
    follow = conv + "user: and then?"
    loads = [1, 1, 1]
    loads[first.worker] = 3  # within the balance of 2
    again = router.pick(router.blocks(follow).hashes, loads)
    assert again is not None and (again.worker, again.reason) == (first.worker, "prefix")
    assert again.matched == len(conv) // B
    loads[first.worker] = 4  # beyond it
    other = router.pick(router.blocks(follow).hashes, loads)
    assert other is not None and other.worker != first.worker and other.reason == "balance"
    # excluded (e.g. the worker died): the best of the others
    gone = router.pick(router.blocks(follow).hashes, [1, 1, 1], exclude=(first.worker,))
    assert gone is not None and gone.worker != first.worker


def test_recent_decisions_count_as_load():
    """A prefix every conversation shares does not draw every new conversation to the
    worker that holds it: its recent decisions count as load (window of 8 here)."""
    router = Router(2, "prefix", balance=2, block_chars=B, window=8)
    system = "shared system prompt " * 3
    got = []
    for k in range(8):
        prompt = system + f"conversation {k:04d}" * 2
        d = router.pick(router.blocks(prompt).hashes, [0, 0])  # nothing outstanding
        assert d is not None
        router.routed(d.worker, router.blocks(prompt).hashes)
        got.append(d.worker)
    assert abs(got.count(0) - got.count(1)) <= 3
    # without the window, worker 0 would take them all
    plain = Router(2, "prefix", balance=2, block_chars=B, window=0)
    for k in range(8):
        prompt = system + f"conversation {k:04d}" * 2
        d = plain.pick(plain.blocks(prompt).hashes, [0, 0])
        assert d is not None and d.worker == 0
        plain.routed(0, plain.blocks(prompt).hashes)


def test_round_robin_and_least_loaded():
    rr = Router(3, "round-robin")
    assert [rr.pick([], [0, None, 5]).worker for _ in range(4)] == [0, 2, 0, 2]  # type: ignore[union-attr]
    ll = Router(3, "least-loaded")
    assert ll.pick([b"x"], [3, 1, 2]).worker == 1  # type: ignore[union-attr]
    assert ll.blocks("x" * 1000).hashes == []  # no hashing when it is not used
    with pytest.raises(ValueError, match="routing policy"):
        Router(2, "random")


def test_reset_and_misprediction_correct_the_index():
    router = Router(2, "prefix", block_chars=B)
    others = [router.blocks(f"other{i:03d}" * 4).hashes for i in range(5)]
    for h in others:
        router.routed(0, h)
    conv = router.blocks("c" * 10 * B)
    router.routed(0, conv.hashes)
    assert router.indexes[0].match(conv.hashes) == 10
    # the worker reports a fifth of the predicted prefix cached: it evicts faster
    before = len(router.indexes[0])
    router.observed(0, conv, 10, prompt_tokens=100, cached_tokens=20)
    assert router.stats.mispredicted[0] == 1
    assert len(router.indexes[0]) == before - 8
    # a result near the prediction (an engine caches whole blocks of its own) changes nothing
    router.observed(0, conv, 10, prompt_tokens=100, cached_tokens=64)
    assert router.stats.mispredicted[0] == 1 and len(router.indexes[0]) == before - 8
    assert router.stats.cached_tokens[0] == 84 and router.stats.prompt_tokens[0] == 200
    router.reset(0)
    assert len(router.indexes[0]) == 0


# -- the sim engine's prefix cache -------------------------------------------------------------


def sim(**kw) -> tuple[SimEngine, list]:
    clock = [0.0]
    engine = SimEngine(itl_ms=1.0, ttft_ms=10.0, prefill_us_per_token=1000.0,
                       clock=lambda: clock[0], **kw)
    return engine, clock


def run_one(engine: SimEngine, clock: list, rid: int, prompt) -> tuple[float, int | None]:
    """Time from admission to first token, and the cached_tokens note."""
    start = clock[0]
    engine.add(rid, prompt, {"max_tokens": 2, "temperature": 0})
    first = None
    while engine.next_deadline() is not None:
        clock[0] = max(clock[0], engine.next_deadline())  # type: ignore[type-var]
        for out in engine.step(clock[0]):
            if first is None and out.ntok:
                first = clock[0] - start
    notes = {rid_: n["cached_tokens"] for rid_, n in engine.notes}
    engine.notes.clear()
    assert first is not None
    return first, notes.get(rid)


def test_sim_prefix_cache_reports_cached_tokens_and_prefills_only_the_rest():
    engine, clock = sim(prefix_cache_tokens=1000, prefix_block_size=4)
    prompt = " ".join(f"w{i}" for i in range(40))
    t1, c1 = run_one(engine, clock, 1, prompt)
    assert c1 == 0 and t1 == pytest.approx(0.010 + 0.040)
    t2, c2 = run_one(engine, clock, 2, prompt + " more words here now")  # 44 tokens
    assert c2 == 40 and t2 == pytest.approx(0.010 + 0.004)
    # all cached: the last block is computed again (vLLM computes the last prompt token)
    _, c3 = run_one(engine, clock, 3, prompt)
    assert c3 == 36
    # token-id prompts are cached too
    _, c4 = run_one(engine, clock, 4, list(range(9)))
    _, c5 = run_one(engine, clock, 5, list(range(9)))
    assert (c4, c5) == (0, 8)


def test_sim_prefix_cache_evicts_least_recently_used_blocks():
    engine, clock = sim(prefix_cache_tokens=40, prefix_block_size=4)  # 10 blocks
    a = " ".join(f"a{i}" for i in range(41))
    b = " ".join(f"b{i}" for i in range(41))
    run_one(engine, clock, 1, a)
    run_one(engine, clock, 2, b)  # evicts all of a
    assert run_one(engine, clock, 3, a)[1] == 0
    assert run_one(engine, clock, 4, a)[1] == 40


def test_sim_without_prefix_cache_sends_no_notes():
    engine, clock = sim()
    assert run_one(engine, clock, 1, "a b c d e")[1] is None


def test_sim_prefix_cache_matches_a_brute_force_model():
    rng = random.Random(7)
    engine, clock = sim(prefix_cache_tokens=64, prefix_block_size=4)
    lru: list[tuple] = []  # block prefixes (as tuples of all tokens up to the block), oldest first
    for rid in range(1, 120):
        words = [rng.choice("abc") for _ in range(rng.randrange(1, 30))]
        blocks = [tuple(words[: (i + 1) * 4]) for i in range(len(words) // 4)]
        usable = (len(words) - 1) // 4
        expected = 0
        for blk in blocks[:usable]:
            if blk not in lru:
                break
            expected += 4
        for blk in blocks:
            if blk in lru:
                lru.remove(blk)
            lru.append(blk)
        del lru[: max(0, len(lru) - 16)]
        assert run_one(engine, clock, rid, " ".join(words))[1] == expected


@pytest.mark.parametrize("joins", ["new", "reused"])
def test_a_worker_that_joins_takes_its_share_not_every_request(joins):
    """A worker added to a busy pool starts with the others' mean share of the recent
    decisions, so it fills up to its share of the requests in flight, not about twice that
    (starting from none, it looked idle by the others' whole window: bench/join_balance.py).
    ``reused``: it takes the index of one that left long ago (discovery reuses free slots).
    A steady load: each new request ends the oldest, 40 in flight."""
    router = Router(4 if joins == "reused" else 3, "prefix")
    in_flight: collections.deque[int] = collections.deque()
    outstanding = [0] * len(router.indexes)
    gone = [3] if joins == "reused" else []

    def step() -> None:
        d = router.pick([], [None if i in gone else n for i, n in enumerate(outstanding)])
        assert d is not None
        outstanding[d.worker] += 1
        in_flight.append(d.worker)
        if len(in_flight) > 40:
            outstanding[in_flight.popleft()] -= 1

    for _ in range(400):
        step()
    if joins == "reused":
        new = 3
        gone.clear()
        router.rejoin(new)
    else:
        new = router.add_worker()
        outstanding.append(0)
    most = 0
    for _ in range(400):
        step()
        most = max(most, outstanding[new])
    assert 8 <= most <= 12, most  # its share is 10 (starting from none: 21)
