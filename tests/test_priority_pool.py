"""A request's ``priority`` on a pool mixing workers with and without priority scheduling
(server/manager/batch_priority.py). The sim models vLLM's ``--scheduling-policy``: under
fcfs it refuses a priority not 0, as vLLM does; under priority it admits the waiting
lowest first. Sans-IO for the sim, then real listening sim workers of both kinds behind a
real server or engine: a client's priority goes only to a worker that honours it (a
migration too), and a batch line's is sent only to one, however it moves."""

from __future__ import annotations

import signal
from contextlib import AsyncExitStack, asynccontextmanager

import openai
import pytest
import trio

import server as server_pkg
from server.config import EngineConfig
from server.engines.sim.engine import SimEngine
from server.errors import ClientError
from server.manager.batch_priority import batch_work
from server.params import SamplingParams
from server.workers.base import Rejected
from tests.conftest import FAST_SIM, running_server
from tests.fakes import sim_reference
from tests.remote import free_port, listening_worker, remote_config

LIMIT = 60


def _admitted(engine: SimEngine, count: int) -> list[int]:
    """The rids that produce a first token, in order, until ``count`` did (fake time)."""
    order: list[int] = []
    now = 0.0
    while len(order) < count:
        now = engine.next_deadline() or now
        for row in engine.step(now):
            if row.rid not in order:
                order.append(row.rid)
    return order


def test_the_sims_policies_as_vllms():
    fcfs = SimEngine(max_batch=1, clock=lambda: 0.0)
    assert "priority" not in fcfs.info["sampling"]
    fcfs.add(1, "a", {"priority": 0})  # (0 is vLLM's default: taken under fcfs)
    with pytest.raises(Rejected) as refused:
        fcfs.add(2, "a", {"priority": 5})
    assert refused.value.param == "priority" and "not enabled" in str(refused.value)
    prio = SimEngine(max_batch=1, scheduling_policy="priority", clock=lambda: 0.0, **FAST_SIM)
    assert "priority" in prio.info["sampling"]
    for rid, priority in [(1, 0), (2, 9), (3, 4), (4, 4), (5, -1)]:
        prio.add(rid, "a", {"priority": priority, "max_tokens": 1})
    assert _admitted(prio, 5) == [1, 5, 3, 4, 2]  # (the first ran at once; then lowest first)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SimEngine(scheduling_policy="lifo")


@asynccontextmanager
async def pool(tmp_path, *policies: str):
    """Listening sim workers, one per policy (``fcfs`` or ``priority``, in that order in
    the pool), and an engine config that routes to the least loaded of them."""
    async with AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(listening_worker(
            tmp_path, f"127.0.0.1:{free_port()}", "--scheduling-policy", policy,
            name=f"{i}-{policy}")) for i, policy in enumerate(policies)]
        yield workers, remote_config(*workers, routing="least-loaded",
                                     heartbeat_interval=0.2, restart_backoff=0.05,
                                     restart_backoff_max=0.2)


async def test_a_clients_priority_goes_only_to_a_worker_that_honours_it(tmp_path):
    """The fcfs worker is first (its HELLO is the pool's) and, idle, the least loaded: the
    priority is still accepted, and each such request goes to the priority worker (the
    fcfs sim would refuse it)."""
    async with pool(tmp_path, "fcfs", "priority") as (_, config), \
            running_server(config) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with trio.fail_after(LIMIT):
            for priority in (5, -3, 7):
                got = await client.completions.create(
                    model="sim", prompt="hi", max_tokens=3, extra_body={"priority": priority})
                assert got.choices[0].finish_reason == "length"
            plain = await client.completions.create(model="sim", prompt="hi", max_tokens=3)
            assert plain.choices[0].finish_reason == "length"


async def test_a_pool_without_priority_scheduling_refuses_a_clients_priority():
    """What vLLM's own server answers under fcfs: a 400 naming the field (the library's
    path here; the HTTP routes refuse it when parsing, from the pool's HELLO)."""
    async with server_pkg.open_engine(EngineConfig(engine_options=FAST_SIM)) as engine:
        with pytest.raises(ClientError) as refused:
            engine.generate("hi", SamplingParams(extra={"priority": 5}))
        assert refused.value.param == "priority" and refused.value.status == 400


async def _kill_and_finish(workers, stream, victim: int) -> tuple[str, object]:
    """Read ``stream`` to its end, SIGKILLing worker ``victim`` once it has 3 tokens."""
    [choice] = stream.choice_states()
    assert choice.worker.index == victim
    text, out = "", None
    async for out in stream:
        text += out.text
        if out.completion_tokens >= 3 and not choice.migrations:
            workers[victim].proc.send_signal(signal.SIGKILL)
            while not choice.migrations and not choice.done:
                await trio.sleep(0.01)
    return text, out


async def test_a_moved_batch_line_takes_the_new_workers_kind(tmp_path):
    """A batch line running on the priority worker (sent at batch_priority) moves to the
    fcfs worker when its worker dies: that worker is sent no priority, and the line
    ends whole, as it would have run."""
    params = SamplingParams(max_tokens=300, temperature=0)
    expected = sim_reference("line", params)[0]
    async with pool(tmp_path, "priority", "fcfs") as (workers, config):
        async with server_pkg.open_engine(config) as engine:
            with trio.fail_after(LIMIT), batch_work():
                async with engine.generate("line", params) as moving, \
                        engine.generate("other", params) as staying:
                    text, out = await _kill_and_finish(workers, moving, 0)
                    async for _ in staying:
                        pass
            stats = engine.statistics().migration
    assert (out.finish_reason, out.completion_tokens, text) == ("length", 300, expected)
    assert stats is not None and stats.migrations["disconnected"] == 1


async def test_a_moved_clients_priority_goes_to_a_worker_that_honours_it(tmp_path):
    """Two requests at a priority, one on each priority worker; one's worker dies. The
    idle fcfs worker is the least loaded, but the request moves to the other priority
    worker and ends whole."""
    params = SamplingParams(max_tokens=300, temperature=0, extra={"priority": 2})
    expected = sim_reference("asked", params, scheduling_policy="priority")[0]
    async with pool(tmp_path, "priority", "fcfs", "priority") as (workers, config):
        async with server_pkg.open_engine(config) as engine:
            with trio.fail_after(LIMIT):
                async with engine.generate("asked", params) as moving, \
                        engine.generate("other", params) as staying:
                    assert staying.choice_states()[0].worker.index == 2
                    text, out = await _kill_and_finish(workers, moving, 0)
                    async for _ in staying:
                        pass
                    assert moving.choice_states()[0].worker.index == 2
    assert (out.finish_reason, out.completion_tokens, text) == ("length", 300, expected)
