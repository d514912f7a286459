"""The properties of tests/test_stream_fake.py again, with real worker processes
(``python -m server.workers``), the real clock and ``trio.fail_after``.

Every frame crossing a worker's pipes is recorded (tests/fakes.py ``RecordingSpawner``), so
abort counts are counted on the wire. Timing bounds are loose on purpose (the machine is
shared): lower bounds come from what the engine cannot do faster (``itl_ms`` is a minimum),
upper bounds are generous. Each test ends with the invariants checked by
``open_real_engine``: nothing in the manager, nothing in the workers, and no worker process
left once the engine has exited.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import sys

import pytest
import trio

import server
from server import SamplingParams
from server.worker_protocol import wire
from tests import fakes as scenarios
from tests.conftest import pid_exists
from tests.fakes import (
    all_outputs,
    assert_engine_idle,
    fault,
    open_real_engine,
    sim_config,
    sim_reference,
    track_request_objects,
    wait_for,
)

FAST = dict(itl_ms=2.0, ttft_ms=2.0, prefill_us_per_token=0.0, drain_timeout=0.5,
            shutdown_grace=1.0)
LONG = SamplingParams(max_tokens=2000)  # at least 4 s at 2 ms a token: never finishes here
LIMIT = 20  # seconds for any one test


def config(**kw) -> server.EngineConfig:
    return sim_config(**{**FAST, **kw})


def abort_confirmed(spawn, rid) -> bool:
    """The worker answered an abort of rid (rather than the stream being cut off)."""
    return any(out[3] == "abort" for _, out in spawn.outputs_for(rid))


# -- 1. cancelling the consumer ----------------------------------------------------------------


async def test_cancelling_the_consumer_sends_exactly_one_abort():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(drain_timeout=5.0)) as (engine, spawn):
            stream = engine.generate("hello", LONG)
            with trio.CancelScope() as scope:
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 3:
                        scope.cancel()
            [rid] = spawn.rids()
            assert spawn.aborts(rid) == 1
            # ended by the worker's confirmation, not by the 5 s drain deadline (how soon is
            # the machine's: no wall-clock bound)
            assert abort_confirmed(spawn, rid)
            assert stream.finished
            await trio.sleep(0.2)
            assert spawn.aborts() == 1


async def test_cleanup_is_shielded_and_bounded_even_when_cancelled_again():
    params = SamplingParams(max_tokens=250, extra=fault("ignore_abort"))
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(drain_timeout=0.2), settle=8) as (engine, spawn):
            stream = engine.generate("hello", params)
            cancelled_at = None

            async def cancel_later(scope):
                await trio.sleep(0.1)
                scope.cancel()

            async with trio.open_nursery() as nursery:
                with trio.CancelScope() as outer:
                    with trio.CancelScope() as inner:
                        async for out in stream:
                            if cancelled_at is None and out.completion_tokens >= 2:
                                cancelled_at = trio.current_time()
                                inner.cancel()
                                nursery.start_soon(cancel_later, outer)
                elapsed = trio.current_time() - cancelled_at
            assert outer.cancelled_caught
            # the worker did not confirm (it ignores aborts), so only the drain deadline
            # (0.2 s) can have ended the shielded cleanup, and not the outer cancel (0.1 s):
            # a causal lower bound (the deadline starts after the cancel); no upper one
            assert elapsed >= 0.2 - 0.01
            rid = spawn.rids()[0]
            assert spawn.aborts(rid) == 1
            assert not abort_confirmed(spawn, rid)
            stats = engine.statistics()
            assert (stats.open_streams, stats.outstanding) == (0, 0)
            assert stream.finished


# -- 2. server-side abort ----------------------------------------------------------------------


async def test_server_abort_drains_then_ends_with_abort():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config()) as (engine, spawn):
            async with engine.generate("hi", LONG) as stream:
                got = []
                async for out in stream:
                    got.append(out)
                    if len(got) == 3:
                        stream.abort()
            rid = spawn.rids()[0]
            assert got[-1].finish_reason == "abort" and got[-1].error is None
            assert all(o.finish_reason is None for o in got[:-1])
            assert spawn.aborts(rid) == 1 and abort_confirmed(spawn, rid)
            sent = spawn.outputs_for(rid)
            assert "".join(o.text for o in got) == "".join(o[1] for _, o in sent)


async def test_server_abort_cuts_off_a_worker_that_ignores_it():
    params = SamplingParams(max_tokens=250, extra=fault("ignore_abort"))
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(drain_timeout=0.2), settle=8) as (engine, spawn):
            async with engine.generate("hi", params) as stream:
                got = []
                async for out in stream:
                    got.append(out)
                    if len(got) == 3:
                        stream.abort()
                        aborted_at = trio.current_time()
                ended_at = trio.current_time()
            assert got[-1].finish_reason == "abort"
            assert ended_at - aborted_at >= 0.2 - 0.01  # the drain deadline, not before
            assert sum(o.num_tokens for o in got[3:]) >= 2  # output kept draining meanwhile
            stats = engine.statistics()
            assert (stats.open_streams, stats.outstanding) == (0, 0)
            rid = spawn.rids()[0]
            assert spawn.aborts(rid) == 1
            # the worker runs on; the router reads and drops its late output
            await assert_engine_idle(engine, settle=8)
            sent = spawn.outputs_for(rid)
            assert any(t > ended_at for t, _ in sent)
            assert sent[-1][1][3] == "length"
            assert "".join(o[1] for _, o in sent).startswith("".join(o.text for o in got))


# -- 3. no second abort ------------------------------------------------------------------------


async def test_no_abort_for_finished_requests_and_one_for_aborted_ones():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(max_model_len=4096)) as (engine, spawn):
            # finished normally, then aborted (harmlessly), closed and cancelled
            async with engine.generate("hi", SamplingParams(max_tokens=4)) as stream:
                async for out in stream:
                    if out.finish_reason:
                        assert out.finish_reason == "length"
                        stream.abort()  # finished, not yet released
            stream.abort()
            await stream.aclose()
            with trio.CancelScope() as scope:
                scope.cancel()
                await stream.aclose()
            # finished in the worker but never read, then cancelled
            unread = engine.generate("hi", SamplingParams(max_tokens=2))
            await wait_for(lambda: unread.finished)
            with trio.CancelScope() as scope:
                scope.cancel()
                async for _ in unread:
                    pass
            assert spawn.aborts() == 0
            async with engine.generate("b", SamplingParams(max_tokens=2)) as stream:
                assert [o async for o in stream][-1].finish_reason == "length"
            # a batch cancelled after one of its choices finished: only the other is aborted
            # (no max_tokens, ignore_eos: each prompt gets what fits in 4096 tokens; without
            # ignore_eos the sim would end each at its end of sequence)
            prompts = ["a", "x " * 4000]
            fits = SamplingParams(max_tokens=None, ignore_eos=True)
            with trio.CancelScope() as scope:
                async with engine.generate_many(prompts, fits) as s:
                    async for _ in s:
                        short, long = spawn.rids()[-2:]  # sent by now
                        if any(o[3] for _, o in spawn.outputs_for(long)):
                            scope.cancel()
            assert spawn.outputs_for(long)[-1][1][3] == "length"
            assert (spawn.aborts(short), spawn.aborts(long)) == (1, 0)
            # aborted twice by the server, then cancelled while draining
            before = spawn.aborts()
            with trio.CancelScope() as draining:
                async with engine.generate("hi", LONG) as stream:
                    await stream.__anext__()
                    # the 0.2 s runs from the first token (a busy machine may take longer
                    # than that to bring it: the aborts must be sent in any case)
                    draining.deadline = trio.current_time() + 0.2
                    stream.abort()
                    stream.abort()
                    async for _ in stream:
                        pass
            assert spawn.aborts() - before == 1


# -- 4. batches and n > 1 ----------------------------------------------------------------------


async def test_batch_with_n_delivers_everything_by_index():
    prompts = ["one", "two words", "three more words"]
    params = SamplingParams(n=2, max_tokens=5, seed=3)
    with trio.fail_after(LIMIT):
        async with open_real_engine(config()) as (engine, spawn):
            async with engine.generate_many(prompts, params) as stream:
                await wait_for(lambda: stream.finished)  # all done before the first look
                outs = await all_outputs(stream)
            assert sorted(o.index for o in outs) == list(range(6))
            for o in outs:
                p, i = divmod(o.index, 2)
                text, ntok, finish = sim_reference(prompts[p], params, i)
                assert (o.text, o.completion_tokens, o.finish_reason) == (text, ntok, finish)
            # and streamed while they run
            async with engine.generate_many(prompts, params) as stream:
                texts: dict[int, str] = {}
                async for out in stream:
                    texts[out.index] = texts.get(out.index, "") + out.text
            assert texts == {
                p * 2 + i: sim_reference(prompts[p], params, i)[0]
                for p in range(3) for i in range(2)
            }


# -- 5. freed by reference counting ------------------------------------------------------------


async def test_request_objects_are_freed_by_refcounting(monkeypatch):
    tracker = track_request_objects(monkeypatch)
    cut_off = functools.partial(scenarios.cut_off, max_tokens=250)  # 0.5 s > 0.2 s drain
    cut_off.__name__ = "cut_off"
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(drain_timeout=0.2), settle=8) as (engine, spawn):
            for scenario in (scenarios.finished, scenarios.cancelled, scenarios.failed,
                             scenarios.rejected, cut_off):
                gc.disable()
                try:
                    mark = len(tracker.created)
                    ref = await scenario(engine)
                    end = len(tracker.created)
                    await assert_engine_idle(engine, settle=8)
                    assert ref() is None, scenario.__name__
                    await scenarios.one_more_request(engine)  # see test_stream_fake.py
                    alive = [r() for r in tracker.created[mark:end]]
                    assert [o for o in alive if o is not None] == [], scenario.__name__
                finally:
                    gc.enable()


async def test_a_worker_freezes_its_startup_heap_before_hello():
    # Its full collections while serving would otherwise walk every object of the libraries
    # and the model (41-81 ms pauses of the step loop in a vllm worker).
    with trio.fail_after(LIMIT):
        async with server.open_engine(config()) as engine:
            assert engine.workers[0].info["gc_frozen"] > 1000


# -- 6. errors ---------------------------------------------------------------------------------


async def test_errors_are_outputs_mid_stream_and_exceptions_before_it():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(max_model_len=16)) as (engine, spawn):
            # mid-stream: a terminal output, never an exception
            params = SamplingParams(max_tokens=10, extra=fault("error", 3))
            async with engine.generate("a b c", params) as stream:
                assert await stream.wait_started() == [3]
                outs = await all_outputs(stream)
            assert sum(o.num_tokens for o in outs) == 3
            assert (outs[-1].finish_reason, outs[-1].error_kind, outs[-1].error) == (
                "error", "engine_error", "injected engine failure",
            )
            # before the first output: the client's fault...
            stream = engine.generate("one two three four five", SamplingParams(max_tokens=12))
            with pytest.raises(server.ClientError, match="maximum context length"):
                await stream.wait_started()
            # ...or the engine's
            stream = engine.generate("a", SamplingParams(max_tokens=5, extra=fault("error", 0)))
            with pytest.raises(server.EngineError) as info:
                await stream.wait_started()
            assert not isinstance(info.value, server.ClientError)
            assert engine.statistics().open_streams == 0
            assert spawn.aborts() == 0


# -- 7. worker death ---------------------------------------------------------------------------


async def _three_requests(engine, first: SamplingParams, during=None):
    results = {}

    async def consume(name, params):
        async with engine.generate(name, params) as stream:
            results[name] = await all_outputs(stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "a", first)
        nursery.start_soon(consume, "b", LONG)
        nursery.start_soon(consume, "c", LONG)
        if during is not None:
            await during()
    return results


async def _signal_after_three(engine, spawn, first: SamplingParams, signum: int):
    """Three requests (:func:`_three_requests`); ``signum`` to the worker once the first
    has three outputs."""
    async def send():
        await wait_for(lambda: len(spawn.outputs_for(1)) >= 3)
        os.kill(engine.statistics().workers[0].pid, signum)

    return await _three_requests(engine, first, send)


async def _check_died_and_restarted(engine, spawn, results, words: str):
    for name, outs in results.items():
        last = outs[-1]
        assert (last.finish_reason, last.error_kind) == ("error", "worker_died"), name
        assert words in last.error, last.error
    first_pid = spawn.processes[0].pid
    await wait_for(lambda: engine.statistics().workers[0].restarts == 1
                   and engine.statistics().workers_alive == 1, timeout=10)
    assert engine.statistics().workers[0].pid != first_pid
    async with engine.generate("again", SamplingParams(max_tokens=3)) as stream:
        assert [o async for o in stream][-1].finish_reason == "length"
    assert spawn.processes[0].returncode is not None


async def test_worker_crash_ends_every_request_and_the_worker_restarts():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config()) as (engine, spawn):
            crash = SamplingParams(max_tokens=100, extra=fault("crash", 3))
            results = await _three_requests(engine, crash)
            # every request ended by the crash (worker_died), none by its length
            await _check_died_and_restarted(engine, spawn, results, "exited")
            assert spawn.processes[0].returncode == 17


async def test_sigkilled_worker_ends_every_request_and_the_worker_restarts():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config()) as (engine, spawn):
            results = await _signal_after_three(engine, spawn, LONG, signal.SIGKILL)
            await _check_died_and_restarted(engine, spawn, results, "exited")
            assert spawn.processes[0].returncode == -signal.SIGKILL


async def test_a_sigkilled_worker_leaves_no_process_it_started(tmp_path):
    """What a worker starts (vLLM's engine core) stays in the worker's process group, which
    the frontend kills once the worker is gone: here a ``sleep`` the worker's interpreter
    wrapper leaves behind, as a process without a parent-death signal of its own."""
    pids = tmp_path / "pids"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nsleep 600 </dev/null >/dev/null 2>&1 &\necho $! >> {pids}\n"
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(python=str(python))) as (engine, spawn):
            (first,) = map(int, pids.read_text().split())
            assert pid_exists(first)
            os.kill(engine.statistics().workers[0].pid, signal.SIGKILL)
            await wait_for(lambda: not pid_exists(first), timeout=10)
            await wait_for(lambda: engine.statistics().workers[0].restarts == 1
                           and engine.statistics().workers_alive == 1, timeout=10)
            second = int(pids.read_text().split()[1])
            assert pid_exists(second)
        # a worker stopped at the end (its pipe closed) takes its leftovers with it too
        await wait_for(lambda: not pid_exists(second), timeout=10)


@pytest.mark.parametrize("kind", ["hang", "stuck_step"])
async def test_hung_worker_is_detected_stopped_and_replaced(kind):
    """``hang``: the loop stops outside a step; ``stuck_step``: a step blocks for ever
    without computing (a deadlock), which the worker's pulse does not speak for."""
    cfg = config(heartbeat_interval=0.1, heartbeat_timeout=0.5, shutdown_grace=0.3)
    with trio.fail_after(LIMIT):
        async with open_real_engine(cfg) as (engine, spawn):
            hang = SamplingParams(max_tokens=100, extra=fault(kind, 3))
            results = await _three_requests(engine, hang)
            await _check_died_and_restarted(engine, spawn, results, "hung")
            # it did not read its closed pipe: SIGTERM ended it
            assert spawn.processes[0].returncode == -signal.SIGTERM


# -- busy is not hung (server.workers.pulse) ---------------------------------------------------

#: A ping (and pulse) period of 0.2 s against a 3 s timeout: a pulse is late by more than
#: 2.8 s only on a machine too loaded for any test here.
PATIENT = config(heartbeat_interval=0.2, heartbeat_timeout=3.0, shutdown_grace=0.3)


async def test_a_step_longer_than_the_heartbeat_timeout_is_not_hung():
    """One step computes for three heartbeat timeouts: the worker's pulse speaks for it
    (unasked PONGs), so it is not killed and every stream it holds finishes."""
    ten = SamplingParams(max_tokens=10)
    slow = SamplingParams(max_tokens=10, extra=fault("slow_step", 3, seconds=9.0))
    with trio.fail_after(3 * LIMIT):
        async with open_real_engine(PATIENT) as (engine, spawn):
            results = {}

            async def consume(name, params):
                async with engine.generate(name, params) as stream:
                    results[name] = await all_outputs(stream)

            async with trio.open_nursery() as nursery:
                for name, params in (("slow", slow), ("b", ten), ("c", ten)):
                    nursery.start_soon(consume, name, params)
            for name, outs in results.items():
                assert outs[-1].finish_reason == "length", (name, outs[-1])
                assert sum(o.num_tokens for o in outs) == 10, name
            stats = engine.statistics().workers[0]
            assert stats.restarts == 0 and stats.pid == spawn.processes[0].pid
            # the slow step was heard through the pulse, not through answers to pings
            assert any(f.msg[0] == wire.PONG and f.msg[1] == 0 for f in spawn.sent)


async def test_an_embedding_computing_longer_than_the_heartbeat_timeout_is_not_hung():
    """An embedding's forward pass runs on the worker's loop, between steps: computing for
    three heartbeat timeouts, the pulse speaks for it too, so the worker is not killed,
    the embedding is answered and a stream beside it finishes."""
    ten = SamplingParams(max_tokens=10)
    slow = {"op": "embed", "input": ["a b c"], "fault": {"kind": "slow_step", "seconds": 9.0}}
    with trio.fail_after(3 * LIMIT):
        async with open_real_engine(PATIENT) as (engine, spawn):
            results = {}

            async def consume():
                async with engine.generate("b", ten) as stream:
                    results["b"] = await all_outputs(stream)

            async def embed():
                results["embed"] = await engine.tokenize(slow)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(embed)
                nursery.start_soon(consume)
            assert len(results["embed"]["data"]) == 1 and results["embed"]["prompt_tokens"] == 3
            assert results["b"][-1].finish_reason == "length"
            stats = engine.statistics().workers[0]
            assert stats.restarts == 0 and stats.pid == spawn.processes[0].pid
            assert any(f.msg[0] == wire.PONG and f.msg[1] == 0 for f in spawn.sent)


async def test_a_stopped_worker_in_a_long_step_is_hung():
    """SIGSTOP in the middle of a long step: the pulse is frozen with the process, so the
    worker is declared hung, killed (SIGKILL: a stopped process keeps SIGTERM pending) and
    replaced."""
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(heartbeat_interval=0.1, heartbeat_timeout=0.5,
                                           shutdown_grace=0.3)) as (engine, spawn):
            slow = SamplingParams(max_tokens=100, extra=fault("slow_step", 3, seconds=3600))
            results = await _signal_after_three(engine, spawn, slow, signal.SIGSTOP)
            await _check_died_and_restarted(engine, spawn, results, "hung")
            assert spawn.processes[0].returncode == -signal.SIGKILL


# -- dispatch ----------------------------------------------------------------------------------


async def test_dispatch_by_fewest_outstanding_over_two_workers():
    with trio.fail_after(LIMIT):
        async with open_real_engine(config(workers=2)) as (engine, spawn):
            a = engine.generate("a", LONG)
            b = engine.generate("b", LONG)
            c = engine.generate_many(["c1", "c2"], LONG)
            d = engine.generate("d", LONG)
            e = engine.generate("e", LONG)
            assert tuple(w.outstanding for w in engine.statistics().workers) == (3, 3)
            await a.aclose()
            f = engine.generate("f", LONG)
            await wait_for(lambda: len(spawn.submits()) == 7)
            pids = [w.pid for w in engine.statistics().workers]
            where = {fr.msg[2]: pids.index(fr.pid) for fr in spawn.submits()}
            assert where == {"a": 0, "b": 1, "c1": 0, "c2": 0, "d": 1, "e": 1, "f": 0}
            for stream in (b, c, d, e, f):
                await stream.aclose()
            assert spawn.aborts() == 7
            assert len(spawn.messages(wire.ABORT)) == 7


# -- no child outlives the engine --------------------------------------------------------------


async def test_cancelling_the_engine_owner_leaves_no_worker_process():
    """The engine's owner is cancelled with requests in flight, one worker hung: every worker
    process is stopped (a pipe close, then SIGTERM for the hung one) before the block ends."""
    spawn = scenarios.RecordingSpawner()

    async def consume(engine, params):
        async with engine.generate("a", params) as stream:
            async for _ in stream:
                pass

    cfg = config(workers=2, shutdown_grace=0.3)
    with trio.fail_after(LIMIT):
        with trio.CancelScope() as scope:  # the owner, cancelled below
            async with server.open_engine(cfg, spawn=spawn) as engine:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consume, engine, LONG)  # worker 0
                    nursery.start_soon(consume, engine,  # worker 1, which hangs
                                       SamplingParams(max_tokens=100, extra=fault("hang", 2)))
                    await wait_for(lambda: len(spawn.outputs_for(2)) >= 2)
                    scope.cancel()
        assert scope.cancelled_caught
    assert len(spawn.processes) == 2
    spawn.assert_all_exited()
    # Which step ends which worker depends on timing (a busy worker may miss the grace after
    # its pipe closes; the hung one may see the close before its next step): each ended by
    # the close (0) or by our escalation, never otherwise.
    assert {p.returncode for p in spawn.processes} <= {0, -signal.SIGTERM, -signal.SIGKILL}


async def test_a_burst_larger_than_the_pipe_reaches_the_worker_whole_and_in_order():
    # Submits are written to the worker's pipe directly when nothing is queued. The first
    # prompts are larger than a pipe's buffer (64 KB), so their write is partial; then 300
    # prompts of 8-10 KB each overflow it, and the rest goes through the writer task. Every
    # request must come back with its own prompt's token count and the sim's exact text.
    sizes = [8000, 7990, 7980] + [1000 + i for i in range(300)]
    prompts = [" ".join(f"p{i}w{j}" for j in range(n)) for i, n in enumerate(sizes)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    results: dict[int, tuple] = {}
    with trio.fail_after(LIMIT):
        async with server.open_engine(config()) as engine:  # the real spawn: real pipe fds

            async def one(i, stream):
                text, ntok = "", 0
                async with stream:
                    async for out in stream:
                        text += out.text
                        ntok += out.num_tokens
                results[i] = (text, ntok, out.prompt_tokens, out.finish_reason)

            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(prompts):  # all dispatched before any runs
                    nursery.start_soon(one, i, engine.generate(prompt, params))
            await assert_engine_idle(engine)
    for i, prompt in enumerate(prompts):
        text, ntok, finish = sim_reference(prompt, params)
        assert results[i] == (text, ntok, sizes[i], finish), i
