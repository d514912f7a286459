"""Issue 41 item 6: requests beyond the engine's batch queue (as vLLM's do) instead of a 503.

* By default no admission limit answers 503: more requests than the workers run at once
  all complete, each waiting in its worker's queue and starting, in arrival order, as a
  batch slot frees (virtual time, the in-memory engine; and once on real processes).
* ``--max-queue-time``: a request that has not started within it (no output from the
  engine) is aborted on the engine, once, and answered ``503 server_overloaded`` with
  ``Retry-After``, streamed or not; a request that started is never cut by it.
"""

from __future__ import annotations

import functools

import httpx
import pytest
import trio

import server
from server.config import EngineConfig
from server.testing import open_asgi_client, open_in_memory_engine, sim_engine_config
from server.testing import open_in_memory_spawner
from tests.conftest import FAST_SIM, running_server
from tests.sse_record import SSE, stream_into

BATCH = 2


async def test_more_requests_than_the_batch_all_complete_in_arrival_order(autojump_clock):
    config = sim_engine_config(max_batch=BATCH, itl_ms=10, ttft_ms=20)
    async with open_in_memory_spawner() as spawner:
        async with open_in_memory_engine(config, spawner=spawner) as engine:
            app = server.create_app(engine=engine)  # the defaults: no admission limit
            async with open_asgi_client(app) as client:
                answers: list = []

                async def one(i: int) -> None:
                    body = {"prompt": f"p{i}", "max_tokens": 20, "stream": i % 2 == 0}
                    answers.append(await client.post("/v1/completions", json=body))

                async with trio.open_nursery() as nursery:
                    for i in range(8 * BATCH):
                        nursery.start_soon(one, i)
                        await trio.sleep(0.001)  # (a known arrival order)
    assert [r.status for r in answers] == [200] * 8 * BATCH, [r.body for r in answers]
    assert app.metrics.rejections == {}
    submitted = spawner.rids()
    assert len(submitted) == 8 * BATCH
    # all were sent to the worker at once; each started as a slot freed, in arrival order
    first = [spawner.outputs_for(rid)[0][0] for rid in submitted]
    assert first == sorted(first) and first[0] < first[BATCH] < first[-1]
    assert all(spawner.aborts(rid) == 0 for rid in submitted)


async def test_a_request_not_started_within_the_queue_time_gets_503(autojump_clock):
    config = sim_engine_config(max_batch=1, itl_ms=10, ttft_ms=20)
    async with open_in_memory_spawner() as spawner:
        async with open_in_memory_engine(config, spawner=spawner) as engine:
            app = server.create_app(server.ServerConfig(max_queue_time=1.0, queued_heartbeat=None),
                                    engine=engine)
            async with open_asgi_client(app) as client:
                async with trio.open_nursery() as nursery:
                    held: list = []

                    async def hold() -> None:  # 3 s of tokens: longer than the queue time
                        held.append(await client.post(
                            "/v1/completions", json={"prompt": "h", "max_tokens": 300}))

                    nursery.start_soon(hold)
                    await trio.sleep(0.1)
                    for stream in (False, True):
                        start = trio.current_time()
                        r = await client.post("/v1/completions", json={
                            "prompt": "q", "max_tokens": 5, "stream": stream})
                        assert r.status == 503, r.body
                        assert r.header("retry-after") == "1"
                        assert r.json()["error"]["code"] == "server_overloaded"
                        assert "queue-time limit" in r.json()["error"]["message"]
                        assert 1.0 <= trio.current_time() - start < 1.5  # (virtual time)
    # the request that held the slot ran past the queue time: it had started, so it finished
    assert held[0].status == 200 and held[0].json()["choices"][0]["finish_reason"] == "length"
    hold_rid, *queued = spawner.rids()
    assert len(queued) == 2 and spawner.aborts(hold_rid) == 0
    for rid in queued:  # aborted exactly once, and the worker confirmed it
        assert spawner.aborts(rid) == 1
        assert [out[3] for _, out in spawner.outputs_for(rid)] == ["abort"]
    assert app.metrics.aborts["queue_timeout"] == 2
    assert app.metrics.finished["length"] == 1


async def test_a_queue_timeout_after_the_heartbeat_started_the_stream_is_an_error_event(
        autojump_clock):
    config = sim_engine_config(max_batch=1, itl_ms=10, ttft_ms=20)
    async with open_in_memory_engine(config) as engine:
        app = server.create_app(
            server.ServerConfig(max_queue_time=2.0, queued_heartbeat=0.5), engine=engine)
        async with open_asgi_client(app) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(
                    client.post, "/v1/completions", json={"prompt": "h", "max_tokens": 500}))
                await trio.sleep(0.1)
                r = await client.post("/v1/completions",
                                      json={"prompt": "q", "max_tokens": 5, "stream": True})
    assert r.status == 200 and r.body.startswith(b": waiting for the engine")
    error, done = r.sse()
    assert error["error"]["code"] == "server_overloaded" and done == "[DONE]"


async def test_a_request_that_starts_in_time_is_served(autojump_clock):
    config = sim_engine_config(max_batch=1, itl_ms=10, ttft_ms=20)
    async with open_in_memory_engine(config) as engine:
        app = server.create_app(server.ServerConfig(max_queue_time=1.0), engine=engine)
        async with open_asgi_client(app) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(  # 0.5 s of tokens
                    client.post, "/v1/completions", json={"prompt": "h", "max_tokens": 50}))
                await trio.sleep(0.1)
                r = await client.post("/v1/completions", json={"prompt": "q", "max_tokens": 5})
    assert r.status == 200, r.body
    assert app.metrics.aborts["queue_timeout"] == 0


async def test_real_processes_queue_four_times_the_batch():
    batch = 4
    config = EngineConfig(engine_options={**FAST_SIM, "max_batch": batch})
    async with running_server(config) as url:
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:

            async def one(i: int) -> None:
                if i % 2:
                    rec = SSE()
                    await stream_into(http, {"prompt": f"p{i}", "max_tokens": 50}, rec)
                    assert rec.events[-1] == b"data: [DONE]", rec.body[-300:]
                    statuses.append(rec.status or 0)
                else:
                    r = await http.post("/v1/completions",
                                        json={"prompt": f"p{i}", "max_tokens": 50})
                    statuses.append(r.status_code)

            with trio.fail_after(300):
                async with trio.open_nursery() as nursery:
                    for i in range(4 * batch):
                        nursery.start_soon(one, i)
            assert (await http.get("/ready")).status_code == 200
    assert statuses == [200] * 4 * batch



def test_the_transformers_engine_queues_beyond_its_batch_in_arrival_order(tmp_path):
    """The transformers engine holds what its batch cannot take and starts each request as
    a slot frees, first come first served (the sim's queue is shown above; the vllm
    engine's is vLLM's scheduler)."""
    pytest.importorskip("torch")
    from server.engines.transformers.engine import TransformersEngine
    from tests.tiny_model import build_tiny_model

    engine = TransformersEngine(model_path=str(build_tiny_model(tmp_path / "tiny")),
                                max_batch=2)
    try:
        for rid in range(1, 7):
            engine.add(rid, f"prompt {rid}", {"max_tokens": 3 + rid % 2, "temperature": 0,
                                              "ignore_eos": True})
        assert (engine.running(), engine.waiting()) == (0, 6)
        first: list[int] = []
        ended: set[int] = set()
        while engine.next_deadline() is not None:
            for rid, _text, ntok, finish, _err in engine.step(0.0):
                if ntok and rid not in first:
                    first.append(rid)
                if finish is not None:
                    assert finish == "length"
                    ended.add(rid)
            assert engine.running() <= 2
        assert first == [1, 2, 3, 4, 5, 6] and ended == set(first)
    finally:
        engine.close()


def test_each_server_abort_cause_gets_its_own_answer():
    """A non-streaming request the server aborted is answered by its cause: the request
    timeout a 504, the queue-time limit a 503 server_overloaded (not "shutting down"), the
    drain a 503 shutting_down, anything else a 500."""
    from server.http.answer import abort_error

    answers = {cause: abort_error(cause) for cause in
               ("timeout", "queue_timeout", "shutdown", "something new")}
    assert {c: (e.status, e.code) for c, e in answers.items()} == {
        "timeout": (504, "request_timeout"), "queue_timeout": (503, "server_overloaded"),
        "shutdown": (503, "shutting_down"), "something new": (500, None)}
