"""--health-port: /health and /ready on a listener of their own (server.connections.probes)."""

from __future__ import annotations

import json
import logging
import re

import httpx
import trio

from tests.conftest import running_server


def probe_port(caplog) -> int:
    found = re.findall(r"probes \(/health, /ready\) on http://127\.0\.0\.1:(\d+)", caplog.text)
    assert found, caplog.text
    return int(found[-1])


async def raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection; everything the server answers until it closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        out = b""
        with trio.fail_after(30):
            try:
                while chunk := await stream.receive_some(65536):
                    out += chunk
            except trio.BrokenResourceError:  # closed with our bytes unread: a reset
                pass
    return out


async def test_probes_answer_as_the_api_port_does(caplog):
    caplog.set_level(logging.INFO, logger="server")
    async with running_server(health_port=0) as url:
        port = probe_port(caplog)
        assert str(port) not in url
        async with httpx.AsyncClient(timeout=30) as client:
            for path in ("/health", "/ready"):
                api = await client.get(url + path)
                probe = await client.get(f"http://127.0.0.1:{port}{path}")
                assert probe.status_code == api.status_code == 200
                assert probe.json() == api.json()
                assert probe.headers["content-type"] == "application/json"
            # keep-alive: several requests on the connection httpx keeps
            head = await client.head(f"http://127.0.0.1:{port}/health")
            assert head.status_code == 200 and head.content == b""
            other = await client.get(f"http://127.0.0.1:{port}/v1/models")
            assert other.status_code == 404 and "probe port" in other.json()["error"]["message"]
            post = await client.post(f"http://127.0.0.1:{port}/health", content=b"{}")
            assert post.status_code == 405


async def test_a_bad_probe_connection_ends_only_itself(caplog):
    caplog.set_level(logging.INFO, logger="server")
    async with running_server(health_port=0) as url:
        port = probe_port(caplog)
        assert (await raw(port, b"\x16\x03\x01garbage\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        assert (await raw(port, b"GET /" + b"a" * 70000)).startswith(b"HTTP/1.1 431 ")
        answer = await raw(port, b"GET /health?x=1 HTTP/1.1\r\nHost: x\r\n"
                                 b"Connection: close\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.get(url + "/health")).status_code == 200
