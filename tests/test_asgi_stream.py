"""server.testing's ASGI client reading a response as it arrives, and leaving mid-stream;
the kit's context managers raise a body's exception as itself. Virtual time."""

from __future__ import annotations

import pytest
import trio

import server
from server.testing import (
    ASGIClient,
    open_asgi_client,
    open_in_memory_engine,
    open_in_memory_spawner,
)


async def test_a_stream_is_read_as_it_arrives_and_left_in_the_middle(autojump_clock):
    body = {"prompt": "a b", "max_tokens": 1000, "stream": True}
    async with open_in_memory_spawner() as spawner:
        async with open_in_memory_engine(spawner=spawner, ttft_ms=50, itl_ms=100,
                                         prefill_us_per_token=0) as engine:
            async with open_asgi_client(server.create_app(engine=engine)) as client:
                start = trio.current_time()
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status == 200
                    assert r.header("content-type").startswith("text/event-stream")
                    events = r.events()
                    first = await events.__anext__()
                    assert trio.current_time() - start == pytest.approx(0.05)
                    second = await events.__anext__()
                    assert trio.current_time() - start == pytest.approx(0.15)
                    await events.aclose()
                    await r.disconnect()  # returns once the app has returned
                    assert trio.current_time() - start == pytest.approx(0.15)
                # the app saw a client that went away: one abort, nothing left (the engine
                # block checks it), and no end of stream was sent
                [rid] = spawner.rids()
                assert spawner.aborts(rid) == 1
                assert [e["choices"][0]["text"] for e in (first, second)] == [
                    e["choices"][0]["text"] for e in r.response.sse()
                ]
                # leaving the block early is a disconnect too
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert len(await r.__anext__()) > 0
                assert spawner.aborts() == 2
                # read to its end, chunk by chunk: the whole response, as request() gives it
                async with client.stream("POST", "/v1/completions",
                                         json={**body, "max_tokens": 3}) as r:
                    chunks = [chunk async for chunk in r]
                assert b"".join(chunks) == r.response.body
                assert r.response.sse()[-1] == "[DONE]"


async def test_an_apps_exception_comes_out_as_itself(autojump_clock):
    async def fails_after_starting(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise KeyError("the app's")

    async def answers_nothing(scope, receive, send):
        await receive()

    async def fails_at_once(scope, receive, send):
        raise KeyError("at once")

    client = ASGIClient(fails_after_starting)
    with pytest.raises(KeyError, match="the app's"):
        await client.post("/")
    with pytest.raises(KeyError, match="the app's"):
        async with client.stream("GET", "/") as r:
            assert await r.__anext__() == b"part"
            await r.__anext__()
    with pytest.raises(KeyError, match="at once"):
        await ASGIClient(fails_at_once).get("/")
    with pytest.raises(AssertionError, match="answered nothing"):
        await ASGIClient(answers_nothing).get("/")


async def test_a_body_exception_comes_out_of_the_spawner_as_itself(autojump_clock):
    # as from open_engine and open_in_memory_engine: `except` around the block catches it
    with pytest.raises(KeyError, match="mine"):
        async with open_in_memory_spawner():
            raise KeyError("mine")
    with pytest.raises(server.ClientError):
        async with open_in_memory_spawner() as spawner:
            async with open_in_memory_engine(spawner=spawner) as engine:
                async with engine.generate("a b c", server.SamplingParams(max_tokens=9000)) as s:
                    await s.wait_started()
