"""Issue 41 item 7: a worker whose answers the frontend read late, because the frontend's own
loop (or the whole host) was starved, is not hung (server.manager.silence).

The arithmetic directly; then in virtual time over in-memory workers (a frozen run: the
clock jumps while nothing runs, so the heartbeat wakes late); then with real worker
processes: a frontend whose loop is blocked (``time.sleep`` in one of its tasks) for longer
than the heartbeat timeout keeps its worker, while a stopped worker (SIGSTOP) is still
declared hung (tests/test_engine_processes.py's
``test_a_stopped_worker_in_a_long_step_is_hung``, and an idle one here).
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import trio

from server import SamplingParams
from server.manager.silence import (
    MAX_STRETCH, CpuStall, LoopLag, judge, parse_cpu_stall, read_cpu_stall,
)
from tests.fakes import all_outputs, fault, open_fake_engine, open_real_engine, sim_config, \
    wait_for

LIMIT = 120  # seconds for a test with real processes (a hang guard, not a timing)


# -- the arithmetic --------------------------------------------------------------------------


def test_a_silence_past_the_timeout_with_nothing_to_discount_is_hung():
    verdict = judge(10.4, 10.0, loop_late=0.0, cpu_stalled=0.0)
    assert verdict.hung and not verdict.excused
    assert verdict.reason == "no answer for 10.4 s (hung)"


def test_the_frontends_loop_lag_is_discounted_and_said():
    verdict = judge(14.0, 10.0, loop_late=9.0, cpu_stalled=0.0)
    assert not verdict.hung and verdict.excused
    assert verdict.reason == ("no answer for 14.0 s, of which the frontend's loop was late "
                              "9.0 s: not taken for hung yet")
    # 14 s less 3 s is still past the timeout
    verdict = judge(14.0, 10.0, loop_late=3.0, cpu_stalled=0.0)
    assert verdict.hung and "late 3.0 s (hung)" in verdict.reason


def test_the_hosts_cpu_stall_is_discounted_and_said():
    verdict = judge(14.0, 10.0, loop_late=0.0, cpu_stalled=12.0)
    assert not verdict.hung and verdict.excused
    assert "the host's CPU was under pressure 12.0 s" in verdict.reason


def test_loop_lag_and_cpu_stall_overlap_the_larger_counts():
    # a starved host makes both at once: 3 s and 3 s is 3 s, not 6
    verdict = judge(14.0, 10.0, loop_late=3.0, cpu_stalled=3.0)
    assert verdict.hung
    assert "late 3.0 s and the host's CPU was under pressure 3.0 s (hung)" in verdict.reason


def test_the_discount_is_bounded():
    timeout = 10.0
    cap = timeout * MAX_STRETCH
    assert not judge(cap - 0.5, timeout, loop_late=cap, cpu_stalled=cap).hung
    verdict = judge(cap + 0.5, timeout, loop_late=cap, cpu_stalled=cap)
    assert verdict.hung and not verdict.excused
    assert f"past {MAX_STRETCH:g} times the heartbeat timeout" in verdict.reason


def test_a_silence_within_the_timeout_is_not_judged_excused():
    verdict = judge(5.0, 10.0, loop_late=4.0, cpu_stalled=0.0)
    assert not verdict.hung and not verdict.excused


def test_loop_lag_counts_only_the_lateness_after_a_moment():
    lag = LoopLag(keep=100.0)
    lag.woke(5.0, 0.001)
    lag.woke(20.0, 15.0)  # blocked from 5 to 20
    lag.woke(21.0, 0.0)
    assert lag.within(10.0) == pytest.approx(10.0)  # [10, 20] of [5, 20]
    assert lag.within(4.0) == pytest.approx(15.001)
    assert lag.within(20.0) == 0.0
    lag.woke(200.0, 1.0)  # the older ones are dropped
    assert lag.within(0.0) == pytest.approx(1.0)


def test_cpu_stall_is_the_counters_growth_since_the_first_sample_after_a_moment():
    stall = CpuStall(keep=100.0)
    for t, total in [(0.0, 100.0), (1.0, 100.5), (2.0, 101.5), (3.0, 102.5)]:
        stall.sample(t, total)
    assert stall.within(0.5) == pytest.approx(2.0)  # from the sample at 1.0
    assert stall.within(3.0) == 0.0
    assert stall.within(5.0) == 0.0
    stall.sample(4.0, None)  # the kernel stopped reporting it: nothing to go by
    assert stall.within(0.0) == 0.0


def test_the_kernels_cpu_pressure_is_read_where_it_is_reported(tmp_path):
    text = ("some avg10=98.00 avg60=80.12 avg300=30.00 total=138877470\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert parse_cpu_stall(text) == pytest.approx(138.87747)
    assert parse_cpu_stall("") is None
    path = tmp_path / "cpu"
    path.write_text(text)
    assert read_cpu_stall(str(path)) == pytest.approx(138.87747)
    assert read_cpu_stall(str(tmp_path / "absent")) is None  # no file: no discount


# -- in virtual time, over in-memory workers ---------------------------------------------------


async def test_a_frozen_frontend_does_not_take_its_idle_worker_for_hung(autojump_clock, caplog):
    """The whole run stands still for 25 s (the clock jumps with nothing running, as when
    the frontend's process gets no CPU): the heartbeat wakes 24 s late, and the worker,
    whose answers came before the freeze, is kept."""
    config = sim_config(heartbeat_interval=1.0, heartbeat_timeout=10.0)
    caplog.set_level(logging.WARNING, logger="server.worker")
    async with open_fake_engine(config) as (engine, spawn):
        await engine.workers[0].ping()
        autojump_clock.jump(25.0)
        await trio.sleep(5.0)  # heartbeats after the freeze
        worker = engine.workers[0]
        assert worker.alive and worker.restarts == 0 and len(spawn.processes) == 1
        assert worker.hang_excused == 1
        said = [r.getMessage() for r in caplog.records]
        assert any("of which the frontend's loop was late" in m and "not taken for hung" in m
                   for m in said), said
        async with engine.generate("a", SamplingParams(max_tokens=3)) as stream:
            assert (await all_outputs(stream))[-1].finish_reason == "length"


async def test_a_hung_worker_under_a_lagging_frontend_is_killed_at_the_bound(autojump_clock):
    """The frontend's loop is late about 98 % of the time (a heartbeat due every 0.1 s
    wakes 5 s late) while the worker is hung: the silence counted grows 0.1 s every 5 s, so
    only the bound kills the worker, at MAX_STRETCH times the timeout."""
    config = sim_config(heartbeat_interval=0.1, heartbeat_timeout=10.0, shutdown_grace=1.0)
    async with open_fake_engine(config) as (engine, spawn):
        async with trio.open_nursery() as nursery:
            async def lagging():
                while True:
                    await trio.sleep(0.01)
                    autojump_clock.jump(5.0)

            params = SamplingParams(max_tokens=50, extra=fault("hang", 1))
            with trio.fail_after(10.0 * MAX_STRETCH + 20.0):
                async with engine.generate("a", params) as stream:
                    nursery.start_soon(lagging)
                    outs = await all_outputs(stream)
            nursery.cancel_scope.cancel()
        assert outs[-1].error_kind == "worker_died"
        assert f"past {MAX_STRETCH:g} times the heartbeat timeout" in outs[-1].error
        assert engine.workers[0].hang_excused == 1
        await wait_for(lambda: engine.workers[0].alive and engine.workers[0].restarts == 1,
                       timeout=30)


# -- with real worker processes ----------------------------------------------------------------


async def test_a_blocked_frontend_loop_does_not_take_its_worker_for_hung(caplog):
    """The frontend's loop is blocked 4 s (time.sleep in one of its tasks) against a 2 s
    heartbeat timeout, right after its worker answered the heartbeat's PING and ours: nothing
    of the worker waits unread when the heartbeat wakes, 4 s after it last heard it (the next
    PING is due an interval later, inside the block). It is not hung: the heartbeat woke as
    late as that."""
    caplog.set_level(logging.WARNING, logger="server.worker")
    with trio.fail_after(LIMIT):
        async with open_real_engine(sim_config(heartbeat_interval=1.0, heartbeat_timeout=2.0,
                                               itl_ms=2.0, ttft_ms=2.0)) as (engine, spawn):
            worker = engine.workers[0]
            pid = worker.pid
            sent = worker._ping_seq
            await wait_for(lambda: worker._ping_seq > sent, timeout=LIMIT)  # a heartbeat
            await worker.ping()  # (answered after the heartbeat's PING: both read now)
            time.sleep(4.0)  # noqa: ASYNC251  (the frontend's loop, blocked: the point)
            await trio.sleep(2.0)  # the heartbeats after it
            assert worker.alive and worker.pid == pid and worker.restarts == 0
            # (one excused silence, unless a round trip above took a whole interval on a
            # busy host, and the heartbeat's next PING was answered inside the block)
            assert worker.hang_excused <= 1
            said = [r.getMessage() for r in caplog.records]
            assert worker.hang_excused == 0 or any(
                "the frontend's loop was late" in m for m in said), said
            async with engine.generate("a", SamplingParams(max_tokens=3)) as stream:
                assert (await all_outputs(stream))[-1].finish_reason == "length"


async def test_a_stopped_idle_worker_is_hung():
    """SIGSTOP on an idle worker: the frontend's loop is on time, so the silence counts
    (less what the host's CPU pressure discounts, at most up to the bound)."""
    with trio.fail_after(LIMIT):
        async with open_real_engine(sim_config(heartbeat_interval=0.2, heartbeat_timeout=1.0,
                                               shutdown_grace=0.3)) as (engine, spawn):
            worker = engine.workers[0]
            pid = worker.pid
            os.kill(pid, signal.SIGSTOP)
            await wait_for(lambda: worker.restarts == 1 and worker.alive, timeout=LIMIT)
            assert worker.pid != pid
            assert spawn.processes[0].returncode == -signal.SIGKILL
