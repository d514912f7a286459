"""Worker faults through the real server: killed, hung and garbage-writing workers, restart
backoff and the restart limit, and ``/health`` as a proof of progress.

Real worker processes behind real HTTP (``running_server``), so these run on the real clock
on machines that may be busy: every ``fail_after`` is a generous guard against a hang, never
the property, and every bound on a duration is causal (a failure cannot be detected before
the request that caused it was sent). How fast a killed worker's streams end is not asserted
here (a loaded machine stretches it); in virtual time it is exact (tests/test_stream_fake.py).
The restart backoff schedule is checked exactly, on trio's virtual clock, with a minimal
stand-in process (see ``test_restart_backoff_doubles_caps_past_the_budget_and_resets``).
"""

from __future__ import annotations

import errno
import os
import signal

import httpx
import trio

from server.config import EngineConfig
from server import SamplingParams
from server.manager.engine import open_engine
from server.manager.worker import WorkerClient, spawn_process
from server.worker_protocol import wire
from tests.fakes import all_outputs
from tests.conftest import FAST_SIM, assert_engine_idle, pid_exists, running_server
from tests.sse_record import SSE, stream_into

# -- helpers ---------------------------------------------------------------------------------


async def wait_until(predicate, timeout: float, interval: float = 0.02):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)


def fault_config(**overrides) -> EngineConfig:
    options = {**FAST_SIM, "faults": True}
    overrides.setdefault("shutdown_grace", 0.3)
    return EngineConfig(engine_options=options, **overrides)


async def all_workers_up(engine, timeout: float = 20) -> None:
    """/health is 200 once ANY worker is up; multi-worker tests need every one."""
    await wait_until(lambda: engine.statistics().workers_alive == len(engine.workers), timeout)


def worker_of(engine, before: list[int]) -> int:
    """The index of the one worker whose outstanding count went up since ``before``."""
    now = [w.outstanding for w in engine.statistics().workers]
    grew = [i for i, (a, b) in enumerate(zip(before, now)) if b > a]
    assert len(grew) == 1, (before, now)
    return grew[0]


# -- a worker killed with SIGKILL ------------------------------------------------------------

#: Tokens of the streams that must outlive a worker's death: 6 s at the sim's 2 ms a token.
LONG = 3000


async def test_sigkill_ends_that_workers_streams_and_spares_the_other():
    # without migration (tests/test_migration.py: with it, those streams go on elsewhere)
    config = fault_config(workers=2, max_migrations=0)
    async with running_server(config) as url:
        engine = url.engine
        await all_workers_up(engine)
        recs: list[tuple[int, SSE]] = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                for _ in range(4):  # dispatch by load: they alternate between the workers
                    before = [w.outstanding for w in engine.statistics().workers]
                    rec = SSE()
                    nursery.start_soon(stream_into, http, {"prompt": "p", "max_tokens": LONG}, rec)
                    with trio.fail_after(30):
                        await rec.started.wait()
                    recs.append((worker_of(engine, before), rec))
                assert sorted(i for i, _ in recs) == [0, 0, 1, 1]
                victim = engine.statistics().workers[0].pid
                os.kill(victim, signal.SIGKILL)
                killed_at = trio.current_time()
                for i, rec in recs:
                    if i == 0:
                        with trio.fail_after(20):
                            await rec.finished.wait()
                survivors_then = [rec.tokens() for i, rec in recs if i == 1]
            # (the nursery waited for the survivors to finish by themselves)
        for i, rec in recs:
            assert rec.status == 200 and rec.done, rec.body[-300:]
            if i == 0:
                error = rec.error()
                assert error["code"] == "worker_died" and error["type"] == "engine_error"
                assert rec.finish_reasons() == []
                assert 0 < rec.tokens() < LONG
            else:
                assert rec.error() is None
                assert rec.finish_reasons() == ["length"]
                assert rec.tokens() == LONG  # nothing lost across the other worker's death
                assert rec.times[-1] > killed_at
        assert all(n < LONG for n in survivors_then)  # they were still streaming then
        assert b"Traceback" not in b"".join(rec.body for _, rec in recs)
        # the victim was reaped and replaced; the other worker was left alone
        assert not pid_exists(victim)
        await wait_until(lambda: engine.statistics().workers[0].alive, timeout=30)
        w0, w1 = engine.statistics().workers
        assert w0.restarts == 1 and w0.pid != victim
        assert w1.restarts == 0
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            rs = [await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) for _ in range(2)]
        assert [r.status_code for r in rs] == [200, 200]


# -- a hung worker ---------------------------------------------------------------------------


async def test_hung_worker_is_treated_as_dead_killed_and_restarted():
    # The non-streaming request below must reach worker 0 after the hang began and before
    # the hang is noticed: a 5 s heartbeat timeout leaves a busy machine room for the
    # requests in between (with 1 s, a loaded test lost that race). A 1 s heartbeat keeps
    # worker 1 healthy (heard within 3.5 s) through pings a busy machine answers late.
    config = fault_config(workers=2, heartbeat_interval=1.0, heartbeat_timeout=5.0,
                          max_migrations=0)  # (its streams end with the error: no migration)
    async with running_server(config) as url:
        engine = url.engine
        await all_workers_up(engine)
        hung, other = SSE(), SSE()
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                before = [w.outstanding for w in engine.statistics().workers]
                body = {"prompt": "p", "max_tokens": 500, "fault": {"kind": "hang", "after": 5}}
                sent_at = trio.current_time()
                nursery.start_soon(stream_into, http, body, hung, 1)
                with trio.fail_after(30):
                    await hung.started.wait()
                assert worker_of(engine, before) == 0
                victim = engine.statistics().workers[0].pid
                before = [w.outstanding for w in engine.statistics().workers]
                nursery.start_soon(stream_into, http, {"prompt": "q", "max_tokens": 1500}, other)
                with trio.fail_after(30):
                    await other.started.wait()
                assert worker_of(engine, before) == 1
                # A non-streaming request held by the hung worker fails the same way.
                before = [w.outstanding for w in engine.statistics().workers]
                plain = {}

                async def non_streaming():
                    plain["r"] = await http.post(
                        "/v1/completions", json={"prompt": "n", "max_tokens": 50}
                    )

                nursery.start_soon(non_streaming)
                await wait_until(lambda: sum(w.outstanding for w in engine.workers) == 3, 30)
                assert worker_of(engine, before) == 0
                # Meanwhile /health stays 200: worker 1 keeps answering its pings.
                health = set()
                with trio.fail_after(40):  # (the heartbeat timeout is 5 s)
                    while not hung.finished.is_set():
                        health.add((await http.get("/health")).status_code)
                        await trio.sleep(0.05)
                assert health == {200}
        assert hung.done and hung.tokens() == 5
        error = hung.error()
        assert error["code"] == "worker_died" and "hung" in error["message"]
        # not before the heartbeat timeout: the worker was last heard after this request
        # was sent (its fifth token), and is declared hung 5 s of silence later
        assert hung.ended - sent_at > 5.0
        r = plain["r"]
        assert r.status_code == 500 and r.json()["error"]["code"] == "worker_died"
        # the other worker's stream was untouched
        assert other.done and other.error() is None
        assert other.finish_reasons() == ["length"] and other.tokens() == 1500
        # the hung process was killed (pipe closed, then SIGTERM) and replaced
        await wait_until(lambda: not pid_exists(victim), timeout=30)
        await wait_until(lambda: engine.statistics().workers[0].alive, timeout=30)
        w0 = engine.statistics().workers[0]
        assert w0.restarts == 1 and w0.pid != victim
        assert engine.statistics().workers[1].restarts == 0


async def test_garbage_on_the_pipe_is_treated_as_death():
    config = fault_config()
    async with running_server(config) as url:
        engine = url.engine
        victim = engine.statistics().workers[0].pid
        rec, bystander = SSE(), SSE()
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                # a stream on the same worker that did nothing wrong
                nursery.start_soon(stream_into, http, {"prompt": "b", "max_tokens": 5000}, bystander)
                with trio.fail_after(30):
                    await bystander.started.wait()
                body = {"prompt": "p", "max_tokens": 50, "fault": {"kind": "garbage", "after": 3}}
                nursery.start_soon(stream_into, http, body, rec)
                with trio.fail_after(20):
                    await rec.finished.wait()
                    await bystander.finished.wait()
            # non-streaming: a 500 with the worker_died code
            await wait_until(lambda: engine.statistics().workers[0].alive, timeout=30)
            r = await http.post(
                "/v1/completions",
                json={"prompt": "p", "max_tokens": 50, "fault": {"kind": "garbage", "after": 2}},
            )
        for one in (rec, bystander):
            assert one.done, (one.status, one.body[-300:])
            assert one.error()["code"] == "worker_died"
            assert "protocol violation" in one.error()["message"]
        assert rec.tokens() == 3
        assert r.status_code == 500 and r.json()["error"]["code"] == "worker_died"
        assert "Traceback" not in r.text
        await wait_until(lambda: engine.statistics().workers[0].alive, timeout=30)
        assert not pid_exists(victim)
        assert engine.statistics().workers[0].restarts == 2


# -- restarts: backoff and the limit ---------------------------------------------------------


async def test_a_worker_killed_past_its_budget_comes_back_and_ready_says_degraded():
    # Issue 42: a worker SIGKILLed more than max_restarts times within the window was left
    # down for good while /health and /ready said 200. Now it is retried at the capped
    # backoff and comes back, and meanwhile the probes say the pool is degraded.
    config = fault_config(workers=2, max_restarts=1, restart_backoff=0.05,
                          restart_backoff_max=2.0, restart_window=600.0)
    degraded = {"status": "degraded", "workers_alive": 1, "workers": 2}
    async with running_server(config) as url:
        engine = url.engine
        worker = engine.workers[0]
        await all_workers_up(engine)
        killed: list[int] = []
        seen: dict[str, list] = {"/ready": [], "/health": []}
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for _ in range(3):  # one more death than the budget allows, and one at the cap
                await wait_until(lambda: worker.alive and worker.pid not in killed, timeout=60)
                killed.append(worker.pid)
                os.kill(killed[-1], signal.SIGKILL)
                await wait_until(lambda: not worker.alive, timeout=60)
                # probed while worker 0 is down (down before and after, and not restarted
                # in between), the other one serving
                restarts = worker.restarts
                for path in seen:
                    answer = await http.get(path)
                    if not worker.alive and worker.restarts == restarts:
                        seen[path].append((answer.status_code, answer.json()))
                r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
                assert r.status_code == 200
            assert worker.over_budget
            # left alone, it comes back (not left down), and the pool is whole again
            await all_workers_up(engine, timeout=120)
            assert worker.over_budget  # (until it stays up for the restart window)
            ready = await http.get("/ready")
            assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        assert worker.restarts == 3 and not any(pid_exists(p) for p in killed)
        assert seen["/ready"] and all(a == (200, degraded) for a in seen["/ready"]), seen
        assert all(a == (200, degraded) for a in seen["/health"]), seen


class _ShortLivedProcess:
    """Enough of trio.Process for WorkerClient: says HELLO, then exits after ``lifetime``."""

    def __init__(self, pid: int, lifetime: float) -> None:
        self.pid = pid
        self.lifetime = lifetime
        self.stdin = self
        self.stdout = self
        self._said_hello = False
        self.returncode = None

    async def send_all(self, data) -> None:
        pass

    async def receive_some(self, max_bytes=None) -> bytes:
        if not self._said_hello:
            self._said_hello = True
            return wire.encode([wire.HELLO, {"engine": "fake"}])
        await trio.sleep(self.lifetime)
        return b""

    async def aclose(self) -> None:
        pass

    async def wait(self) -> int:
        self.returncode = 0
        return 0

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


async def test_restart_backoff_doubles_caps_past_the_budget_and_resets(autojump_clock, caplog):
    # Virtual time: every process lives ``lifetimes[k]`` seconds after its HELLO.
    lifetimes = iter([0, 0, 0, 0, 0, 100, 0, 0, 0])
    spawned = []

    async def spawn(config):
        spawned.append(trio.current_time())
        return _ShortLivedProcess(len(spawned), next(lifetimes))

    config = EngineConfig(
        restart_backoff=0.1,
        restart_backoff_max=5.0,
        max_restarts=2,
        restart_window=60.0,
        heartbeat_interval=1000.0,
        heartbeat_timeout=1000.0,
    )
    worker = WorkerClient(0, config, spawn)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await wait_until(lambda: len(spawned) == 9, timeout=1000)
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 6) for a, b in zip(spawned, spawned[1:])]
    # 0.1, 0.2, then the third death within 60 s is over the budget (max_restarts=2): the
    # cap, 5 s, from then on (not left down). The 6th process lived 100 s (past the restart
    # window): its normal backoff is back (0.1, 0.2) and the window forgot the earlier
    # deaths, until the third within 60 s again.
    assert gaps == [0.1, 0.2, 5.0, 5.0, 5.0, 100.1, 0.2, 5.0]
    assert worker.over_budget and worker.restarts == 8
    # one error line per episode, not one per retry
    episodes = [r for r in caplog.records if "until it stays up" in r.getMessage()]
    assert [r.levelname for r in episodes] == ["ERROR", "ERROR"]


async def test_spawns_failing_for_the_frontends_own_reasons_spend_no_restart_budget(caplog):
    # Issue 42: with the frontend out of descriptors (a flood of connections), each spawn
    # fails with EMFILE; those failures spent the worker's whole budget in seconds and it
    # was left down. The spawn function is the documented hook (open_engine's ``spawn``):
    # the real one, after it raised EMFILE as the pipe's creation would.
    failing = 0

    async def spawn(config):
        nonlocal failing
        if failing:
            failing -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return await spawn_process(config)

    config = fault_config(max_restarts=1, restart_backoff=0.02, restart_backoff_max=0.2,
                          restart_window=600.0)
    async with open_engine(config, spawn=spawn) as engine:
        worker = engine.workers[0]
        failing = 6  # more than the budget, after the one death it allows
        victim = worker.pid
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: worker.alive and worker.pid != victim, timeout=120)
        assert failing == 0 and worker.restarts == 7 and not worker.over_budget
        async with engine.generate("p", SamplingParams(max_tokens=3)) as stream:
            assert (await all_outputs(stream))[-1].finish_reason == "length"
    lines = [r.getMessage() for r in caplog.records if r.name == "server.worker"
             and "could not be started" in r.getMessage()]
    assert len(lines) == 6 and all("Too many open files" in line and "not counted" in line
                                   for line in lines), lines
    # still backed off, doubling to the cap
    assert [line.rsplit(" in ", 1)[1] for line in lines] == [
        "0.04 s", "0.08 s", "0.16 s", "0.20 s", "0.20 s", "0.20 s"]


# -- /health proves progress -----------------------------------------------------------------


async def test_health_turns_503_when_the_only_worker_stops_answering():
    # A long heartbeat timeout: the worker is hung but not yet declared dead, so health is
    # about answers to pings, not about a process existing. Health turns 503 1.1 s after
    # the worker was last heard (3 heartbeat periods + 0.5 s), the worker is declared dead
    # after 6 s: the client has ample time to see the one before the other.
    config = fault_config(heartbeat_interval=0.2, heartbeat_timeout=6.0)
    async with running_server(config) as url:
        engine = url.engine
        pid = engine.statistics().workers[0].pid
        rec = SSE()
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            async with trio.open_nursery() as nursery:
                body = {"prompt": "p", "max_tokens": 100, "fault": {"kind": "hang", "after": 3}}
                nursery.start_soon(stream_into, http, body, rec)
                # (tokens may arrive merged into fewer events: count the words)
                await wait_until(lambda: rec.tokens() == 3, timeout=30, interval=0.005)
                with trio.fail_after(20):
                    while (health := await http.get("/health")).status_code == 200:
                        await trio.sleep(0.05)
                assert health.status_code == 503
                assert health.json() == {"status": "unavailable"}
                # the process is still there and not yet declared dead
                stats = engine.statistics().workers[0]
                assert stats.alive
                assert stats.pid == pid
                assert pid_exists(pid)
                assert not stats.healthy
            assert rec.done and rec.error()["code"] == "worker_died"
            await wait_until(lambda: engine.statistics().workers[0].alive, timeout=30)
            with trio.fail_after(20):
                while (await http.get("/health")).status_code != 200:
                    await trio.sleep(0.05)
        assert engine.statistics().workers[0].pid != pid


# -- overload: queued requests of clients that left ------------------------------------------


async def test_queued_requests_of_departed_clients_never_run():
    # One slot per worker: the first request runs, the others wait in the worker's queue
    # (by default there is no admission limit).
    config = EngineConfig(engine_options={**FAST_SIM, "max_batch": 1})
    async with running_server(config) as url:
        engine = url.engine
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                first = SSE()
                nursery.start_soon(stream_into, http, {"prompt": "a", "max_tokens": 5000}, first)
                with trio.fail_after(30):
                    await first.started.wait()
                queued = []
                async with trio.open_nursery() as waiting:
                    for _ in range(5):
                        rec = SSE()
                        queued.append(rec)
                        waiting.start_soon(stream_into, http, {"prompt": "b", "max_tokens": 3}, rec)
                    with trio.fail_after(20):
                        while (await engine.ping_all())[0] != (1, 5):
                            await trio.sleep(0.02)
                    waiting.cancel_scope.cancel()  # the clients go away
                with trio.fail_after(20):
                    while (await engine.ping_all())[0] != (1, 0):
                        await trio.sleep(0.02)
                assert engine.statistics().open_streams == 1
                assert all(rec.tokens() == 0 for rec in queued)
                nursery.cancel_scope.cancel()
        await assert_engine_idle(engine, timeout=20)


# -- a poison request ------------------------------------------------------------------------


async def test_a_request_the_engine_chokes_on_fails_alone():
    import server

    async with server.open_engine(EngineConfig(engine_options=dict(FAST_SIM))) as engine:
        pid = engine.statistics().workers[0].pid
        async with engine.generate("fine", server.SamplingParams(max_tokens=300)) as bystander:
            await bystander.__anext__()
            async with engine.generate("x", server.SamplingParams(max_tokens=5, stop=(1,))) as bad:
                outs = await all_outputs(bad)
            assert outs[-1].finish_reason == "error"
            rest = await all_outputs(bystander)
        assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 300
        w = engine.statistics().workers[0]
        assert w.pid == pid and w.restarts == 0
        await assert_engine_idle(engine)
