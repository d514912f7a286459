"""Issue 11: the server embedded in someone else's Trio program.

* Its HTTP customisations are scoped to its own connections: a plain hypercorn app served
  in the same ``trio.run`` keeps hypercorn's own behaviour (each ``await send`` is a
  checkpoint: cancellation arrives in time and other tasks run).
* Its fast paths are in use on its own connections (a test that fails when they silently
  stop being used: body chunks framed without h11, written without ``send_all``).
* ``serve()`` changes nothing process-wide by default (collector, signal handlers) and
  reports its URLs once the engine can serve.
"""

from __future__ import annotations

import functools
import gc
import signal
import socket

import h11
import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from server.config import EngineConfig, ServerConfig
from server.connections import private_api
from server.connections.connection import ServingConnection
from server.http.app import create_app
from server.http.serve import serve
from tests.conftest import FAST_SIM, child_pids, running_server
from tests.test_hostile import addr


def read_response(url: str) -> None:
    with socket.create_connection(addr(url), timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        tail = b""
        while not tail.endswith(b"0\r\n\r\n"):
            data = sock.recv(1 << 16)
            assert data
            tail = (tail + data)[-8:]


async def test_a_neighbour_hypercorn_app_keeps_checkpoints_and_cancellation():
    result = {}

    async def plain_app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        sent = 0
        with trio.move_on_after(0.5) as scope:
            for _ in range(500_000):
                await send({"type": "http.response.body", "body": b"x" * 64, "more_body": True})
                sent += 1
        result["cut"], result["sent"] = scope.cancelled_caught, sent
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with running_server() as url:  # our server, in this same trio.run
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            binds = await nursery.start(
                functools.partial(hypercorn_serve, plain_app, config, shutdown_trigger=stop.wait)
            )
            ticks = 0
            done = False

            async def ticker():
                nonlocal ticks
                while not done:
                    ticks += 1
                    await trio.lowlevel.checkpoint()

            nursery.start_soon(ticker)
            # The client reads from a thread, as fast as the kernel delivers: the app's
            # sends never wait for a full socket buffer.
            await trio.to_thread.run_sync(read_response, binds[0])
            done = True
            stop.set()
        # Our server is up meanwhile, and serves.
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/health")).status_code == 200
    # The deadline cut the loop (a send path without checkpoints runs all 500,000 sends:
    # seconds), and the ticker ran between the app's sends (about once a send; without
    # checkpoints only when a send waits for the socket). Counts, not durations: a busy
    # machine sends fewer in the 0.5 s, in the same proportion.
    assert result["cut"] and result["sent"] < 500_000, result
    assert ticks > result["sent"] // 4, (ticks, result)


@pytest.mark.direct_http
async def test_the_fast_paths_are_used_on_this_servers_connections(monkeypatch):
    assert private_api.direct_path_problem() is None  # the versions and names it was written for
    counts = {"h11 Data": 0, "send_all": 0, "slow path": 0}
    real_send = h11.Connection.send
    real_send_all = trio.SocketStream.send_all
    real_slow = ServingConnection._send_bounded

    def counting_send(self, event):
        if type(event) is h11.Data:
            counts["h11 Data"] += 1
        return real_send(self, event)

    async def counting_send_all(self, data):
        counts["send_all"] += 1
        return await real_send_all(self, data)

    async def counting_slow(self, data, **kwargs):
        counts["slow path"] += 1
        return await real_slow(self, data, **kwargs)

    config = EngineConfig(engine_options=dict(FAST_SIM), stream_interval=0.0)
    async with running_server(config) as url:
        monkeypatch.setattr(h11.Connection, "send", counting_send)
        monkeypatch.setattr(trio.SocketStream, "send_all", counting_send_all)
        monkeypatch.setattr(ServingConnection, "_send_bounded", counting_slow)
        sock = await trio.open_tcp_stream(*addr(url))
        body = b'{"prompt": "a", "max_tokens": 40, "stream": true}'
        await sock.send_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        raw = b""
        with trio.fail_after(30):
            while not raw.endswith(b"0\r\n\r\n"):
                raw += await sock.receive_some(1 << 16)
        await sock.aclose()
        monkeypatch.undo()
    # 40 tokens and [DONE]: an event a step (interval 0), but two steps the router reads in
    # one go on a busy machine share an event, so the count is a bound, not a number.
    assert 3 <= raw.count(b"data: ") <= 41, raw
    assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and b'"finish_reason":"length"' in raw
    # Every event was framed by us (no h11.Data) and handed to the kernel directly; the
    # test's own client used send_all once, for the request.
    assert counts == {"h11 Data": 0, "send_all": 1, "slow path": 0}, counts


async def test_serve_changes_nothing_process_wide_and_starts_when_ready():
    thresholds = gc.get_threshold()
    frozen = gc.get_freeze_count()
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    config = EngineConfig(engine_options={**FAST_SIM, "startup_delay_ms": 500})
    cfg = ServerConfig(engine=config, port=0, shutdown_timeout=0, close_timeout=0.2)
    app = create_app(cfg)
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        with trio.fail_after(30):
            binds = await nursery.start(
                functools.partial(serve, cfg, app=app, shutdown_trigger=stop)
            )
        # started() came once the workers were up: served at once, no 503 first.
        async with httpx.AsyncClient(base_url=binds[0]) as http:
            assert (await http.get("/health")).status_code == 200
            r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert r.status_code == 200
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
        stop.set()


async def test_cancelling_the_callers_scope_stops_serve_and_its_workers():
    before = child_pids()
    cfg = ServerConfig(engine=EngineConfig(workers=2, engine_options=dict(FAST_SIM)), port=0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, cfg))
            assert len(child_pids() - before) == 2
            async with httpx.AsyncClient(base_url=binds[0]) as http:
                async with http.stream(
                    "POST", "/v1/completions",
                    json={"prompt": "a", "max_tokens": 5000, "stream": True},
                ) as r:
                    async for _ in r.aiter_raw():
                        nursery.cancel_scope.cancel()  # mid-stream: the caller leaves
                        break
    with trio.fail_after(30):
        while child_pids() - before:
            await trio.sleep(0.05)
