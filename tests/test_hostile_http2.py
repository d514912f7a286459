"""Issue 18, items 1 and 11: no connection can end the server.

* The exact two HTTP/2 frames that ended the server process through hypercorn's HTTP/2 code
  (a ``KeyError`` for a body still arriving after an early answer). The server speaks
  HTTP/1.1 only now: the HTTP/2 preface is answered 505 and the connection closed.
* ``Upgrade: h2c`` is ignored: the request is served as HTTP/1.1.
* A deliberately failing connection handler (a test-only fault injected into the protocol
  class) ends only its own connection: a stream on another connection goes on to
  ``[DONE]``, the error is logged once with the last request id of the connection and
  counted in ``/metrics``.
* An HTTP/2 client with a zero window, 100 streams and a closed socket holds nothing.
"""

from __future__ import annotations

import json
import logging
import socket

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest
import trio

from server.connections.http11 import ServingH11Protocol
from tests.conftest import running_server
from tests.sse_record import SSE, stream_into
from tests.test_hostile import addr, raw_exchange, split_response

#: HTTP/1.1 only and the per-connection boundary: the direct path's.
pytestmark = pytest.mark.direct_http


def h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return conn


def post_headers(path: str, length: int) -> list:
    return [
        (":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "x"),
        ("content-length", str(length)),
    ]


async def receive_all(sock: trio.SocketStream, wait: float = 30.0) -> bytes:
    """What comes until EOF (the callers' connections are closed by the server) or ``wait``
    s (a hang guard)."""
    out = b""
    with trio.move_on_after(wait):
        try:
            while chunk := await sock.receive_some(65536):
                out += chunk
        except trio.BrokenResourceError:
            pass
    return out


async def test_the_two_frames_that_ended_the_server_get_a_505_and_nothing_else():
    async with running_server() as url:
        for path in ("/nope", "/v1/completions", "/v1/models"):
            sock = await trio.open_tcp_stream(*addr(url))
            c = h2_client()
            c.send_headers(1, post_headers(path, 2000))
            c.send_data(1, b"a" * 1000)
            await sock.send_all(c.data_to_send())
            await trio.sleep(0.3)
            c.send_data(1, b"a" * 1000)
            try:
                await sock.send_all(c.data_to_send())
            except trio.BrokenResourceError:
                pass  # the server had closed the connection: that is fine too
            raw = await receive_all(sock)
            await sock.aclose()
            status, headers, body = split_response(raw)
            assert status == 505, raw[:300]
            assert headers["connection"] == "close"
            assert json.loads(body)["error"]["code"] == "http_version_not_supported"
        # The server is up and serving; nothing went through the boundary.
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 200
            assert url.app.connections.statistics().errors == 0


async def test_an_h2c_upgrade_is_served_as_http_1_1():
    async with running_server() as url:
        raw = await raw_exchange(
            url,
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
            wait=1.0,
        )
        assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
        assert b"101" not in raw.split(b"\r\n", 1)[0]
        assert json.loads(split_response(raw)[2]) == {"status": "ok"}


async def test_a_failing_connection_ends_alone_and_is_logged_and_counted(monkeypatch, caplog):
    # A test-only fault: the protocol raises (as hypercorn's HTTP/2 code did) for one path.
    real = ServingH11Protocol._check_protocol

    async def faulty(self, event):
        if event.target == b"/boom":
            raise KeyError("a bug in the HTTP layer")
        await real(self, event)

    monkeypatch.setattr(ServingH11Protocol, "_check_protocol", faulty)
    caplog.set_level(logging.ERROR, logger="server")
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                bystander = SSE()
                nursery.start_soon(
                    stream_into, http, {"prompt": "a", "max_tokens": 400}, bystander
                )
                with trio.fail_after(30):
                    await bystander.started.wait()
                # One request on a connection, then the fault on the same connection.
                sock = await trio.open_tcp_stream(*addr(url))
                await sock.send_all(
                    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: before-the-fault\r\n\r\n"
                )
                with trio.fail_after(30):
                    got = b""
                    while b'{"status":"ok"}' not in got:
                        got += await sock.receive_some(65536)
                await sock.send_all(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
                rest = b""
                with trio.fail_after(30):  # (a hang guard) the server ends the connection...
                    try:
                        while chunk := await sock.receive_some(65536):
                            rest += chunk
                    except trio.BrokenResourceError:
                        pass
                await sock.aclose()
                assert rest == b""  # ... with no answer
                # Other connections: the bystander's stream goes on, new requests served.
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200
            assert bystander.status == 200 and bystander.done and not bystander.has_error()
            assert bystander.finish_reasons() == ["length"]
            metrics = (await http.get("/metrics")).text
        assert url.app.connections.statistics().errors == 1
        assert 'trio_llm:connection_errors_total{model_name="sim"} 1.0' in metrics
    lines = [r for r in caplog.records if "ended by an error" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "before-the-fault" in lines[0].getMessage()
    assert lines[0].exc_info is not None  # the traceback is in the log (never in a response)


async def test_a_zero_window_http2_client_that_goes_away_holds_nothing():
    async with running_server() as url:
        pool = url.app.connections
        sock = socket.create_connection(addr(url))
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        c.initiate_connection()
        c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        for i in range(100):
            c.send_headers(2 * i + 1, [
                (":method", "GET"), (":path", "/v1/models"), (":scheme", "http"),
                (":authority", "x"),
            ], end_stream=True)
        sock.sendall(c.data_to_send())
        sock.close()
        with trio.fail_after(30):
            while pool.statistics().open:
                await trio.sleep(0.02)
        assert pool.statistics().errors == 0
