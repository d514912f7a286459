"""server.testing.asgi: the HTTP app on the in-memory engine in virtual time, no sockets."""

from __future__ import annotations

import pytest

import server
from server.testing import open_in_memory_engine
from server.testing.asgi import open_asgi_client


async def test_a_completion_and_a_stream_in_virtual_time(autojump_clock):
    import trio

    async with open_in_memory_engine(ttft_ms=50, itl_ms=100, prefill_us_per_token=0) as engine:
        app = server.create_app(engine=engine)
        async with open_asgi_client(app) as client:
            r = await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 5})
            assert r.status == 200, r.body
            assert r.json()["usage"]["completion_tokens"] == 5
            assert r.header("x-request-id")
            start = trio.current_time()
            body = {"prompt": "a b", "max_tokens": 5, "stream": True}
            r = await client.post("/v1/completions", json=body)
    assert r.status == 200 and r.header("content-type").startswith("text/event-stream")
    events = r.sse()
    assert events[-1] == "[DONE]"
    assert len("".join(e["choices"][0]["text"] for e in events[:-1]).split()) == 5
    # one event per engine step, each at its exact (virtual) time: 50 ms, then every 100 ms
    times = [t - start for t, data in r.chunks if data.startswith(b"data: {")]
    assert times == [pytest.approx(0.05 + 0.1 * i, abs=1e-6) for i in range(5)]


async def test_errors_and_timeouts_have_their_status(autojump_clock):
    async with open_in_memory_engine(itl_ms=100) as engine:
        config = server.ServerConfig(request_timeout=1.0)
        async with open_asgi_client(server.create_app(config, engine=engine)) as client:
            r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
            assert r.status == 400 and r.json()["error"]["param"] == "max_tokens"
            r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 500})
            assert r.status == 504, r.body
