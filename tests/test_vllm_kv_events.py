"""vLLM's KV cache events, forwarded to the frontend's exact prefix index (docs/routing.md):
the worker's translation of vLLM's own event objects, its subscriber against vLLM's own
ZMQ publisher, and end to end: two real vllm workers listening, shared by two frontends,
a token-id prompt's follow-up routed by the second frontend (which never saw the first
turn) to the worker whose cache holds it, and both frontends' indexes alike; then a
``cache_salt`` on one of those workers behind a third frontend: a prompt's blocks are its
salt's only.

Skipped where vLLM is not installed. The end-to-end test starts two vLLM engines, once for
its checks (a model load is most of its time), which include the workers' torch threads
(tests/test_vllm_threads.py's end-to-end check): slow.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import trio

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import server  # noqa: E402
from server.manager.engine import open_engine  # noqa: E402
from server.observability.metrics import _kv_families  # noqa: E402
from server.worker_protocol.kv_blocks import (  # noqa: E402
    CLEARED, REMOVED, STORED, block_digests, seed_of,
)
from server.engines.vllm.events import KVEventSubscriber, KVEventTranslator  # noqa: E402
from tests.remote import listening_worker, remote_config, wait_until  # noqa: E402
from tests.test_vllm_engine import CONTEXT, MODEL, SHAPE  # noqa: E402
from tests.test_vllm_threads import vllm_serve_threads  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)


def stored(hashes, parent, ids, size, extra=None, medium="GPU", group=0):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=ids,
                       block_size=size, lora_id=None, medium=medium, lora_name=None,
                       extra_keys=extra, group_idx=group)


def removed(hashes, medium="GPU"):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


def test_translator_names_vllm_blocks_by_their_ids():
    from vllm.distributed.kv_events import AllBlocksCleared

    t = KVEventTranslator()
    ids = list(range(100, 112))
    names = block_digests(ids, 4)
    # two blocks, then the third chained to the second by vLLM's hash
    out = t.translate([stored([b"h1", b"h2"], None, ids[:8], 4),
                       stored([b"h3"], b"h2", ids[8:12], 4)])
    assert out == [[STORED, names[:2]], [STORED, names[2:]]]
    # a re-store (vLLM reports reused blocks again) is not news
    assert t.translate([stored([b"h1"], None, ids[:4], 4)]) == []
    # a parent it never saw, another tier, another group, a partial block: skipped
    assert t.translate([stored([b"x"], b"unknown", ids[:4], 4),
                        stored([b"y"], None, ids[:4], 4, medium="CPU"),
                        stored([b"z"], None, ids[:4], 4, group=1),
                        stored([b"w"], None, ids[:3], 4)]) == []
    # an adapter's or a salt's chain starts from its own seed
    lora = t.translate([stored([b"l1"], None, ids[:4], 4, extra=[("adapter", "salt")])])
    assert lora == [[STORED, block_digests(ids[:4], 4, seed_of(["adapter", "salt"]))]]
    assert t.snapshot() == [[STORED, [*names, *lora[0][1]]]]
    # removals are named; unknown ones (never reported) are not news
    assert t.translate([removed([b"h3", b"nope"])]) == [[REMOVED, names[2:]]]
    assert t.translate([AllBlocksCleared()]) == [[CLEARED]]
    assert t.snapshot() == [] and len(t) == 0


def test_subscriber_drains_vllm_publisher_and_reports_lost_batches():
    from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

    sub = KVEventSubscriber()
    publisher = EventPublisherFactory.create(sub.engine_config())
    try:
        # connected: its private directory (the socket file) is gone, the events flow
        assert sub.wait_connected(60)
        assert not os.path.exists(sub.endpoint.removeprefix("ipc://"))
        ids = list(range(8))
        names = block_digests(ids, 4)
        batches = [KVEventBatch(ts=time.time(), events=[stored([b"a"], None, ids[:4], 4)]),
                   KVEventBatch(ts=time.time(), events=[stored([b"b"], b"a", ids[4:], 4)])]
        got: list = []
        deadline = time.monotonic() + 60  # (a generous bound: a failure, not a timing)
        # until the subscription takes effect, batches are lost: the first one that
        # arrives after a gap starts with CLEARED
        while STORED not in [e[0] for e in got]:
            assert time.monotonic() < deadline, "no batch arrived"
            publisher.publish(batches[0])
            time.sleep(0.05)
            got += sub.drain()
        assert got[-1] == [STORED, names[:1]]
        assert got[:-1] in ([], [[CLEARED]])  # (later copies of it: not news)
        publisher.publish(batches[1])
        more: list = []
        while not more:
            assert time.monotonic() < deadline, "the second batch did not arrive"
            time.sleep(0.02)
            more = sub.drain()
        assert more == [[STORED, names[1:]]]  # no gap: no CLEARED
        assert sub.drain() == []  # never blocks
    finally:
        publisher.shutdown()
        sub.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kv-events") / MODEL, **SHAPE)


async def run(engine, prompt, max_tokens=2, **extra) -> tuple[int, int | None]:
    """(the worker it ran on, its cached_tokens). ``extra``: more wire params."""
    params = server.SamplingParams(max_tokens=max_tokens, temperature=0, extra=extra)
    async with engine.generate(prompt, params) as stream:
        async for _ in stream:
            pass
        choice = stream.choice_states()[0]
        return choice.worker.index, choice.cached_tokens


async def test_two_frontends_share_kv_events_and_a_salt_keeps_blocks_apart(tmp_path, model_dir):
    """Two listening vllm workers, loaded once: shared by two frontends, then one of them
    behind a frontend of its own for ``cache_salt``. Their HELLOs also say that each runs
    torch with the threads ``vllm serve`` would give it (tests/test_vllm_threads.py)."""
    args = ("--engine", "vllm", "--model-path", str(model_dir), "--max-model-len",
            str(CONTEXT), "--dtype", "float32", "--engine-arg",
            "kv_cache_memory_bytes=67108864", "--enforce-eager")  # (no test of compiling)
    with trio.fail_after(1800):  # (a bound that fails a hang, not a timing)
        async with listening_worker(tmp_path, "127.0.0.1:0", *args, name="w0",
                                    startup=900) as w0, \
                listening_worker(tmp_path, "127.0.0.1:0", *args, name="w1",
                                 startup=900) as w1:
            await two_frontends_share_the_workers_kv_events(w0, w1)
            # (worker 0 holds the blocks of ``other`` below only: not the prompt salted next)
            await cache_salt_keeps_a_prompts_blocks_apart(w0)


async def two_frontends_share_the_workers_kv_events(w0, w1) -> None:
    config = remote_config(w0, w1, startup_timeout=900, routing="prefix")
    async with open_engine(config) as a, open_engine(config) as b:
        size = a.workers[0].info["kv_events"]["block_size"]
        assert all(w.kv_index is not None for w in (*a.workers, *b.workers))
        threads = vllm_serve_threads()
        assert [w.info["torch_threads"] for w in a.workers] == [threads, threads]
        first = [7] * 3 + list(range(1, 3 * size))  # three whole blocks and more
        other = [9] * 3 * size
        # frontend a: one prompt to each worker (its recent decisions count as load)
        assert (await run(a, other))[0] == 0
        worker, cached = await run(a, first)
        assert worker == 1 and not cached
        names = block_digests(first, size)[:2]
        # both frontends learn that worker 1 holds the prompt's blocks
        await wait_until(lambda: all(
            e.workers[1].kv_index.match(names) == 2 for e in (a, b)), 120)
        # frontend b never routed it: its follow-up still goes where the blocks are
        follow_up = first + [5, 6, 7]
        worker, cached = await run(b, follow_up)
        assert worker == 1 and cached and cached >= 2 * size
        await wait_until(lambda: all(
            a.workers[i].kv_index._held == b.workers[i].kv_index._held
            for i in (0, 1)), 120)
        # least-loaded would have sent it to worker 0 (equal loads, lowest index)
        assert b.router.stats.decisions["prefix"] == 1
        # the metrics of what b knows (server.observability.metrics)
        families = {f.name: f for f in _kv_families([(MODEL, b)])}
        known = {s.labels["worker"]: s.value
                 for s in families["trio_llm:kv_cache_blocks_known"].samples}
        assert known["1"] == len(b.workers[1].kv_index) >= 2
        stored = [s.value for s in families["trio_llm:kv_events"].samples
                  if s.labels["event"] == "stored" and s.labels["worker"] == "1"]
        assert stored and stored[0] >= 1


async def cache_salt_keeps_a_prompts_blocks_apart(worker) -> None:
    """The same token-id prompt with another salt (or none) is scored as sharing no block
    with the salted one that the engine cached; with the same salt, all of them; and the
    engine's cached_tokens agree."""
    config = remote_config(worker, routing="prefix", drain_timeout=5.0, startup_timeout=900)
    async with open_engine(config) as engine:
        size = engine.workers[0].info["kv_events"]["block_size"]
        index = engine.workers[0].kv_index
        prompt = [7] * 3 + list(range(1, 3 * size))  # three whole blocks and more
        assert await run(engine, prompt, cache_salt="a") == (0, 0)
        salted = block_digests(prompt, size, seed_of([None, "a"]))
        await wait_until(lambda: index.match(salted) == 3, 120)
        # the worker's events named the salted chain only
        assert index.match(block_digests(prompt, size)) == 0
        for salt, reason, matched in (("a", "prefix", 3 * size), ("b", "load", 0),
                                      (None, "load", 0)):
            params = {} if salt is None else {"cache_salt": salt}
            _, decision = engine.pick_worker(prompt, params=params)
            assert (decision.reason, decision.matched) == (reason, matched), salt
        # the engine agrees: another salt reuses nothing, the same salt every block
        assert await run(engine, prompt, cache_salt="b") == (0, 0)
        assert await run(engine, prompt, cache_salt="a") == (0, 3 * size)
