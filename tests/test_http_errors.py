"""Bad input: the right status, an OpenAI-style body, no traceback, and the server goes on."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from server.config import EngineConfig, Limits
from tests.conftest import FAST_SIM, JSON, running_server

BAD_COMPLETIONS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'"a string"', 400, None),
    (b"\xff\xfe\x00", 400, None),
    (b"[" * 100000 + b"]" * 100000, 400, None),
    (b'{"max_tokens": 4}', 400, "prompt"),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": ""}', 400, "prompt"),
    (b'{"prompt": [1, "a"]}', 400, "prompt"),
    (b'{"prompt": [-1]}', 400, "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": true}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 1e400}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 99999999999999999999999999}', 400, "max_tokens"),
    (b'{"prompt": "hi", "n": 0}', 400, "n"),
    (b'{"prompt": "hi", "n": 1000}', 400, "n"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "hi", "stop": 3}', 400, "stop"),
    (b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    (b'{"prompt": "hi", "logprobs": 2}', 400, "logprobs"),
    (b'{"prompt": [1, 2], "echo": true}', 400, "echo"),
    (b'{"prompt": "hi", "model": 7}', 400, "model"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    # fields with a meaning the server does not honour yet: refused, never ignored
    (b'{"prompt": "hi", "presence_penalty": 0.5}', 400, "presence_penalty"),
    (b'{"prompt": "hi", "frequency_penalty": -1}', 400, "frequency_penalty"),
    (b'{"prompt": "hi", "logit_bias": {"50256": -100}}', 400, "logit_bias"),
    (b'{"prompt": "hi", "top_k": 5}', 400, "top_k"),
    (b'{"prompt": "hi", "best_of": 3}', 400, "best_of"),
    (b'{"prompt": "hi", "response_format": {"type": "xml"}}', 400, "response_format"),
    (b'{"prompt": "hi", "guided_json": {"type": "object"}}', 400, "guided_json"),
    (b'{"prompt": "hi", "skip_special_tokens": false}', 400, "skip_special_tokens"),
    (b'{"prompt": "hi", "use_beam_search": true}', 400, "use_beam_search"),
]

BAD_CHAT = [
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": "hi"}', 400, "messages"),
    (b'{"messages": [{"role": 7, "content": "x"}]}', 400, "messages[0].role"),
    (b'{"messages": [{"role": "", "content": "x"}]}', 400, "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages[0].content[0]"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
     b'{"type": "input_audio"}]}]}', 400, "messages[0].content[1]"),
    (b'{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
    # a part type that is not a string (found by the property test: it was a 500)
    (b'{"messages": [{"role": "system", "content": [{"type": []}]}]}', 400,
     "messages[0].content[0]"),
    (b'{"messages": [{"role": "system", "content": null}]}', 400, "messages[0].content"),
    (b'{"messages": [{"role": "tool", "content": "42"}]}', 400, "messages[0].tool_call_id"),
    # (a tool result in the history needs no --tool-call-parser: the sim renders it)
    (b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "c1"}]}]}', 400,
     "messages[0].tool_calls[0]"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', 400,
     "tools[0].function"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     b'"function": {"name": "f"}}]}', 400, "tools"),  # auto, without --tool-call-parser
    (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}', 400, "logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens"),
]


def check_error_body(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert body["error"]["param"] == param


async def test_bad_requests_get_4xx_and_the_server_goes_on(server_url):
    async with httpx.AsyncClient(base_url=server_url, timeout=10) as http:
        for body, status, param in BAD_COMPLETIONS:
            r = await http.post("/v1/completions", content=body, headers=JSON)
            check_error_body(r, status, param)
        for body, status, param in BAD_CHAT:
            r = await http.post("/v1/chat/completions", content=body, headers=JSON)
            check_error_body(r, status, param)
        ok = await http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
        assert ok.status_code == 200


async def test_routes_methods_and_sizes():
    async with running_server(max_body_bytes=1000) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            check_error_body(await http.get("/v1/nothing"), 404, None)
            check_error_body(await http.post("/v1/nothing", json={}), 404, None)
            r = await http.get("/v1/completions")
            check_error_body(r, 405, None)
            assert r.headers["allow"] == "POST"
            check_error_body(await http.put("/v1/chat/completions", json={}), 405, None)
            check_error_body(await http.post("/health"), 405, None)
            big = {"prompt": "x " * 1000}
            check_error_body(await http.post("/v1/completions", json=big), 413, None)

            async def chunks():  # no Content-Length: the limit applies while reading
                for _ in range(10):
                    yield b"x" * 200

            r = await http.post("/v1/completions", content=chunks(), headers=JSON)
            check_error_body(r, 413, None)
            ok = await http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 1})
            assert ok.status_code == 200


async def test_prompt_over_the_context_is_a_400_before_the_stream():
    config = EngineConfig(engine_options={**FAST_SIM, "max_model_len": 20})
    async with running_server(config) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.BadRequestError) as info:
                await c.completions.create(model="sim", prompt="w " * 15, max_tokens=10)
            assert "maximum context length is 20" in info.value.message
            with pytest.raises(openai.BadRequestError):
                await c.completions.create(
                    model="sim", prompt="w " * 15, max_tokens=10, stream=True
                )
            # One bad prompt in a batch fails the whole request, before anything is sent.
            with pytest.raises(openai.BadRequestError):
                await c.completions.create(
                    model="sim", prompt=["fine", "w " * 25], max_tokens=2, stream=True
                )
            r = await c.completions.create(model="sim", prompt="w " * 15, max_tokens=5)
            assert r.usage.total_tokens == 20


async def test_caps_are_configurable():
    async with running_server(limits=Limits(max_n=2, max_tokens=10, max_prompts=2)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            check_error_body(
                await http.post("/v1/completions", json={"prompt": "a", "n": 3}), 400, "n"
            )
            check_error_body(
                await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 11}),
                400,
                "max_tokens",
            )
            check_error_body(
                await http.post("/v1/completions", json={"prompt": ["a", "b", "c"]}), 400, "prompt"
            )


async def test_503_with_retry_after_when_no_worker_is_up():
    # A worker that takes long to start: the server listens at once and answers 503.
    config = EngineConfig(engine_options={**FAST_SIM, "startup_delay_ms": 1500})
    async with trio.open_nursery() as nursery:
        seen = {}

        async def probe(url):
            async with httpx.AsyncClient(base_url=url) as http:
                seen["health"] = await http.get("/health")
                seen["gen"] = await http.post("/v1/completions", json={"prompt": "a"})

        from server.config import ServerConfig
        from server.http.app import create_app
        from server.http.serve import serve
        import functools

        cfg = ServerConfig(engine=config, port=0, shutdown_timeout=0, close_timeout=0.2)
        app = create_app(cfg)
        stop = trio.Event()
        binds = await nursery.start(
            functools.partial(serve, cfg, app=app, shutdown_trigger=stop, wait_ready=False)
        )
        await probe(binds[0])
        stop.set()
    assert seen["health"].status_code == 503
    check_error_body(seen["gen"], 503, None)
    assert seen["gen"].headers["retry-after"] == "1"


async def test_a_bug_of_ours_mid_stream_ends_the_stream_with_an_error_event(monkeypatch):
    # Seed (a): an exception raised by the server's own code into a started stream must not
    # crash it or the server: the stream ends with an error event and data: [DONE], the
    # request is aborted on the engine, and the next request is served.
    from server.connections import sink
    from server.openai import encode
    from tests.sse_record import SSE, stream_into

    real = encode.text_json
    calls = 0

    def faulty(text):
        nonlocal calls
        calls += 1
        # A test-only fault, a few events into the stream, there to stay: the router
        # meets it first (server.connections.sink writes plain text events) and must go on
        # routing; the request's task meets it next (ChunkEncoder.delta) and ends the stream.
        if calls >= 5:
            raise RuntimeError("a bug in the encoder")
        return real(text)

    for module in (encode, sink):
        monkeypatch.setattr(module, "text_json", faulty)
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            rec = SSE()
            await stream_into(http, {"prompt": "a", "max_tokens": 500}, rec)
            assert rec.status == 200 and rec.done
            assert rec.error()["type"] == "engine_error" and "Traceback" not in rec.body.decode()
            assert 0 < rec.tokens() < 500
            for module in (encode, sink):
                monkeypatch.setattr(module, "text_json", real)
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 200
        # running_server checks that nothing is left in the manager or the worker


async def test_fields_at_their_neutral_values_and_unknown_fields_are_served(server_url):
    # What clients send by default for fields the server does not honour means "not
    # used", and fields nobody defines are ignored (as OpenAI and vLLM do).
    neutral = {
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "top_k": -1,
        "min_p": 0, "repetition_penalty": 1.0, "response_format": {"type": "text"},
        "skip_special_tokens": True, "tools": [], "tool_choice": "none", "metadata": {"a": "b"},
        "x_my_own_field": [1, 2], "bad_words": [], "priority": 0, "echo": False,
        "return_token_ids": False, "return_tokens_as_token_ids": False,
        "safety_identifier": "user-1", "logits_processors": [], "mm_processor_kwargs": {},
    }
    async with httpx.AsyncClient(base_url=server_url, timeout=10) as http:
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **neutral})
        assert r.status_code == 200, r.text
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **neutral,
        })
        assert r.status_code == 200, r.text


#: issue 29 item 6: what vLLM and OpenAI define and the sim engine does not honour
REFUSED_BY_NAME = {
    "allowed_token_ids": [1, 2], "bad_words": ["a"], "cache_salt": "s", "priority": 5,
    "logits_processors": ["m.P"], "return_tokens_as_token_ids": True,
    "return_token_ids": True, "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"k": 1}, "mm_processor_kwargs": {"k": 1},
    "verbosity": "low", "prompt_cache_key": "k",
}


async def test_vllm_and_openai_fields_without_an_effect_here_are_refused_by_name(server_url):
    async with httpx.AsyncClient(base_url=server_url, timeout=10) as http:
        for name, value in REFUSED_BY_NAME.items():
            for route, body in (("/v1/completions", {"prompt": "hi"}),
                                ("/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}]})):
                r = await http.post(route, json={**body, "max_tokens": 2, name: value})
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == name, (name, r.text)
                assert f"'{name}'" in error["message"]
        # every refused field is named, not only the first
        r = await http.post("/v1/completions", json={"prompt": "hi", **REFUSED_BY_NAME})
        message = r.json()["error"]["message"]
        assert r.status_code == 400
        assert [n for n in REFUSED_BY_NAME if f"'{n}'" not in message] == []
        r = await http.post("/v1/completions", json={"prompt": "hi", "safety_identifier": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "safety_identifier"


@pytest.mark.direct_http
async def test_every_status_line_has_its_reason_phrase(server_url):
    """``HTTP/1.1 400 Bad Request``, not ``HTTP/1.1 400 `` (hypercorn writes no reason:
    some proxies and tools print an empty one); a ``100 Continue`` too."""
    host, port = server_url.removeprefix("http://").rsplit(":", 1)
    requests = {
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n": b"HTTP/1.1 200 OK\r\n",
        b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n": b"HTTP/1.1 404 Not Found\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}": b"HTTP/1.1 400 Bad Request\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n": b"HTTP/1.1 100 Continue\r\n",
    }
    with trio.fail_after(60):
        for request, status_line in requests.items():
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(request)
                head = b""
                while b"\r\n" not in head:
                    data = await stream.receive_some(4096)
                    assert data, head
                    head += data
            assert head.startswith(status_line), head[:80]
