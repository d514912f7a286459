"""Prefix-aware routing end to end: real sim worker processes with their prefix cache on, a
real HTTP server, and the openai SDK. A conversation's follow-up turn must land on the
worker that served its first turn, which the engine confirms in
``usage.prompt_tokens_details.cached_tokens`` (not by timing)."""

from __future__ import annotations

import openai
import pytest
import trio

from server import SamplingParams
from tests.conftest import running_server
from tests.fakes import all_outputs, fault, open_real_engine, sim_config, wait_for

SIM = dict(itl_ms=2.0, ttft_ms=2.0, prefill_us_per_token=0.0, faults=False,
           prefix_cache_tokens=100_000, prefix_block_size=4)
LIMIT = 60


def conversation(name: str, turns: int, repeat: int = 60) -> dict:
    """A chat whose system prompt is its own (so that two conversations share nothing)."""
    messages = [{"role": "system",
                 "content": f"You are {name}. " + f"{name} knows. " * repeat}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} for {name}"})
        if t + 1 < turns:
            messages.append({"role": "assistant", "content": f"answer {t}"})
    return {"messages": messages}


async def cached_of(stream) -> int | None:
    outs = await all_outputs(stream)
    return outs[-1].cached_tokens


@pytest.mark.parametrize("routing", ["prefix", "least-loaded"])
async def test_follow_up_turn_lands_on_the_worker_holding_its_prefix(routing):
    params = SamplingParams(max_tokens=20, temperature=0)
    with trio.fail_after(LIMIT):
        async with open_real_engine(sim_config(workers=2, routing=routing, **SIM)) as (
            engine, _,
        ):
            # both first turns at once: the second goes to the other (idle) worker
            a = engine.generate(conversation("Ann", 1), params)
            b = engine.generate(conversation("Bob", 1), params)
            assert {c.worker.index for c in a.choice_states() + b.choice_states()} == {0, 1}
            assert await cached_of(a) == 0 and await cached_of(b) == 0
            # the follow-ups, one at a time, both workers idle
            cached_b = await cached_of(engine.generate(conversation("Bob", 2), params))
            cached_a = await cached_of(engine.generate(conversation("Ann", 2), params))
            stats = engine.statistics().routing
            assert stats is not None
    if routing == "prefix":
        # the whole first turn (its 120-word system prompt and question) was reused, on each worker
        assert cached_a is not None and cached_a >= 120
        assert cached_b is not None and cached_b >= 120
        assert stats.decisions["prefix"] == 2
        assert sum(stats.cached_tokens) == cached_a + cached_b
    else:  # by load, with idle workers: both go to worker 0, and Bob's prefix is on 1
        assert cached_b == 0 and cached_a is not None and cached_a >= 120


async def test_cached_tokens_in_usage_over_http_with_two_frontend_requests():
    """Through hypercorn and the openai SDK: the follow-up's usage reports the reuse, and
    /metrics counts the prefix decision and the worker's hits."""
    config = sim_config(workers=2, **SIM)
    with trio.fail_after(LIMIT):
        async with running_server(config) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            first = await client.chat.completions.create(
                model="sim", max_tokens=5, **conversation("Cy", 1))
            second = await client.chat.completions.create(
                model="sim", max_tokens=5, **conversation("Cy", 2))
            metrics = (await client._client.get(url + "/metrics")).text
            await client.close()
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 120
    assert 'trio_llm:routing_decisions_total{model_name="sim",reason="prefix"} 1.0' in metrics


async def test_a_restarted_worker_is_known_to_have_an_empty_cache():
    """The worker crashes and restarts between two turns: its cache is gone (the engine
    reports 0 cached), and the router no longer predicts a match (routes by load)."""
    params = SamplingParams(max_tokens=5, temperature=0)
    with trio.fail_after(LIMIT):
        async with open_real_engine(sim_config(**{**SIM, "faults": True})) as (engine, _):
            assert await cached_of(engine.generate(conversation("Di", 1), params)) == 0
            assert await cached_of(engine.generate(conversation("Di", 2), params)) >= 120
            assert engine.statistics().routing.decisions["prefix"] == 1  # type: ignore[union-attr]
            crash = SamplingParams(max_tokens=5, extra=fault("crash", 1))
            await all_outputs(engine.generate("x", crash))
            await wait_for(lambda: engine.statistics().workers[0].restarts == 1
                           and engine.statistics().workers_alive == 1, timeout=20)
            assert await cached_of(engine.generate(conversation("Di", 3), params)) == 0
            stats = engine.statistics().routing
            assert stats is not None and stats.decisions["prefix"] == 1


async def test_a_cache_that_evicts_sooner_than_predicted_is_corrected():
    """The sim's cache (128 tokens) is far smaller than the router's index: a turn the
    router expected cached reports otherwise, and the index forgets its oldest blocks."""
    params = SamplingParams(max_tokens=5, temperature=0)
    small = {**SIM, "prefix_cache_tokens": 128}
    with trio.fail_after(LIMIT):
        async with open_real_engine(sim_config(**small)) as (engine, _):
            await cached_of(engine.generate(conversation("Ed", 1, 200), params))
            await cached_of(engine.generate(conversation("Flo", 1, 200), params))  # evicts Ed's
            index = engine.router.indexes[0]
            held = len(index)
            new = [h for h in engine.router.blocks(conversation("Ed", 2, 200)).hashes
                   if h not in index]
            assert await cached_of(engine.generate(conversation("Ed", 2, 200), params)) == 0
            stats = engine.statistics().routing
            assert stats is not None and stats.mispredicted == [1]
            # Ed's second turn added its new blocks, and the misprediction took old ones
            assert len(index) < held + len(new)
