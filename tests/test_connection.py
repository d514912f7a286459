"""The connection layer under hypercorn (server/connections/connection.py): direct socket writes,
chunks framed without h11, keep-alive after early answers, writes larger than the socket
buffer. Real server on a loopback port; responses parsed by h11 as a strict client."""

from __future__ import annotations

import gc
import json
import socket

import h11
import pytest
import trio

from tests.conftest import running_server
from tests.test_hostile import addr


def request(conn: h11.Connection | None, body: dict, headers=(), path="/v1/completions") -> bytes:
    """The bytes of one POST; through ``conn`` (an h11 client), or as HTTP/1.0 without one."""
    data = json.dumps(body).encode()
    fields = [("Host", "t"), ("Content-Type", "application/json"),
              ("Content-Length", str(len(data))), *headers]
    if conn is None:
        head = [f"POST {path} HTTP/1.0", *(f"{k}: {v}" for k, v in fields)]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + data
    return b"".join((
        conn.send(h11.Request(method="POST", target=path, headers=fields)),
        conn.send(h11.Data(data=data)),
        conn.send(h11.EndOfMessage()),
    ))


async def read_response(sock, conn: h11.Connection) -> tuple[h11.Response, bytes, list]:
    """One response, parsed by h11 (which raises on any framing error); the body, and the
    size of every chunk as it was framed on the wire."""
    response, body, chunks = None, [], []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await sock.receive_some(1 << 16))
            continue
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body.append(event.data)
            if event.chunk_start:
                chunks.append(len(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return response, b"".join(body), chunks
        elif isinstance(event, h11.ConnectionClosed):
            raise AssertionError("the connection closed before the end of the response")


def sse_payloads(body: bytes) -> list:
    events = body.decode().split("\n\n")
    assert events[-1] == ""
    return [e.removeprefix("data: ") for e in events[:-1]]


def header(response: h11.Response, name: bytes) -> bytes | None:
    return dict(response.headers).get(name)


async def test_sse_chunks_are_framed_exactly_and_the_connection_is_reused():
    body = {"prompt": "one two three", "max_tokens": 24, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    async with running_server() as url:
        sock = await trio.open_tcp_stream(*addr(url))
        conn = h11.Connection(h11.CLIENT)
        texts = []
        with trio.fail_after(20):
            for _ in range(3):
                await sock.send_all(request(conn, body))
                response, raw, chunks = await read_response(sock, conn)
                assert response.status_code == 200
                assert header(response, b"transfer-encoding") == b"chunked"
                assert header(response, b"connection") != b"close"
                # every write is one chunk holding whole events: the outputs (one write
                # or more: a stalled frontend reads every step at once), then the tail
                assert len(chunks) >= 2 and all(size > 0 for size in chunks)
                payloads = sse_payloads(raw)
                assert payloads[-1] == "[DONE]"
                chunks_json = [json.loads(p) for p in payloads[:-1]]
                usage = chunks_json[-1]["usage"]
                assert usage["completion_tokens"] == 48
                text = ["", ""]
                for c in chunks_json[:-1]:
                    for choice in c["choices"]:
                        text[choice["index"]] += choice["text"]
                texts.append(text)
                conn.start_next_cycle()
        await sock.aclose()
        # greedy: the same text each time, and the same as the non-streaming answer
        assert texts[0] == texts[1] == texts[2] and texts[0][0] == texts[0][1]
        full = await raw_json(url, {**body, "stream": False, "stream_options": None})
        assert [c["text"] for c in full["choices"]] == texts[0]


async def raw_json(url: str, body: dict) -> dict:
    body = {k: v for k, v in body.items() if v is not None}
    sock = await trio.open_tcp_stream(*addr(url))
    conn = h11.Connection(h11.CLIENT)
    await sock.send_all(request(conn, body))
    with trio.fail_after(20):
        response, raw, _ = await read_response(sock, conn)
    await sock.aclose()
    assert response.status_code == 200 and header(response, b"content-length") is not None
    return json.loads(raw)


async def test_an_http10_client_gets_a_close_delimited_stream():
    body = {"prompt": "a b", "max_tokens": 10, "stream": True}
    async with running_server() as url:
        sock = await trio.open_tcp_stream(*addr(url))
        await sock.send_all(request(None, body))
        raw = b""
        with trio.fail_after(20):
            while chunk := await sock.receive_some(1 << 16):
                raw += chunk
        await sock.aclose()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    # no chunk framing in the body: it is SSE events from the first byte to the last
    assert payload.startswith(b"data: {") and payload.endswith(b"data: [DONE]\n\n")
    events = [json.loads(p) for p in sse_payloads(payload)[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_answers_before_the_body_is_read_keep_the_connection_alive():
    # The 401 is decided before the body is needed; answered at once, it would be complete
    # before hypercorn's reader has the end of the body, and hypercorn would then close the
    # connection instead of keeping it alive. The connection must be kept alive every time.
    body = {"prompt": "a", "max_tokens": 2}
    async with running_server(api_keys=("k1",)) as url:
        sock = await trio.open_tcp_stream(*addr(url))
        conn = h11.Connection(h11.CLIENT)
        with trio.fail_after(30):
            for i in range(40):
                data = request(conn, body)
                head_end = data.index(b"\r\n\r\n") + 4
                # like httpx: the head and the body in two writes, the body a moment later
                # on every other request
                await sock.send_all(data[:head_end])
                if i % 2:
                    await trio.sleep(0.01)
                await sock.send_all(data[head_end:])
                response, raw, _ = await read_response(sock, conn)
                assert response.status_code == 401, i
                assert header(response, b"connection") != b"close", i
                assert json.loads(raw)["error"]["type"] == "authentication_error"
                conn.start_next_cycle()
            await sock.send_all(request(conn, body, headers=[("Authorization", "Bearer k1")]))
            response, raw, _ = await read_response(sock, conn)
        await sock.aclose()
    assert response.status_code == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2


async def test_a_write_larger_than_the_socket_buffers_arrives_whole():
    # The first event echoes 16 copies of a ~50 KB prompt (~800 KB in one write) to a client
    # with a small receive buffer that does not read for a while: the kernel takes part of
    # the write, the rest goes out as the client reads.
    prompt = " ".join(f"word{i}" for i in range(6000))
    body = {"prompt": prompt, "max_tokens": 3, "n": 16, "echo": True, "stream": True}
    async with running_server() as url:
        host, port = addr(url)
        raw_sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        raw_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await raw_sock.connect((host, port))
        sock = trio.SocketStream(raw_sock)
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 24)
        await sock.send_all(request(conn, body))
        await trio.sleep(0.5)
        with trio.fail_after(30):
            response, raw, _ = await read_response(sock, conn)
        await sock.aclose()
    assert response.status_code == 200
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    text = [""] * 16
    for p in payloads[:-1]:
        for choice in json.loads(p)["choices"]:
            text[choice["index"]] += choice["text"]
    assert all(t.startswith(prompt) and len(t.split()) == 6003 for t in text)


async def test_an_answer_before_the_end_of_an_unread_body_says_connection_close():
    # A body over the limit is not read to its end: the 413 must tell the client not to
    # reuse the connection (hypercorn closes it), rather than leave it to find out.
    async with running_server(max_body_bytes=1000) as url:
        sock = await trio.open_tcp_stream(*addr(url))
        conn = h11.Connection(h11.CLIENT)
        head = conn.send(h11.Request(method="POST", target="/v1/completions", headers=[
            ("Host", "t"), ("Content-Type", "application/json"),
            ("Transfer-Encoding", "chunked")]))
        await sock.send_all(head + conn.send(h11.Data(data=b"x" * 1500)))
        with trio.fail_after(10):
            response, raw, _ = await read_response(sock, conn)
            assert response.status_code == 413
            assert header(response, b"connection") == b"close"
            assert json.loads(raw)["error"]["code"] == "payload_too_large"
            while await sock.receive_some(1 << 16):  # then the server closes it
                pass
        await sock.aclose()


async def test_routes_that_do_not_read_a_body_say_connection_close_only_when_there_is_one():
    # Quart's routes (and the 401 of paths other than the generation routes) answer
    # without reading a body: with one on its way (here it comes a moment after the head,
    # as httpx sends it), the answer says Connection: close and the connection ends;
    # without one, it is kept alive.
    async with running_server(api_keys=("k1",)) as url:
        for path, status in (("/v1/nothing", 401), ("/nothing", 401), ("/health", 405)):
            sock = await trio.open_tcp_stream(*addr(url))
            conn = h11.Connection(h11.CLIENT)
            with trio.fail_after(10):
                for _ in range(3):  # bodiless: kept alive
                    await sock.send_all(conn.send(h11.Request(
                        method="GET" if status != 405 else "POST", target=path,
                        headers=[("Host", "t"), ("Content-Length", "0")])))
                    await sock.send_all(conn.send(h11.EndOfMessage()))
                    response, _, _ = await read_response(sock, conn)
                    assert response.status_code in (status, 404), (path, response)
                    assert header(response, b"connection") != b"close", path
                    conn.start_next_cycle()
                data = request(conn, {"x": 1}, path=path)
                head_end = data.index(b"\r\n\r\n") + 4
                await sock.send_all(data[:head_end])
                await trio.sleep(0.01)
                await sock.send_all(data[head_end:])
                response, _, _ = await read_response(sock, conn)
                assert response.status_code == status, (path, response)
                assert header(response, b"connection") == b"close", path
                while await sock.receive_some(1 << 16):  # and the server closes it
                    pass
            await sock.aclose()


async def test_a_connection_in_use_outlives_its_keep_alive_timeout():
    # The keep-alive timer runs while the connection is idle between requests and is
    # stopped by the next one: requests every 0.5 s (and in the middle a 5 s stream, longer
    # than the timeout: the timer does not run during a request) on
    # a connection with a 4 s keep-alive timeout keep it open well past 4 s; once idle, it
    # is closed. The bounds are causal, not timings: the timer cannot start before the
    # last request was sent (the server runs on this test's clock), and the idle gaps are
    # an eighth of the timeout (a stall of 3.5 s between two requests would be needed to
    # break them; with 2 s, 1.75 s was within a loaded CI machine's reach).
    timeout = 4.0
    async with running_server(keep_alive_timeout=timeout) as url:
        sock = await trio.open_tcp_stream(*addr(url))
        opened_at = trio.current_time()
        conn = h11.Connection(h11.CLIENT)
        bodies = [{"prompt": "a", "max_tokens": 2}] * 5 + [
            {"prompt": "a", "max_tokens": 2500, "stream": True}] + [{"prompt": "a", "max_tokens": 2}] * 5
        with trio.fail_after(60):
            for i, body in enumerate(bodies):
                if i:
                    await trio.sleep(timeout / 8)
                last_sent = trio.current_time()
                await sock.send_all(request(conn, body))
                response, _, _ = await read_response(sock, conn)
                assert response.status_code == 200
                conn.start_next_cycle()
            while await sock.receive_some(1 << 16):
                pass
            closed_at = trio.current_time()
        assert closed_at - opened_at > timeout  # it outlived the timeout while in use
        assert closed_at - last_sent >= timeout  # then closed once idle for the timeout
        await sock.aclose()


@pytest.mark.direct_http
async def test_a_stopping_server_ends_its_idle_connections_at_once():
    """Idle keep-alive connections (one served, one never used) are closed when the server
    stops, as hypercorn's own do: neither their keep-alive time (300 s) nor the close
    timeout (300 s) is waited for. The hang guard is what fails without it."""
    with trio.fail_after(60):
        async with running_server(keep_alive_timeout=300.0, close_timeout=300.0) as url:
            served = await trio.open_tcp_stream(*addr(url))
            conn = h11.Connection(h11.CLIENT)
            await served.send_all(request(conn, {"prompt": "a", "max_tokens": 2}))
            response, _, _ = await read_response(served, conn)
            assert response.status_code == 200
            unused = await trio.open_tcp_stream(*addr(url))
            pool = url.app.connections
            while pool.statistics().idle < 2:
                await trio.sleep(0.01)
        for sock in (served, unused):  # (the server has stopped: they were closed)
            while await sock.receive_some(1 << 16):
                pass
            await sock.aclose()


def _live_http_objects() -> int:
    """This server's connection and request objects alive in the process."""
    from server.connections.connection import ServingConnection
    from server.connections.http11 import DirectBody, ServingH11Protocol, ServingHTTPStream

    kinds = (ServingConnection, ServingH11Protocol, ServingHTTPStream, DirectBody)
    return sum(1 for o in gc.get_objects() if isinstance(o, kinds))


@pytest.mark.direct_http
async def test_connections_and_requests_are_freed_without_the_garbage_collector():
    # Hypercorn's objects refer to one another both ways; each connection or request that
    # left a reference cycle was freed only by a collection, whose pauses stop every stream.
    # With the collector off, they must all go when their connections end.
    body = {"prompt": "one two", "max_tokens": 8, "stream": True}
    async with running_server() as url:
        gc.collect()
        gc.disable()
        try:
            sock = await trio.open_tcp_stream(*addr(url))
            conn = h11.Connection(h11.CLIENT)
            with trio.fail_after(20):
                for _ in range(2):  # a streamed request, then another on the same connection
                    await sock.send_all(request(conn, body))
                    response, raw, _ = await read_response(sock, conn)
                    assert response.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")
                    conn.start_next_cycle()
                await sock.aclose()
                for _ in range(3):  # connections of one request each
                    sock = await trio.open_tcp_stream(*addr(url))
                    await sock.send_all(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                    raw = b""
                    while data := await sock.receive_some(1 << 16):
                        raw += data
                    await sock.aclose()
                    assert raw.startswith(b"HTTP/1.1 200")
            with trio.fail_after(10):  # the server's connection tasks end at once
                while _live_http_objects():
                    await trio.sleep(0.05)
        finally:
            gc.enable()


@pytest.mark.direct_http
async def test_what_is_ready_at_once_goes_out_in_one_write(monkeypatch):
    # A one-token stream is ready whole when the engine starts it: its head, the token's
    # event, the usage, [DONE] and the last chunk go out in one write. A longer stream's
    # head goes with its first event, and its last event with the end. Same bytes.
    from server.config import EngineConfig
    from server.connections.connection import ServingConnection
    from tests.conftest import FAST_SIM

    real = ServingConnection.write_nowait
    writes: dict[int, list[bytes]] = {}

    def recording(self, data):
        sent = real(self, data)
        if sent:
            writes.setdefault(id(self), []).append(bytes(data[:sent]))
        return sent

    monkeypatch.setattr(ServingConnection, "write_nowait", recording)
    config = EngineConfig(engine_options={**FAST_SIM, "itl_ms": 10.0})
    async with running_server(config) as url:
        for max_tokens in (1, 20):
            body = {"prompt": "a b", "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            writes.clear()
            sock = await trio.open_tcp_stream(*addr(url))
            await sock.send_all(request(None, body, headers=[("Connection", "close")])
                                .replace(b"HTTP/1.0", b"HTTP/1.1", 1))
            raw = b""
            with trio.fail_after(20):
                while data := await sock.receive_some(1 << 16):
                    raw += data
            await sock.aclose()
            (mine,) = [w for w in writes.values() if w[0].startswith(b"HTTP/1.1 200")]
            assert b"".join(mine) == raw  # every byte the client read, written here
            head, _, first = mine[0].partition(b"\r\n\r\n")
            assert b"transfer-encoding: chunked" in head.lower()
            size, _, rest = first.partition(b"\r\n")  # the head, then a whole first chunk
            assert b'"text":' in rest[:int(size, 16)] and rest[int(size, 16):][:2] == b"\r\n"
            assert b'"finish_reason":"length"' in mine[-1]
            assert mine[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            assert len(mine) == 1 if max_tokens == 1 else len(mine) > 2, mine


@pytest.mark.direct_http
async def test_a_generation_request_runs_no_monitor_task_on_this_servers_connections():
    # The route learns that the client went away from the connection's stream
    # (DirectBody.on_disconnect), not from a task parked in receive: a task and a nursery
    # less per request. (That a client going away still cancels its request, streamed or
    # not: tests/test_http_cancellation.py.)
    spawned: list[str] = []

    class Spawns(trio.abc.Instrument):
        def task_spawned(self, task):
            spawned.append(task.name)

    async with running_server() as url:
        instrument = Spawns()
        trio.lowlevel.add_instrument(instrument)
        try:
            for stream in (False, True):
                body = {"prompt": "a b", "max_tokens": 3, "stream": stream}
                sock = await trio.open_tcp_stream(*addr(url))
                await sock.send_all(request(None, body, headers=[("Connection", "close")]))
                raw = b""
                with trio.fail_after(20):
                    while data := await sock.receive_some(1 << 16):
                        raw += data
                await sock.aclose()
                assert raw.startswith(b"HTTP/1.1 200 ")
        finally:
            trio.lowlevel.remove_instrument(instrument)
    assert any(name.endswith("ConnectionPool.serve") for name in spawned)  # (it saw them)
    assert not [name for name in spawned if "disconnect" in name]


async def test_a_route_told_of_a_disconnect_after_the_stream_ended_hears_of_it_at_once():
    from server.connections.connection import ServingConfig
    from server.connections.http11 import DirectBody, ServingHTTPStream
    from server.connections.private_api import STREAM_ID

    async def nowhere(event):
        pass

    stream = ServingHTTPStream(None, ServingConfig(), None, None, False, None, None, nowhere,
                               STREAM_ID)
    direct = DirectBody(stream, stream, None)  # type: ignore[arg-type]
    calls: list[str] = []
    direct.on_disconnect(lambda: calls.append("early"))
    direct.on_disconnect(None)
    direct.disconnected()
    assert calls == []  # no longer asked for
    stream.closed = True  # (as hypercorn's handling of StreamClosed leaves it)
    direct.on_disconnect(lambda: calls.append("late"))
    assert calls == ["late"]
