"""What names a prompt's blocks when the router scores workers (docs/routing.md): the LoRA
adapter and the ``cache_salt`` seed the chain, as the engine keys its cache, on every pick
(the first, a migration's, ``Engine.pick_worker``). In-memory sim workers on virtual time;
what a worker holds is set through the router's own interfaces (its prediction, and the
exact index a worker's KV events feed), so a test says which worker should win."""

from __future__ import annotations

import pytest

from server import SamplingParams
from server.manager.kv_index import KVIndex
from server.manager.routing import BLOCK_TOKENS, prompt_blocks
from server.worker_protocol.kv_blocks import STORED, block_digests, seed_of
from server.worker_protocol.messages import KvEvent
from tests.fakes import all_outputs, open_fake_engine

PROMPT = list(range(100, 100 + 4 * BLOCK_TOKENS))  # four whole blocks


def believe(engine, worker: int, prompt, seed: bytes, exact: bool) -> None:
    """The engine now thinks ``worker`` holds ``prompt``'s blocks chained from ``seed``:
    from its KV events (``exact``: as a vllm worker's STEP would say), else predicted."""
    if exact:
        index = engine.workers[worker].kv_index
        if index is None:
            index = engine.workers[worker].kv_index = KVIndex(BLOCK_TOKENS)
        index.apply([KvEvent(STORED, block_digests(prompt, BLOCK_TOKENS, seed))])
    else:
        engine.router.routed(worker, prompt_blocks(prompt, seed=seed).hashes)


@pytest.mark.parametrize("exact", [False, True], ids=["predicted", "kv-events"])
async def test_a_migrated_request_is_scored_with_its_cache_salt(autojump_clock, exact):
    salted = SamplingParams(max_tokens=40, temperature=0, extra={"cache_salt": "s"})
    async with open_fake_engine(workers=3, routing="prefix") as (engine, spawn):
        # workers 0 and 2 hold the salted prompt's blocks, worker 1 the unsalted ones
        for worker, seed in ((0, seed_of([None, "s"])), (1, b""), (2, seed_of([None, "s"]))):
            believe(engine, worker, PROMPT, seed, exact)
        async with engine.generate(PROMPT, salted) as stream:
            choice = stream.choice_states()[0]
            assert choice.worker.index == 0  # (a tie with worker 2: the lowest index)
            pid = choice.worker.pid
            outs = []
            async for out in stream:
                outs.append(out)
                if len(outs) == 3:  # worker 0 dies mid-stream: the request moves
                    next(p for p in spawn.processes if p.pid == pid).die()
            # to the other worker holding its salted blocks, not to the unsalted ones'
            assert choice.worker.index == 2 and choice.migrations == 1
            assert outs[-1].finish_reason == "length"
        assert engine.statistics().routing.decisions["prefix"] == 2


@pytest.mark.parametrize("exact", [False, True], ids=["predicted", "kv-events"])
async def test_pick_worker_keys_the_prompt_by_adapter_and_salt(autojump_clock, exact):
    async with open_fake_engine(workers=3, routing="prefix") as (engine, _):
        believe(engine, 0, PROMPT, b"", exact)
        believe(engine, 1, PROMPT, seed_of(["sql"]), exact)
        believe(engine, 2, PROMPT, seed_of(["sql", "s"]), exact)
        salt = SamplingParams(extra={"cache_salt": "s"})
        for params, adapter, want in ((None, None, 0), (None, "sql", 1),
                                      (salt, "sql", 2), (salt.to_wire(), "sql", 2)):
            worker, decision = engine.pick_worker(PROMPT, params=params, adapter=adapter)
            assert (worker.index, decision.reason) == (want, "prefix"), (params, adapter)
        # a salt no worker holds: by load
        other = SamplingParams(extra={"cache_salt": "t"})
        assert engine.pick_worker(PROMPT, params=other)[1].reason == "load"


async def test_prompts_of_other_salts_share_no_predicted_blocks(autojump_clock):
    text = "a long shared prompt, " * 40  # several blocks of text

    def salted(salt):
        return SamplingParams(max_tokens=2, temperature=0, extra={"cache_salt": salt})

    async with open_fake_engine(workers=2, routing="prefix") as (engine, _):
        async def worker_of(params) -> int:
            async with engine.generate(text, params) as stream:
                await all_outputs(stream)
                return stream.choice_states()[0].worker.index

        assert await worker_of(salted("a")) == 0
        # another salt holds nothing on worker 0: the least loaded worker (1) takes it
        assert await worker_of(salted("b")) == 1
        # each salt's next request follows its own blocks
        assert await worker_of(salted("a")) == 0
        assert await worker_of(salted("b")) == 1
        assert engine.statistics().routing.decisions == {"prefix": 2, "load": 2, "balance": 0}


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("exact", [False, True], ids=["predicted", "kv-events"])
async def test_a_truncated_prompt_is_named_as_the_engine_runs_it(autojump_clock, exact, side):
    head, tail = [7] * 2 * BLOCK_TOKENS, [8] * 2 * BLOCK_TOKENS
    ids = head + PROMPT + tail
    cut = {"truncate_prompt_tokens": len(PROMPT) + len(tail), "truncation_side": side}
    kept = PROMPT + tail if side == "left" else head + PROMPT
    async with open_fake_engine(workers=3, routing="prefix") as (engine, _):
        believe(engine, 1, kept, b"", exact)  # what the engine runs: its cache after it
        believe(engine, 2, ids, b"", exact)   # the whole prompt: not what the engine runs
        # (cut on the right, the whole prompt holds the kept part too, and more: a tie)
        worker, decision = engine.pick_worker(ids, params=cut)
        blocks = len(kept) // BLOCK_TOKENS
        assert (worker.index, decision.matched) == (1, blocks * BLOCK_TOKENS if exact else blocks)
        # -1: the context less one token (the workers' max_model_len, from their HELLO)
        context = engine.info["max_model_len"]
        long = list(range(context + BLOCK_TOKENS))
        believe(engine, 2, long[len(long) - context + 1:], b"", exact)
        worker, decision = engine.pick_worker(long, params={"truncate_prompt_tokens": -1})
        assert (worker.index, decision.reason) == (2, "prefix")


async def test_a_truncated_follow_up_reuses_the_engines_blocks(autojump_clock):
    """The sim's prefix cache confirms it: the follow-up's kept part is the first prompt."""
    params = SamplingParams(max_tokens=2, temperature=0)
    follow = SamplingParams(max_tokens=2, temperature=0,
                            extra={"truncate_prompt_tokens": len(PROMPT)})
    async with open_fake_engine(workers=2, routing="prefix", prefix_cache_tokens=10_000,
                                prefix_block_size=BLOCK_TOKENS) as (engine, _):
        async with engine.generate(PROMPT, params) as first:
            await all_outputs(first)
        async with engine.generate([5] * 3 * BLOCK_TOKENS + PROMPT, follow) as second:
            outs = await all_outputs(second)
        assert second.choice_states()[0].worker.index == 0
        assert outs[-1].cached_tokens == len(PROMPT) - BLOCK_TOKENS  # (the last block is
        # computed: at most prompt_tokens - 1 tokens reused, in whole blocks)


async def test_a_batchs_later_prompts_are_noted_with_the_batchs_key(autojump_clock):
    """``generate_many`` scores the first prompt; the others go to the same worker and are
    noted there keyed as the first (its adapter and salt), so a later request with one of
    them and the same salt finds its blocks on that worker."""
    other = list(range(5000, 5000 + 4 * BLOCK_TOKENS))
    salted = SamplingParams(max_tokens=2, temperature=0, extra={"cache_salt": "s"})
    async with open_fake_engine(workers=2, routing="prefix") as (engine, _):
        believe(engine, 1, PROMPT, seed_of([None, "s"]), False)
        async with engine.generate_many([PROMPT, other], salted) as stream:
            await all_outputs(stream)
        worker, decision = engine.pick_worker(other, params=salted)
        assert (worker.index, decision.reason) == (1, "prefix")
        # (unsalted, the same ids were never sent anywhere: by load)
        assert engine.pick_worker(other)[1].reason == "load"
