"""Client disconnects (raw sockets) and engine faults mid-stream, through the real server.

After each, the worker must hold nothing for the request and the server must keep serving.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import trio

from tests.conftest import assert_engine_idle


async def open_request(url: str, path: str, body: dict) -> trio.SocketStream:
    """Send one HTTP/1.1 POST on a raw socket and return the socket, response unread."""
    parts = urlsplit(url)
    sock = await trio.open_tcp_stream(parts.hostname, parts.port)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    await sock.send_all(head + payload)
    return sock


async def read_until(sock: trio.SocketStream, marker: bytes, count: int = 1) -> bytes:
    data = b""
    while data.count(marker) < count:
        chunk = await sock.receive_some(65536)
        assert chunk, f"connection closed after {data!r:.300}"
        data += chunk
    return data


async def wait_worker_empty(engine, timeout: float = 30.0) -> None:
    """Within ``timeout`` (a hang guard): the manager and every worker hold nothing."""
    await assert_engine_idle(engine, timeout=timeout)


#: Tokens of a request that must be aborted, not run to its end: 60 s at the sim's 2 ms a
#: token (the most a request may ask), so idle within the 30 s hang guard proves the abort
#: on a machine of any load (the default 8192-token context ends one in 16 s by itself).
ENDLESS = 30_000


@pytest.fixture
async def long_server_url():
    """A server whose sim takes ENDLESS tokens (a context of 2**20)."""
    from server.config import EngineConfig
    from tests.conftest import FAST_SIM, running_server

    config = EngineConfig(engine_options={**FAST_SIM, "max_model_len": 1 << 20})
    async with running_server(config) as url:
        yield url


async def test_disconnect_mid_stream_aborts_promptly(long_server_url):
    sock = await open_request(
        long_server_url, "/v1/completions", {"prompt": "go", "max_tokens": ENDLESS, "stream": True}
    )
    await read_until(sock, b"data: ", 5)
    (running, _), = await long_server_url.engine.ping_all()
    assert running == 1
    await sock.aclose()
    await wait_worker_empty(long_server_url.engine)


async def test_disconnect_before_first_token(fault_server_url):
    # The request stalls before its first token: no byte of the response has been sent.
    sock = await open_request(
        fault_server_url,
        "/v1/completions",
        {"prompt": "go", "max_tokens": 50, "stream": True, "fault": {"kind": "stall", "after": 0}},
    )
    with trio.fail_after(30):
        while (await fault_server_url.engine.ping_all())[0][0] != 1:
            await trio.sleep(0.01)
    await sock.aclose()
    await wait_worker_empty(fault_server_url.engine)  # (a stalled request never ends by itself)


async def test_disconnect_during_batch_with_n(long_server_url):
    sock = await open_request(
        long_server_url,
        "/v1/completions",
        {"prompt": ["a", "b b", "c c c"], "n": 3, "max_tokens": ENDLESS, "stream": True},
    )
    await read_until(sock, b"data: ", 20)
    (running, waiting), = await long_server_url.engine.ping_all()
    assert running + waiting == 9
    await sock.aclose()
    await wait_worker_empty(long_server_url.engine)


async def test_disconnect_while_waiting_for_a_non_streaming_answer(long_server_url):
    sock = await open_request(long_server_url, "/v1/completions",
                              {"prompt": "go", "max_tokens": ENDLESS})
    with trio.fail_after(30):
        while (await long_server_url.engine.ping_all())[0][0] != 1:
            await trio.sleep(0.01)
    await trio.sleep(0.1)
    await sock.aclose()
    await wait_worker_empty(long_server_url.engine)


async def test_engine_error_mid_stream_is_an_error_event(fault_server_url):
    async with openai.AsyncOpenAI(
        base_url=fault_server_url + "/v1", api_key="x", max_retries=0
    ) as c:
        stream = await c.completions.create(
            model="sim",
            prompt="p",
            max_tokens=20,
            stream=True,
            extra_body={"fault": {"kind": "error", "after": 3}},
        )
        got = ""
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                got += chunk.choices[0].text
        assert "injected engine failure" in str(info.value.message)
        assert len(got.split()) == 3
        # Non-streaming: the same failure is a 500 with an OpenAI body.
        with pytest.raises(openai.InternalServerError):
            await c.completions.create(
                model="sim", prompt="p", max_tokens=20,
                extra_body={"fault": {"kind": "error", "after": 3}},
            )
        # Before the first token: a status, not a stream.
        with pytest.raises(openai.InternalServerError):
            await c.completions.create(
                model="sim", prompt="p", max_tokens=20, stream=True,
                extra_body={"fault": {"kind": "error", "after": 0}},
            )
        r = await c.completions.create(model="sim", prompt="p", max_tokens=3)
        assert r.choices[0].finish_reason == "length"


async def test_error_event_then_done_on_the_wire(fault_server_url):
    body = {"prompt": "p", "max_tokens": 20, "stream": True, "n": 2,
            "fault": {"kind": "error", "after": 2}}
    async with httpx.AsyncClient(base_url=fault_server_url) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            raw = b"".join([part async for part in r.aiter_raw()])
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][6:])
    assert error["error"]["type"] == "engine_error"
    assert "Traceback" not in raw.decode()
    await wait_worker_empty(fault_server_url.engine)


async def test_worker_crash_ends_streams_and_the_worker_restarts(fault_server_url):
    engine = fault_server_url.engine
    pid_before = engine.statistics().workers[0].pid
    body = {"prompt": "p", "max_tokens": 50, "stream": True, "fault": {"kind": "crash", "after": 3}}
    async with httpx.AsyncClient(base_url=fault_server_url, timeout=30) as http:
        with trio.fail_after(30):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "worker_died"
        with trio.fail_after(30):
            while not engine.statistics().workers[0].alive:
                await trio.sleep(0.02)
        stats = engine.statistics().workers[0]
        assert stats.restarts == 1 and stats.pid != pid_before
        r = await http.post("/v1/completions", json={"prompt": "again", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


async def test_ignored_abort_is_cut_off_at_the_drain_deadline(fault_server_url):
    engine = fault_server_url.engine  # drain_timeout is 0.5 s in this fixture
    sock = await open_request(
        fault_server_url,
        "/v1/completions",
        {"prompt": "p", "max_tokens": 400, "stream": True,
         "fault": {"kind": "ignore_abort", "after": 0}},
    )
    await read_until(sock, b"data: ", 3)
    await sock.aclose()
    with trio.fail_after(30):
        while engine.statistics().open_streams:
            await trio.sleep(0.01)
    # The manager let go; the worker is still generating (it ignores the abort), and its
    # late output is dropped until it finishes by itself.
    assert engine.statistics().outstanding == 0
    await wait_worker_empty(engine)


async def test_stalled_stream_and_a_client_timeout(fault_server_url):
    async with openai.AsyncOpenAI(
        # the client's timeout ends the stalled stream; 5 s, as it also bounds the wait for
        # the response's head, which a busy machine can stretch past 1 s
        base_url=fault_server_url + "/v1", api_key="x", max_retries=0, timeout=5.0
    ) as c:
        stream = await c.completions.create(
            model="sim", prompt="p", max_tokens=20, stream=True,
            extra_body={"fault": {"kind": "stall", "after": 2}},
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    await wait_worker_empty(fault_server_url.engine)


async def test_request_timeout_aborts_on_the_engine():
    from tests.conftest import running_server

    # 3 s: the 3-token request below must fit in it on a busy machine; the 5000-token ones
    # take 10 s at the sim's 2 ms a token however idle the machine is
    async with running_server(request_timeout=3.0) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"prompt": "p", "max_tokens": 5000, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
            events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
            assert raw.endswith(b"data: [DONE]\n\n")
            assert events[-1]["choices"][0]["finish_reason"] == "abort"
            assert sum(len(e["choices"][0]["text"].split()) for e in events) < 5000
            r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 5000})
            assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
            r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
            assert r.status_code == 200
        await assert_engine_idle(url.engine)


async def test_max_concurrent_requests_answers_503_before_queueing():
    from tests.conftest import running_server

    async with running_server(max_concurrent_requests=2) as url:
        socks = [
            await open_request(url, "/v1/completions", {"prompt": "p", "max_tokens": 5000, "stream": True})
            for _ in range(2)
        ]
        for s in socks:
            await read_until(s, b"data: ", 1)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
            (running, waiting), = await url.engine.ping_all()
            assert running + waiting == 2
            for s in socks:
                await s.aclose()
            await assert_engine_idle(url.engine)
            r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
            assert r.status_code == 200
