"""Every way a client can leave cancels its request's engine work (raw sockets, real server).

Since the connection cancels a request's scope itself when its reader sees the client go
(``DirectBody.on_disconnect``, docs/architecture.md#one-request), each way the reader can
learn it is a path of its own: an HTTP/1.0 close, a half-close, a reset, a request pipelined
behind a stream, the second request of a keep-alive connection, a request still queued for a
slot, a stream whose writes are blocked by a client that stopped reading, and the Responses
endpoint streamed and whole. After each, the manager and the worker hold nothing.
"""

from __future__ import annotations

import json
import socket
import struct
from urllib.parse import urlsplit

import pytest
import trio

from tests.conftest import FAST_SIM, assert_engine_idle, running_server
from tests.test_http_cancellation import ENDLESS, read_until

STREAM = {"prompt": "go", "max_tokens": ENDLESS, "stream": True}
TIMEOUT_S = 30  # (a hang guard)


def request(url: str, path: str, body: dict, version: str = "1.1") -> bytes:
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            ).encode() + payload


async def connect(url: str) -> trio.SocketStream:
    parts = urlsplit(url)
    return await trio.open_tcp_stream(parts.hostname, parts.port)


async def wait_open_streams(engine, count: int) -> None:
    with trio.fail_after(TIMEOUT_S):
        while engine.statistics().open_streams != count:
            await trio.sleep(0.05)


def reset(sock: trio.SocketStream) -> None:
    """Make ``aclose`` send a RST instead of a FIN."""
    sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.fixture
async def url():
    """One sim slot (``max_batch`` 1), so that a second request queues behind the first."""
    from server.config import EngineConfig

    config = EngineConfig(engine_options={**FAST_SIM, "max_model_len": 1 << 20,
                                          "max_batch": 1})
    async with running_server(config, queued_heartbeat=0.2) as url:
        yield url


async def test_an_http_1_0_stream_closed(url):
    sock = await connect(url)
    await sock.send_all(request(url, "/v1/completions", STREAM, "1.0"))
    await read_until(sock, b"data: ", 5)
    await sock.aclose()
    await assert_engine_idle(url.engine)


async def test_a_half_close_mid_stream(url):
    """A client that shuts its sending side mid-stream has gone (as hypercorn and uvicorn
    take it)."""
    sock = await connect(url)
    await sock.send_all(request(url, "/v1/completions", STREAM))
    await read_until(sock, b"data: ", 5)
    await sock.send_eof()
    await assert_engine_idle(url.engine)
    await sock.aclose()


async def test_a_reset_mid_stream(url):
    sock = await connect(url)
    await sock.send_all(request(url, "/v1/completions", STREAM))
    await read_until(sock, b"data: ", 5)
    reset(sock)
    await sock.aclose()
    await assert_engine_idle(url.engine)


async def test_a_stream_with_a_request_pipelined_behind_it(url):
    sock = await connect(url)
    await sock.send_all(request(url, "/v1/completions", STREAM)
                        + request(url, "/v1/completions", {"prompt": "x", "max_tokens": 2}))
    await read_until(sock, b"data: ", 5)
    await sock.aclose()
    await assert_engine_idle(url.engine)


async def test_the_second_request_of_a_keep_alive_connection(url):
    sock = await connect(url)
    await sock.send_all(request(url, "/v1/completions",
                                {"prompt": "x", "max_tokens": 2, "stream": True}))
    await read_until(sock, b"0\r\n\r\n")
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": ENDLESS,
            "stream": True}
    await sock.send_all(request(url, "/v1/chat/completions", chat))
    await read_until(sock, b"data: ", 5)
    await sock.aclose()
    await assert_engine_idle(url.engine)


async def test_a_stream_queued_for_a_slot(url):
    """Its heartbeat comments are written while it waits; the other stream runs on."""
    first = await connect(url)
    await first.send_all(request(url, "/v1/completions", STREAM))
    await read_until(first, b"data: ", 3)
    second = await connect(url)
    await second.send_all(request(url, "/v1/completions", STREAM))
    await read_until(second, b": waiting", 2)
    await second.aclose()
    await wait_open_streams(url.engine, 1)
    await first.aclose()
    await assert_engine_idle(url.engine)


async def test_a_whole_batch_request_queued_for_a_slot(url):
    first = await connect(url)
    await first.send_all(request(url, "/v1/completions", STREAM))
    await read_until(first, b"data: ", 3)
    second = await connect(url)
    batch = {"messages": [[{"role": "user", "content": "x"}]], "max_tokens": 5}
    await second.send_all(request(url, "/v1/chat/completions/batch", batch))
    await wait_open_streams(url.engine, 2)
    await second.aclose()
    await wait_open_streams(url.engine, 1)
    await first.aclose()
    await assert_engine_idle(url.engine)


async def test_a_stream_whose_writes_are_blocked(url):
    """The client stops reading, so the server's writes fill the socket's buffers and
    block; then it resets the connection."""
    sock = await connect(url)
    sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = {**STREAM, "prompt": "go " * 100, "echo": True}
    await sock.send_all(request(url, "/v1/completions", body))
    await read_until(sock, b"data: ", 2)
    await trio.sleep(1)  # (not reading: a delay for the buffers to fill, not a bound)
    reset(sock)
    await sock.aclose()
    await assert_engine_idle(url.engine)


async def test_a_responses_stream(url):
    sock = await connect(url)
    await sock.send_all(request(url, "/v1/responses", {"input": "go", "stream": True,
                                                        "max_output_tokens": ENDLESS}))
    await read_until(sock, b"delta", 5)
    await sock.aclose()
    await assert_engine_idle(url.engine)


async def test_a_whole_response(url):
    sock = await connect(url)
    await sock.send_all(request(url, "/v1/responses", {"input": "go",
                                                        "max_output_tokens": ENDLESS}))
    await wait_open_streams(url.engine, 1)
    await sock.aclose()
    await assert_engine_idle(url.engine)
