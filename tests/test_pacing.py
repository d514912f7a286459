"""Pacing (``EngineConfig.stream_interval``): fewer, fuller outputs per stream; the first and
the last are never delayed. In memory, under autojump_clock, with the real sim engine."""

from __future__ import annotations

import pytest
import trio

import server
from tests.fakes import open_fake_engine, sim_config


def config(interval: float, **options) -> server.EngineConfig:
    base = sim_config(itl_ms=8.0, ttft_ms=20.0, prefill_us_per_token=0.0, **options)
    return server.EngineConfig(
        engine_options=base.engine_options, stream_interval=interval, drain_timeout=0.5
    )


async def collect(engine, max_tokens: int, slow_consumer: float = 0.0):
    got = []
    async with engine.generate("a b", server.SamplingParams(max_tokens=max_tokens)) as stream:
        async for out in stream:
            got.append((trio.current_time(), out))
            if slow_consumer:
                await trio.sleep(slow_consumer)
    return got


async def test_without_pacing_every_engine_step_is_one_output(autojump_clock):
    async with open_fake_engine(config(0.0)) as (engine, _):
        got = await collect(engine, 30)
    assert [out.num_tokens for _, out in got] == [1] * 30


async def test_pacing_merges_steps_between_wakeups(autojump_clock):
    async with open_fake_engine(config(0.030)) as (engine, _):
        start = trio.current_time()
        got = await collect(engine, 40)
    times = [t for t, _ in got]
    counts = [out.num_tokens for _, out in got]
    assert sum(counts) == 40 and got[-1][1].finish_reason == "length"
    # The first token is not delayed: exactly the sim's time to first token.
    assert counts[0] == 1 and abs(times[0] - start - 0.020) < 1e-9
    # In between, wakeups are at least the interval apart and carry the steps in between
    # (30 ms at 8 ms a step: 3 or 4 tokens each, never 1).
    for a, b in zip(times[1:-1], times[2:-1]):
        assert b - a >= 0.030 - 1e-9
    assert set(counts[1:-1]) <= {3, 4}, counts
    # The last output is not held back for the interval.
    assert abs(times[-1] - start - (0.020 + 39 * 0.008)) < 1e-9


async def test_paced_wakeups_carry_whole_engine_steps(autojump_clock):
    # 20 ms interval, 8 ms steps: a consumer due at 20 ms after its last wakeup is woken by
    # the step at 24 ms, with 3 tokens, every time (not by a timer at 20 ms with 2).
    async with open_fake_engine(config(0.020)) as (engine, _):
        got = await collect(engine, 1 + 3 * 20)
    counts = [out.num_tokens for _, out in got]
    assert counts == [1] + [3] * 20, counts


async def stalled_after_three(busy: float) -> list:
    """(time, tokens) of the outputs of a request that stalls after 3 tokens (at 20, 28 and
    36 ms), with a 30 ms interval and a consumer busy for ``busy`` s after each output."""
    params = server.SamplingParams(max_tokens=100, extra={"fault": {"kind": "stall", "after": 3}})
    async with open_fake_engine(config(0.030, faults=True)) as (engine, _):
        start = trio.current_time()
        got = []
        async with engine.generate("x", params) as stream:
            async for out in stream:
                got.append((trio.current_time() - start, out.num_tokens))
                if sum(n for _, n in got) == 3:
                    break
                await trio.sleep(busy)
    return got


@pytest.mark.parametrize("busy", [0.0, 0.020])
async def test_deferred_text_goes_out_when_the_engine_goes_quiet(autojump_clock, busy):
    # After the first token (20 ms) the request stalls once two more have come: no frame
    # will wake the consumer, due at 20 + 30 = 50 ms. The text goes out by time, one
    # interval after that (80 ms). busy: the consumer comes back at 40 ms, finds text not
    # due yet and defers itself while the router already waits for a frame that will not
    # come; the text must still go out by 80 ms (not at the next heartbeat).
    got = await stalled_after_three(busy)
    assert got[0] == (0.020, 1)
    when, count = got[1]
    assert count == 2 and 0.050 <= when <= 0.080 + 1e-9, got


async def test_a_busy_consumer_is_paced_too(autojump_clock):
    # The consumer spends 5 ms per output: news keeps arriving while it is busy, and must
    # still wait for its interval instead of going out at once.
    async with open_fake_engine(config(0.030)) as (engine, _):
        got = await collect(engine, 40, slow_consumer=0.005)
    times = [t for t, _ in got]
    for a, b in zip(times[1:-1], times[2:-1]):
        assert b - a >= 0.030 - 1e-9
    assert sum(out.num_tokens for _, out in got) == 40


async def test_a_paced_stream_still_ends_promptly_on_abort_and_errors(autojump_clock):
    cfg = config(0.5, faults=True)
    async with open_fake_engine(cfg) as (engine, _):
        params = server.SamplingParams(max_tokens=100, extra={"fault": {"kind": "error", "after": 3}})
        start = trio.current_time()
        outs = []
        async with engine.generate("x", params, errors_as_outputs=True) as stream:
            async for out in stream:
                outs.append((trio.current_time() - start, out))
        # The error comes 2 steps after the first token, well inside the 0.5 s interval,
        # and is delivered at once, with the text merged before it.
        when, last = outs[-1]
        assert last.finish_reason == "error" and when < 0.1
        assert sum(o.num_tokens for _, o in outs) == 3

        async with engine.generate("y", server.SamplingParams(max_tokens=1000)) as stream:
            async for out in stream:
                if out.completion_tokens == 1:
                    aborted_at = trio.current_time()
                    stream.abort()
            assert out.finish_reason == "abort"
            assert trio.current_time() - aborted_at < 0.1


async def test_the_server_defaults_to_an_event_per_engine_step(autojump_clock):
    """``python -m server`` without ``--stream-interval-ms``: a client that keeps up gets
    one output per engine step (the anchors' granularity), not tokens held back. The CLI's
    own engine config, on the in-memory sim in virtual time (a real process on a busy
    machine merges steps whenever the consumer falls behind, which says nothing)."""
    from server.cli import build_parser, config_from_args

    cli = config_from_args(build_parser().parse_args(["--sim-itl-ms", "10"])).engine
    assert cli.stream_interval == 0.0
    async with open_fake_engine(cli) as (engine, _):
        got = await collect(engine, 20)
    assert [out.num_tokens for _, out in got] == [1] * 20


async def first_outputs(interval: float, streams: int = 48) -> list[float]:
    """When each of ``streams`` requests, started 3 ms apart while the earlier ones stream
    (paced or not), got its first output, from its own start."""
    firsts = [0.0] * streams
    async with open_fake_engine(config(interval, max_batch=streams)) as (engine, _):

        async def one(i: int) -> None:
            await trio.sleep(0.003 * i)
            start = trio.current_time()
            params = server.SamplingParams(max_tokens=60)
            async with engine.generate(f"p{i}", params) as stream:
                async for _ in stream:
                    if not firsts[i]:
                        firsts[i] = round(trio.current_time() - start, 6)

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
    return firsts


async def test_pacing_never_holds_a_first_output(autojump_clock):
    # Issue 25 item 7: with 47 other streams paced around it, every stream's first output
    # comes exactly when it does without pacing (the engine's own time to first token).
    paced = await first_outputs(0.020)
    unpaced = await first_outputs(0.0)
    assert all(t > 0 for t in paced)
    assert paced == unpaced, (paced, unpaced)
