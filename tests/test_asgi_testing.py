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


async def test_the_fault_hook_is_refused_by_name_unless_enabled(autojump_clock):
    body = {"prompt": "a", "max_tokens": 3, "fault": {"kind": "error", "after": 0}}
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
            "fault": {"kind": "error", "after": 0}}
    async with open_in_memory_engine() as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            for path, data in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                r = await client.post(path, json=data)
                assert r.status == 400 and r.json()["error"]["param"] == "fault", r.body
    limits = server.Limits(allow_faults=True)
    async with open_in_memory_engine() as engine:
        app = server.create_app(server.ServerConfig(limits=limits), engine=engine)
        async with open_asgi_client(app) as client:
            r = await client.post("/v1/completions", json=body)
            assert r.status == 500 and r.json()["error"]["type"] != "invalid_request_error", r.body
            r = await client.post("/v1/completions", json={**body, "fault": "error"})
            assert r.status == 400 and r.json()["error"]["param"] == "fault", r.body


async def test_force_include_usage_ends_every_stream_with_usage(autojump_clock):
    # vLLM's --enable-force-include-usage: a usage chunk whatever stream_options say, and
    # usage on every chunk (vLLM's should_include_usage: include and continuous usage)
    body = {"prompt": "a b", "max_tokens": 4, "stream": True}
    async with open_in_memory_engine() as engine:
        for force in (False, True):
            config = server.ServerConfig(limits=server.Limits(force_include_usage=force))
            async with open_asgi_client(server.create_app(config, engine=engine)) as client:
                for options in (None, {"include_usage": False}, {"include_usage": True}):
                    data = body if options is None else {**body, "stream_options": options}
                    events = (await client.post("/v1/completions", json=data)).sse()
                    assert events[-1] == "[DONE]"
                    last = events[-2]
                    asked = bool(options and options["include_usage"])
                    if force or asked:
                        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
                    else:
                        assert "usage" not in last or last["usage"] is None, last
                    for event in events[:-2] if force else ():
                        usage = event["usage"]
                        assert usage["total_tokens"] == (
                            usage["prompt_tokens"] + usage["completion_tokens"]), event


async def test_a_custom_role_is_accepted_with_text_or_parts_alike(autojump_clock):
    # vLLM's custom roles: the role goes to the chat template as it is
    base = {"max_tokens": 5, "temperature": 0, "seed": 0}
    async with open_in_memory_engine() as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            texts = []
            for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]):
                r = await client.post("/v1/chat/completions", json={
                    **base, "messages": [{"role": "my-custom-role", "content": content}]})
                assert r.status == 200, r.body
                texts.append(r.json()["choices"][0]["message"]["content"])
            r = await client.post("/v1/chat/completions", json={
                **base, "messages": [{"role": "x" * 65, "content": "a"}]})
    assert texts[0] == texts[1]
    assert r.status == 400 and r.json()["error"]["param"] == "messages[0].role"


async def test_an_app_in_virtual_time_opens_no_state_store(autojump_clock):
    # A store's reads run in a thread, and an autojump clock jumps ahead while one runs (its
    # sweep's minute, every timeout): such an app runs as one with ServerConfig(state_store=
    # False), responses unstored and a request for storing refused by name.
    async with open_in_memory_engine() as engine:
        app = server.create_app(engine=engine)
        async with open_asgi_client(app) as client:
            assert app.state_store is None
            body = {"model": "sim", "input": "a b"}
            r = await client.post("/v1/responses", json=body)
            assert r.status == 200 and r.json()["store"] is False, r.body
            r = await client.post("/v1/responses", json={**body, "store": True})
            assert r.status == 400 and r.json()["error"]["param"] == "store", r.body
            r = await client.get("/v1/files")
            assert r.status == 503, r.body
