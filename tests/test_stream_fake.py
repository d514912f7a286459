"""The request manager, structured cancellation and worker supervision, over in-memory
workers (tests/fakes.py) under ``autojump_clock``: virtual time, so every timing below is
exact and the whole file runs in well under a second of real time.

Each test that opens an engine ends (on success) with the invariants checked by
``open_fake_engine``: no stream or outstanding choice in the manager, nothing running or
waiting in any worker, and every worker process exited with the engine.
"""

from __future__ import annotations

import gc

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings

import server
from server import SamplingParams
from server.manager.worker import WorkerStartupError
from server.worker_protocol import wire
from tests import fakes as scenarios
from server.testing import open_in_memory_engine
from tests import frames
from tests.fakes import (
    all_outputs,
    assert_engine_idle,
    fault,
    open_fake_engine,
    open_fake_spawner,
    sim_config,
    sim_reference,
    track_request_objects,
    wait_for,
)

LONG = SamplingParams(max_tokens=1000)


def approx(x):
    return pytest.approx(x, abs=1e-6)


async def collect(stream, on_output=None) -> list[tuple[float, server.RequestOutput]]:
    """``(time, output)`` for every output of ``stream``; ``on_output(list)`` after each."""
    got = []
    try:
        async for out in stream:
            got.append((trio.current_time(), out))
            if on_output is not None:
                on_output(got)
    except server.ServerError as exc:  # a failed request: its last output is exc.output
        got.append((trio.current_time(), exc.output))
    return got


# ------------------------------------------------------------------------------------------
# 1. Cancelling the consumer: one abort, at once, from a shielded and bounded cleanup
# ------------------------------------------------------------------------------------------


async def test_cancelling_the_consumer_sends_exactly_one_abort_at_once(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        stream = engine.generate("hello", LONG)
        got = []
        with trio.CancelScope() as scope:
            async for out in stream:
                got.append(out)
                if len(got) == 3:
                    scope.cancel()
                    cancelled_at = trio.current_time()
        ended_at = trio.current_time()
        assert scope.cancelled_caught
        [rid] = spawn.rids()
        assert spawn.aborts(rid) == 1
        [abort] = spawn.messages(wire.ABORT)
        assert abort.time == cancelled_at  # no (virtual) time passed: nothing waited
        # the worker confirmed at once, so the cleanup did not wait for the deadline
        last_time, last = spawn.outputs_for(rid)[-1]
        assert last[3] == "abort" and last_time == cancelled_at
        assert ended_at == cancelled_at
        assert stream.finished
        assert engine.statistics().open_streams == 0
        del stream
        await trio.sleep(5)  # and nothing more is sent for it later
        assert spawn.aborts() == 1


async def test_cancel_while_the_body_is_elsewhere_aborts_on_exit(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        with trio.move_on_after(0.5) as scope:
            async with engine.generate("hi", LONG) as stream:
                async for _ in stream:
                    await trio.sleep(0.1)  # cancelled here, outside the stream
        assert scope.cancelled_caught
        assert trio.current_time() == approx(0.5)
        assert spawn.aborts(spawn.rids()[0]) == 1
        assert stream.finished


async def test_cancel_while_waiting_for_the_first_output(autojump_clock):
    async with open_fake_engine(ttft_ms=5000) as (engine, spawn):
        with trio.move_on_after(1.0):
            async with engine.generate("hi", LONG) as stream:
                await stream.wait_started()
        assert trio.current_time() == approx(1.0)
        assert spawn.aborts(spawn.rids()[0]) == 1


async def test_cancel_before_the_worker_saw_the_request(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        with trio.CancelScope() as scope:
            scope.cancel()
            async with engine.generate("hi", LONG) as stream:
                async for _ in stream:
                    pass
        # SUBMIT and ABORT go out together, in order; the worker drops the request
        assert [f.msg[0] for f in spawn.received if f.msg[0] != wire.PING] == [
            wire.SUBMIT, wire.ABORT,
        ]
        assert stream.finished


async def test_cleanup_is_shielded_and_bounded_even_when_cancelled_again(autojump_clock):
    """The worker ignores the abort, so the cleanup waits for the drain deadline; the owner
    is cancelled again 0.1 s into it, and the cleanup still runs to its end, no longer."""
    params = SamplingParams(max_tokens=300, extra=fault("ignore_abort"))
    async with open_fake_engine(drain_timeout=1.0) as (engine, spawn):
        stream = engine.generate("hello", params)
        cancelled_at = None

        async def cancel_at(scope, when):
            await trio.sleep_until(when)
            scope.cancel()

        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as outer:
                with trio.CancelScope() as inner:
                    async for out in stream:
                        if cancelled_at is None and out.completion_tokens >= 2:
                            cancelled_at = trio.current_time()
                            inner.cancel()
                            nursery.start_soon(cancel_at, outer, cancelled_at + 0.1)
            ended_at = trio.current_time()
            assert outer.cancelled_caught
        assert ended_at == approx(cancelled_at + 1.0)  # shielded: ran to the deadline
        rid = spawn.rids()[0]
        assert spawn.aborts(rid) == 1
        stats = engine.statistics()
        assert (stats.open_streams, stats.outstanding) == (0, 0)  # cut off and freed
        assert stream.finished
        # the worker runs on and its late output is dropped without harm
        await assert_engine_idle(engine, settle=10)
        late = [t for t, _ in spawn.outputs_for(rid) if t > ended_at]
        assert late
        assert spawn.outputs_for(rid)[-1][1][3] == "length"
        assert spawn.aborts(rid) == 1


# ------------------------------------------------------------------------------------------
# 2. Server-side abort: drain until the deadline, then cut off
# ------------------------------------------------------------------------------------------


async def test_server_abort_drains_what_was_produced(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate("hi", LONG) as stream:
            first = await stream.__anext__()
            await trio.sleep(0.095)  # tokens pile up in the pending slot meanwhile
            stream.abort()
            rest = await all_outputs(stream)
        rid = spawn.rids()[0]
        assert spawn.aborts(rid) == 1
        # the pending output drained (merged), then the stream ended with the confirmation
        assert [(o.num_tokens, o.finish_reason) for o in rest] == [(9, None), (0, "abort")]
        assert rest[-1].error is None
        sent = spawn.outputs_for(rid)
        assert first.text + "".join(o.text for o in rest) == "".join(o[1] for _, o in sent)
        assert rest[-1].completion_tokens == sum(o[2] for _, o in sent) == 10


async def test_server_abort_from_another_task_ends_when_the_worker_confirms(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate("hi", LONG) as stream:
            async with trio.open_nursery() as nursery:
                async def abort_later():
                    await trio.sleep(0.5)
                    stream.abort()

                nursery.start_soon(abort_later)
                got = await collect(stream)
        assert got[-1][1].finish_reason == "abort"
        assert got[-1][0] == approx(0.5)
        assert spawn.aborts() == 1


async def test_server_abort_cuts_off_a_worker_that_ignores_it(autojump_clock):
    params = SamplingParams(max_tokens=500, extra=fault("ignore_abort"))
    async with open_fake_engine(drain_timeout=1.0) as (engine, spawn):
        aborted_at = None

        def abort_at_third(got):
            nonlocal aborted_at
            if len(got) == 3:
                stream.abort()
                aborted_at = trio.current_time()

        async with engine.generate("hi", params) as stream:
            got = await collect(stream, abort_at_third)
        ended_at, last = got[-1]
        assert last.finish_reason == "abort" and last.error is None
        assert ended_at == approx(aborted_at + 1.0)
        assert all(o.finish_reason is None for _, o in got[:-1])
        assert len(got) > 50  # the output produced meanwhile kept draining
        stats = engine.statistics()
        assert (stats.open_streams, stats.outstanding) == (0, 0)
        rid = spawn.rids()[0]
        assert spawn.aborts(rid) == 1
        # the worker's late output is dropped harmlessly; it finishes on its own
        await assert_engine_idle(engine, settle=10)
        sent = spawn.outputs_for(rid)
        assert any(t > ended_at for t, _ in sent)
        delivered = "".join(o.text for _, o in got)
        assert "".join(o[1] for _, o in sent).startswith(delivered)
        assert delivered.startswith("".join(o[1] for t, o in sent if t < ended_at - 0.011))
        assert spawn.aborts(rid) == 1


async def test_server_abort_is_bounded_while_the_consumer_waits(autojump_clock):
    # a long TTFT and a worker that ignores the abort: nothing arrives before the deadline
    params = SamplingParams(max_tokens=5, extra=fault("ignore_abort"))
    async with open_fake_engine(ttft_ms=5000, drain_timeout=1.0) as (engine, spawn):
        async with engine.generate("hi", params) as stream:
            async with trio.open_nursery() as nursery:
                async def abort_later():
                    await trio.sleep(0.1)
                    stream.abort()

                nursery.start_soon(abort_later)
                got = await collect(stream)
        assert got[-1][1].finish_reason == "abort"
        assert got[-1][0] == approx(1.1)
        await assert_engine_idle(engine, settle=10)


async def test_abort_all_is_bounded_by_the_drain_timeout(autojump_clock):
    params = SamplingParams(max_tokens=5, extra=fault("ignore_abort"))
    async with open_fake_engine(ttft_ms=5000, drain_timeout=1.0) as (engine, spawn):
        ends = []

        async def consume(stream):
            async with stream:
                got = await collect(stream)
            ends.append((got[-1][0], got[-1][1].finish_reason))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(consume, engine.generate("hi", params))
            await trio.sleep(0.1)
            assert engine.abort_all() == 3
        assert ends == [(approx(1.1), "abort")] * 3
        await assert_engine_idle(engine, settle=10)


async def test_request_timeout_is_enforced_when_the_worker_hangs(autojump_clock):
    params = SamplingParams(max_tokens=50, extra=fault("hang", 1))
    async with open_fake_engine(drain_timeout=1.0, heartbeat_timeout=10.0) as (engine, spawn):
        async with engine.generate("a", params, timeout=2.0) as stream:
            got = await collect(stream)
        assert (got[-1][0], got[-1][1].finish_reason) == (approx(3.0), "abort")
        assert stream.abort_cause == "timeout"
        await wait_for(lambda: engine.statistics().workers[0].restarts == 1  # the hung one
                       and engine.statistics().workers_alive == 1, timeout=30)  # is replaced


# ------------------------------------------------------------------------------------------
# 3. No second abort
# ------------------------------------------------------------------------------------------


async def test_no_abort_for_a_request_that_finished(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        stream = engine.generate("hi", SamplingParams(max_tokens=4))
        got = await collect(stream)
        assert got[-1][1].finish_reason == "length"
        stream.abort()
        await stream.aclose()
        with trio.CancelScope() as scope:
            scope.cancel()
            async with stream:
                async for _ in stream:
                    pass
        assert spawn.aborts() == 0


async def test_no_abort_for_a_finished_request_whose_output_was_not_read(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        stream = engine.generate("hi", SamplingParams(max_tokens=4))
        await trio.sleep(1)  # finished in the worker; the consumer has not looked
        assert stream.finished
        with trio.CancelScope() as scope:
            scope.cancel()
            async for _ in stream:  # cancelled with the output still pending
                pass
        assert spawn.aborts() == 0


async def test_no_abort_for_the_choices_of_a_batch_that_finished(autojump_clock):
    # no max_tokens, ignore_eos: each prompt gets what fits in 64 tokens, so the long one
    # ends first (without ignore_eos the sim would end each at its end of sequence)
    prompts = ["a", "x " * 60]
    fits = SamplingParams(max_tokens=None, ignore_eos=True)
    async with open_fake_engine(max_model_len=64) as (engine, spawn):
        with trio.move_on_after(0.2):
            async with engine.generate_many(prompts, fits) as s:
                async for _ in s:
                    pass
        short, long = spawn.rids()
        assert spawn.outputs_for(long)[-1][1][3] == "length"
        assert (spawn.aborts(short), spawn.aborts(long)) == (1, 0)


async def test_no_second_abort_after_a_server_abort(autojump_clock):
    params = SamplingParams(max_tokens=300, extra=fault("ignore_abort"))
    async with open_fake_engine() as (engine, spawn):
        with trio.move_on_after(0.5):
            async with engine.generate("hi", params) as stream:
                await stream.__anext__()
                stream.abort()
                stream.abort()
                async for _ in stream:  # draining, then cancelled: aclose sends nothing
                    pass
        assert spawn.aborts() == 1
        del stream
        await assert_engine_idle(engine, settle=10)
        assert spawn.aborts() == 1


async def test_dropped_stream_is_aborted_once(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        stream = engine.generate("hi", LONG)
        await stream.__anext__()
        del stream  # no aclose: the safety net in __del__ aborts it
        await trio.sleep(1)
        assert spawn.aborts() == 1
        assert engine.statistics().open_streams == 0


# ------------------------------------------------------------------------------------------
# 4. Batches and n > 1
# ------------------------------------------------------------------------------------------

PROMPTS = ["one", "two words", "three more words"]


async def test_batch_with_n_delivers_everything_even_if_finished_before_the_first_look(
    autojump_clock,
):
    params = SamplingParams(n=2, max_tokens=4, seed=11)
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate_many(PROMPTS, params) as stream:
            assert stream.choices == 6
            await trio.sleep(1)  # every sub-request finishes before the consumer looks
            assert stream.finished
            outs = await all_outputs(stream)
        # one merged output per choice, each carrying its whole text
        assert sorted(o.index for o in outs) == list(range(6))
        for o in outs:
            p, i = divmod(o.index, 2)
            text, ntok, finish = sim_reference(PROMPTS[p], params, i)
            assert (o.text, o.num_tokens, o.completion_tokens, o.finish_reason) == (
                text, ntok, ntok, finish,
            )
            assert o.prompt_tokens == len(PROMPTS[p].split())
        # on the wire: sub-request p * n + i is prompt p with seed + i
        assert [(f.msg[2], f.msg[3]["seed"]) for f in spawn.submits()] == [
            (PROMPTS[p], 11 + i) for p in range(3) for i in range(2)
        ]


async def test_batch_with_n_streams_each_choice_by_index(autojump_clock):
    params = SamplingParams(n=3, max_tokens=6, seed=2, stop=["o"])
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate_many(PROMPTS, params) as stream:
            texts: dict[int, str] = {}
            finished: dict[int, str] = {}
            async for out in stream:
                assert out.index not in finished  # nothing after a choice's last output
                texts[out.index] = texts.get(out.index, "") + out.text
                if out.finish_reason:
                    finished[out.index] = out.finish_reason
        assert sorted(finished) == list(range(9))
        for index, text in texts.items():
            p, i = divmod(index, 3)
            ref_text, _, ref_finish = sim_reference(PROMPTS[p], params, i)
            assert (text, finished[index]) == (ref_text, ref_finish)


async def test_next_batch_takes_every_ready_choice_together(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate_many(PROMPTS, SamplingParams(max_tokens=3)) as stream:
            await trio.sleep(1)  # every choice finished meanwhile
            outs = await stream.next_batch()
            assert sorted(o.index for o in outs) == [0, 1, 2]
            assert all(o.finish_reason == "length" and o.num_tokens == 3 for o in outs)
            assert await stream.next_batch() == []
        # A failed choice in a batch raises the request's error, as ``async for`` does.
        params = SamplingParams(max_tokens=5, n=2, extra=fault("error", 2))
        async with engine.generate("a", params) as stream:
            with pytest.raises(server.EngineError) as info:
                while await stream.next_batch():
                    await trio.sleep(1)  # let both choices fail before the next batch
            assert info.value.output.finish_reason == "error"
        assert spawn.aborts() == 0


async def test_take_ready_nowait_returns_every_ready_choice(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate_many(PROMPTS, SamplingParams(max_tokens=3)) as stream:
            assert stream.take_ready_nowait() == []
            await trio.sleep(1)
            outs = stream.take_ready_nowait()
            assert sorted(o.index for o in outs) == [0, 1, 2]
            assert all(o.finish_reason == "length" and o.num_tokens == 3 for o in outs)
            assert await all_outputs(stream) == []


# ------------------------------------------------------------------------------------------
# 5. End of stream is a value: freed by reference counting alone
# ------------------------------------------------------------------------------------------


SCENARIOS = [
    scenarios.finished,
    scenarios.cancelled,
    scenarios.failed,
    scenarios.rejected,
    scenarios.cut_off,
    scenarios.dropped,
]


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_request_objects_are_freed_by_refcounting(autojump_clock, monkeypatch, scenario):
    tracker = track_request_objects(monkeypatch)
    async with open_fake_engine() as (engine, spawn):
        gc.disable()
        try:
            mark = len(tracker.created)
            ref = await scenario(engine)
            end = len(tracker.created)
            assert end - mark >= 2  # at least a choice and a waker were made
            await trio.sleep(1)
            await assert_engine_idle(engine, settle=10)  # the worker is done with it
            assert ref() is None, "the stream outlived its request"
            # The router task's frame holds the last choice it routed until it routes
            # another output (see test_request_objects_are_freed_at_once); let it.
            await scenarios.one_more_request(engine)
            assert [o for o in (r() for r in tracker.created[mark:end]) if o is not None] == []
        finally:
            gc.enable()


async def test_request_objects_are_freed_at_once(autojump_clock, monkeypatch):
    tracker = track_request_objects(monkeypatch)
    async with open_fake_engine() as (engine, spawn):
        gc.disable()
        try:
            ref = await scenarios.finished(engine)
            assert ref() is None
            assert tracker.live() == {"choices": 0, "wakers": 0, "outputs": 0}
        finally:
            gc.enable()


# ------------------------------------------------------------------------------------------
# 6. Errors: terminal outputs mid-stream; distinguishable before the first output
# ------------------------------------------------------------------------------------------


async def test_engine_error_mid_stream_raises_from_the_loop(autojump_clock):
    params = SamplingParams(max_tokens=50, extra=fault("error", 3))
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate("a b c", params) as stream:
            assert await stream.wait_started() == [3]
            outs = []
            with pytest.raises(server.EngineError, match="injected engine failure") as info:
                async for out in stream:
                    outs.append(out)
        assert [o.num_tokens for o in outs] == [1, 1, 1]
        last = info.value.output
        assert (last.finish_reason, last.error_kind, last.error) == (
            "error", "engine_error", "injected engine failure",
        )
        assert last.completion_tokens == 3 and last.num_tokens == 0
        assert spawn.aborts() == 0
        # The HTTP layer's view: the error is a terminal output.
        async with engine.generate("a b c", params, errors_as_outputs=True) as stream:
            outs = [out async for out in stream]  # no exception
        assert [o.num_tokens for o in outs] == [1, 1, 1, 0]
        assert outs[-1].finish_reason == "error"
        assert isinstance(outs[-1].exception(), server.EngineError)


async def test_rejected_request_raises_client_error(autojump_clock):
    async with open_fake_engine(max_model_len=16) as (engine, spawn):
        stream = engine.generate("one two three four five", SamplingParams(max_tokens=12))
        with pytest.raises(server.ClientError, match="maximum context length is 16") as info:
            await stream.wait_started()
        assert not isinstance(info.value, server.EngineError)
        assert info.value.status == 400
        assert engine.statistics().open_streams == 0  # closed by wait_started
        assert spawn.aborts() == 0
        # Iterated instead (a library user's loop), the rejection raises too: never an
        # empty loop.
        outs = []
        with pytest.raises(server.ClientError, match="maximum context length") as info:
            async with engine.generate("one two three four five",
                                       SamplingParams(max_tokens=12)) as stream:
                async for out in stream:
                    outs.append(out)
        assert outs == [] and info.value.output.error_kind == "invalid_request"
        assert engine.statistics().open_streams == 0


async def test_engine_failure_before_any_output_raises_engine_error(autojump_clock):
    params = SamplingParams(max_tokens=5, extra=fault("error", 0))
    async with open_fake_engine() as (engine, spawn):
        stream = engine.generate("a b", params)
        with pytest.raises(server.EngineError, match="injected engine failure") as info:
            await stream.wait_started()
        assert not isinstance(info.value, server.ClientError)
        assert engine.statistics().open_streams == 0


async def test_worker_death_before_any_output_raises_worker_died(autojump_clock):
    params = SamplingParams(max_tokens=5, extra=fault("crash", 0))
    async with open_fake_engine() as (engine, spawn):
        stream = engine.generate("a b", params)
        with pytest.raises(server.WorkerDied):
            await stream.wait_started()
        await wait_for(lambda: engine.statistics().workers_alive == 1)


async def test_one_rejected_prompt_in_a_batch_fails_the_request_and_aborts_the_rest(
    autojump_clock,
):
    async with open_fake_engine(max_model_len=16) as (engine, spawn):
        stream = engine.generate_many(["ok", "x " * 20, "fine"], SamplingParams(max_tokens=8))
        with pytest.raises(server.ClientError):
            await stream.wait_started()
        rids = spawn.rids()
        assert [spawn.aborts(rid) for rid in rids] == [1, 0, 1]


# ------------------------------------------------------------------------------------------
# 7. Worker death, hangs and restarts
# ------------------------------------------------------------------------------------------


async def _run_three(engine, crashing: SamplingParams):
    """Three concurrent requests on one worker, the first with ``crashing`` params."""
    results: dict[str, list] = {}

    async def consume(name, params):
        async with engine.generate(name, params) as stream:
            results[name] = await collect(stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "a", crashing)
        nursery.start_soon(consume, "b", LONG)
        nursery.start_soon(consume, "c", LONG)
    return results


def _assert_all_died_at(results, when):
    for name, got in results.items():
        t, last = got[-1]
        assert (last.finish_reason, last.error_kind) == ("error", "worker_died"), name
        assert "engine worker 0 failed" in last.error
        assert isinstance(last.exception(), server.WorkerDied)
        assert t == approx(when), name


async def _assert_restarted(engine, spawn, count: int = 1):
    await wait_for(lambda: engine.statistics().workers[0].restarts == count
                   and engine.statistics().workers_alive == 1, timeout=30)
    async with engine.generate("again", SamplingParams(max_tokens=3)) as stream:
        outs = await all_outputs(stream)
    assert outs[-1].finish_reason == "length"
    assert len(spawn.processes) == count + 1


async def test_worker_crash_ends_every_request_and_the_worker_restarts(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        results = await _run_three(engine, SamplingParams(max_tokens=50,
                                                          extra=fault("crash", 3)))
        crashed_at = spawn.processes[0]
        assert crashed_at.returncode == 17
        last_output = max(f.time for f in spawn.sent if f.msg[0] == wire.STEP)
        _assert_all_died_at(results, last_output + 0.010)  # the step that crashed
        assert engine.statistics().outstanding == 0
        await _assert_restarted(engine, spawn)


async def test_killed_worker_ends_every_request_and_the_worker_restarts(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        async with trio.open_nursery() as nursery:
            async def kill_later():
                await trio.sleep(0.25)
                spawn.processes[0].kill()

            nursery.start_soon(kill_later)
            results = await _run_three(engine, LONG)
        assert spawn.processes[0].returncode == -9
        _assert_all_died_at(results, 0.25)
        await _assert_restarted(engine, spawn)


async def test_hung_worker_is_detected_stopped_and_replaced(autojump_clock):
    config = sim_config(heartbeat_interval=1.0, heartbeat_timeout=10.0, shutdown_grace=2.0)
    async with open_fake_engine(config) as (engine, spawn):
        results = await _run_three(engine, SamplingParams(max_tokens=50,
                                                          extra=fault("hang", 3)))
        for got in results.values():
            t, last = got[-1]
            assert last.error_kind == "worker_died" and "hung" in last.error
            assert 10.0 < t <= 11.1  # silent for heartbeat_timeout, noticed on a heartbeat
        hung = spawn.processes[0]
        # the pipe was closed (a hung worker does not notice), then SIGTERM after the grace
        await wait_for(lambda: hung.exited)
        assert hung.signals == ["SIGTERM"] and hung.returncode == -15
        await _assert_restarted(engine, spawn)


async def test_worker_that_ignores_sigterm_is_killed(autojump_clock):
    config = sim_config(heartbeat_timeout=3.0, shutdown_grace=0.5)
    async with open_fake_engine(config, spawner_kw={"ignore_terminate": True}) as (engine,
                                                                                  spawn):
        async with engine.generate("a", SamplingParams(max_tokens=50,
                                                       extra=fault("hang", 1))) as stream:
            outs = await all_outputs(stream)
        assert outs[-1].error_kind == "worker_died"
        ended = trio.current_time()
        hung = spawn.processes[0]
        await wait_for(lambda: hung.exited)
        assert hung.signals == ["SIGTERM", "SIGKILL"] and hung.returncode == -9
        assert hung.exit_time == approx(ended + 1.0)  # two grace periods
        await _assert_restarted(engine, spawn)


@pytest.mark.parametrize("how", ["inject", "fault"])
async def test_protocol_violation_by_the_worker_ends_its_session(autojump_clock, how):
    params = LONG if how == "inject" else SamplingParams(max_tokens=50,
                                                          extra=fault("garbage", 2))
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate("a", params) as stream:
            await stream.__anext__()
            if how == "inject":
                await spawn.processes[0].inject(b"\x00\x00\x00\x01\xc1")
            outs = await all_outputs(stream)
        assert outs[-1].error_kind == "worker_died" and "protocol violation" in outs[-1].error
        await _assert_restarted(engine, spawn)
        assert spawn.processes[0].exited  # stopped, though it never read its closed pipe


async def test_past_max_restarts_the_worker_is_retried_at_the_capped_backoff(autojump_clock):
    config = sim_config(max_restarts=2, restart_backoff=0.1, restart_window=60.0)
    async with open_fake_engine(config) as (engine, spawn):
        spawn.fail_next_starts = 4
        spawn.processes[0].kill()
        await wait_for(lambda: engine.statistics().workers[0].over_budget, timeout=30)
        stats = engine.statistics()
        assert stats.workers_alive == 0 and stats.workers[0].restarts == 2
        assert len(spawn.processes) == 3  # the first, then two restarts that failed
        with pytest.raises(server.ServiceUnavailable):
            engine.generate("a")
        assert engine.statistics().open_streams == 0
        # not left down: retried at the cap until a start succeeds
        await wait_for(lambda: engine.statistics().workers_alive == 1, timeout=60)
        assert len(spawn.processes) == 6  # the first, four that failed, the one that is up
        assert engine.statistics().workers[0].over_budget  # (until it lived 60 s)
        async with engine.generate("again", SamplingParams(max_tokens=3)) as stream:
            assert [o async for o in stream][-1].finish_reason == "length"
        await trio.sleep(60)
        assert not engine.statistics().workers[0].over_budget


async def test_a_failed_respawn_is_a_failed_restart(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        spawn.fail_next_spawns = 1
        spawn.processes[0].kill()
        await wait_for(lambda: engine.statistics().workers[0].restarts == 2  # the failed one
                       and engine.statistics().workers_alive == 1, timeout=30)  # counts
        assert len(spawn.processes) == 2
        async with engine.generate("again", SamplingParams(max_tokens=3)) as stream:
            assert [o async for o in stream][-1].finish_reason == "length"


async def test_startup_failure_raises_worker_startup_error(autojump_clock):
    async with open_fake_spawner() as spawn:
        spawn.fail_next_starts = 1
        with pytest.raises(BaseException) as info:
            async with server.open_engine(sim_config(workers=2), spawn=spawn):
                pass  # pragma: no cover
        exc = info.value
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        assert isinstance(exc, WorkerStartupError)
        spawn.assert_all_exited()


async def test_startup_failure_is_not_wrapped(autojump_clock):
    async with open_fake_spawner() as spawn:
        spawn.fail_next_starts = 1
        with pytest.raises(WorkerStartupError):
            async with server.open_engine(sim_config(), spawn=spawn):
                pass  # pragma: no cover


async def test_the_bodys_exception_comes_out_of_open_engine_unwrapped(autojump_clock):
    # except ClientError around the block catches a request's rejection from inside it
    async with open_fake_spawner() as spawn:
        with pytest.raises(server.ClientError, match="maximum context length") as info:
            async with server.open_engine(sim_config(max_model_len=16), spawn=spawn) as engine:
                await engine.generate("one two three", SamplingParams(max_tokens=20)).wait_started()
        assert type(info.value) is server.ClientError
        spawn.assert_all_exited()
    with pytest.raises(server.ClientError, match="maximum context length") as info:
        async with open_in_memory_engine(max_model_len=16) as engine:
            await engine.generate("one two three", SamplingParams(max_tokens=20)).wait_started()
    assert type(info.value) is server.ClientError


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, ValueError])
async def test_an_exception_in_the_body_is_not_grouped(autojump_clock, exc_type):
    with pytest.raises(exc_type) as info:
        async with open_in_memory_engine() as engine:
            async with engine.generate("hi", LONG) as stream:
                async for _ in stream:
                    raise exc_type("from the body")
    assert type(info.value) is exc_type and str(info.value) == "from the body"
    # its context is what it had where it was raised, not the nursery's group
    assert not isinstance(info.value.__context__, BaseExceptionGroup)


async def test_a_background_failure_still_comes_out_grouped():
    from contextlib import asynccontextmanager

    from server.manager.unwrap import body_errors_unwrapped

    @asynccontextmanager
    async def open_service(fail: bool):
        async def background():
            if fail:
                raise RuntimeError("background")
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(background)
            yield
            nursery.cancel_scope.cancel()

    with pytest.raises(BaseExceptionGroup) as info:  # the body was cancelled by the failure
        async with body_errors_unwrapped(open_service(fail=True)):
            await trio.sleep_forever()
    assert [type(e) for e in info.value.exceptions] == [RuntimeError]
    with pytest.raises(BaseExceptionGroup) as info:  # both failed: both come out
        async with body_errors_unwrapped(open_service(fail=True)):
            raise ValueError("body")
    leaves = {type(e) for e in info.value.exceptions}
    assert leaves == {RuntimeError, ValueError}
    with pytest.raises(ValueError):  # only the body failed: itself
        async with body_errors_unwrapped(open_service(fail=False)):
            raise ValueError("body")


async def test_leaving_the_engine_aborts_open_streams(autojump_clock):
    # As a graceful HTTP shutdown does: the workers confirm the aborts at once, and each
    # open choice ends with finish_reason "abort" (not an error).
    async with open_fake_spawner() as spawn:
        got = []

        async def consume(stream):
            async with stream:
                got.extend(await collect(stream))

        async with trio.open_nursery() as nursery:
            async with server.open_engine(sim_config(), spawn=spawn) as engine:
                nursery.start_soon(consume, engine.generate("a", LONG))
                await trio.sleep(0.5)
            left = trio.current_time()
        assert got[-1][1].finish_reason == "abort" and got[-1][1].error_kind is None
        assert got[-1][0] == approx(0.5)
        # The engine left once the worker confirmed, not at its drain timeout (1 s).
        assert left < 0.5 + sim_config().drain_timeout / 2
        assert engine.statistics().open_streams == 0
        spawn.assert_all_exited()


# ------------------------------------------------------------------------------------------
# Dispatch, and harmless no-ops
# ------------------------------------------------------------------------------------------


async def test_dispatch_by_fewest_outstanding_over_two_workers(autojump_clock):
    async with open_fake_engine(workers=2) as (engine, spawn):

        def outstanding():
            return tuple(w.outstanding for w in engine.statistics().workers)

        short = engine.generate("a", SamplingParams(max_tokens=2))  # tie: the first worker
        assert outstanding() == (1, 0)
        b = engine.generate("b", LONG)
        assert outstanding() == (1, 1)
        c = engine.generate_many(["c1", "c2"], LONG)  # a tie again; a batch stays together
        assert outstanding() == (3, 1)
        d = engine.generate("d", LONG)
        e = engine.generate("e", LONG)
        assert outstanding() == (3, 3)
        await collect(short)  # the first worker's load falls to 2
        f = engine.generate("f", LONG)
        assert outstanding() == (3, 3)
        await trio.sleep(0.01)
        pids = [w.pid for w in engine.statistics().workers]
        where = {f.msg[2]: pids.index(f.pid) for f in spawn.submits()}
        assert where == {"a": 0, "b": 1, "c1": 0, "c2": 0, "d": 1, "e": 1, "f": 0}
        for stream in (b, c, d, e, f):
            await stream.aclose()
        assert spawn.aborts() == 6


async def test_abort_of_a_finished_request_is_a_harmless_no_op(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate("a", SamplingParams(max_tokens=3)) as stream:
            async for out in stream:
                if out.finish_reason:
                    stream.abort()  # finished, not yet released
                    break
        stream.abort()  # released
        await stream.aclose()
        stream.abort()
        assert spawn.aborts() == 0
        assert [o async for o in engine.generate("b", SamplingParams(max_tokens=2))][-1] \
            .finish_reason == "length"


async def test_iterating_a_closed_stream_ends(autojump_clock):
    async with open_fake_engine() as (engine, spawn):
        stream = engine.generate("a", LONG)
        await stream.aclose()
        with trio.move_on_after(5) as scope:
            outs = [o async for o in stream]
    assert not scope.cancelled_caught, "still waiting after 5 s"
    assert outs == []


# ------------------------------------------------------------------------------------------
# One consumer at a time; aclose from another task (trio's rules for streams)
# ------------------------------------------------------------------------------------------


async def test_aclose_from_another_task_wakes_the_parked_consumer(autojump_clock):
    # a long TTFT: the consumer is parked when the other task closes the stream
    async with open_fake_engine(ttft_ms=5000) as (engine, spawn):
        stream = engine.generate("hi", LONG)
        raised = []

        async def consume():
            try:
                async for _ in stream:
                    pass  # pragma: no cover
            except trio.ClosedResourceError:
                raised.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.sleep(0.5)
            await stream.aclose()
            closed_at = trio.current_time()
        assert raised == [approx(closed_at)]
        assert spawn.aborts() == 1
        assert [o async for o in stream] == []  # closed: its iteration ends


async def test_aclose_from_another_task_wakes_wait_started(autojump_clock):
    async with open_fake_engine(ttft_ms=5000) as (engine, spawn):
        stream = engine.generate("hi", LONG)
        async with trio.open_nursery() as nursery:
            async def close_later():
                await trio.sleep(0.5)
                await stream.aclose()

            nursery.start_soon(close_later)
            with pytest.raises(trio.ClosedResourceError):
                await stream.wait_started()
        assert trio.current_time() == approx(0.5)
        assert spawn.aborts() == 1


async def test_a_second_task_waiting_on_the_stream_is_busy(autojump_clock):
    async with open_fake_engine(ttft_ms=1000) as (engine, spawn):
        async with engine.generate("hi", SamplingParams(max_tokens=3)) as stream:
            async with trio.open_nursery() as nursery:
                got: list = []

                async def consume():
                    got.extend(await collect(stream))

                nursery.start_soon(consume)
                await trio.sleep(0.1)  # the first consumer is parked
                with pytest.raises(trio.BusyResourceError):
                    await stream.__anext__()
                with pytest.raises(trio.BusyResourceError):
                    await stream.wait_started()
        # the first consumer was not disturbed: it got the whole answer
        assert got[-1][1].finish_reason == "length"
        assert sum(o.num_tokens for _, o in got) == 3
        assert spawn.aborts() == 0


@pytest.mark.parametrize("ignore_abort", [False, True])
async def test_concurrent_acloses_both_end_with_the_close(autojump_clock, ignore_abort):
    # both return when the worker confirms the abort (or at the drain deadline): neither
    # waits in the other's place
    params = SamplingParams(max_tokens=5000, extra=fault("ignore_abort") if ignore_abort else {})
    async with open_fake_engine(drain_timeout=5.0) as (engine, spawn):
        stream = engine.generate("hi", params)
        await stream.wait_started()
        start = trio.current_time()
        done = []

        async def close():
            await stream.aclose()
            done.append(trio.current_time() - start)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close)
            nursery.start_soon(close)
        assert len(done) == 2 and done[0] == done[1]
        assert done[0] == (approx(5.0) if ignore_abort else pytest.approx(0.0, abs=0.05))
        assert spawn.aborts() == 1
        await assert_engine_idle(engine, settle=60)  # a request that ignored its abort


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=frames.replies)
@example(message=[wire.LEAVING, 0.0])  # (drawn now and then: CI met it)
async def test_property_a_frame_from_the_worker_ends_at_most_its_session(autojump_clock,
                                                                          message):
    async with open_fake_engine() as (engine, spawn):
        await engine.ping_all()  # (the worker idles: nothing of its own is on the pipe)
        await spawn.processes[0].inject(wire.encode(message))
        # (LEAVING is well formed but unexpected here: the in-memory worker's session did
        # not subscribe to it, and a topic not asked for is a protocol violation)
        if frames.verdict(wire.check_reply, message) and message[0] != wire.LEAVING:
            await engine.ping_all()  # answered after it: the session went on
            assert engine.statistics().workers[0].restarts == 0
        else:  # the worker is treated as dead: stopped (escalating) and restarted
            await _assert_restarted(engine, spawn)
            assert spawn.processes[0].exited


async def test_rows_before_a_malformed_row_are_delivered_then_the_session_ends(autojump_clock):
    """The router checks a STEP's output rows as it routes them (one pass): the rows before
    a malformed one count, as the messages before a malformed one do; the rest of the
    worker's requests end with worker_died and the worker restarts."""
    async with open_fake_engine() as (engine, spawn):
        async with engine.generate("a", LONG) as a, engine.generate("b", LONG) as b:
            await a.__anext__()
            await b.__anext__()
            rid_a, rid_b = spawn.rids()
            await spawn.processes[0].inject(wire.encode(
                [wire.STEP, [], [[rid_b, "!", 1, "length", None], [rid_a, "?", -1, None, None]]]))
            outs_b = await all_outputs(b)
            outs_a = await all_outputs(a)
        assert (outs_b[-1].finish_reason, outs_b[-1].text.endswith("!")) == ("length", True)
        assert (outs_a[-1].finish_reason, outs_a[-1].error_kind) == ("error", "worker_died")
        await _assert_restarted(engine, spawn)
