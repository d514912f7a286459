"""Issue 18, items 8 and 9: connections and descriptors; slow readers.

* Item 8: ``--max-connections``. At the limit a new connection first ends the oldest idle
  keep-alive connection (so ``/health`` still answers when idle clients hold every slot);
  when every connection is busy it gets a fixed 503 at once. Out of file descriptors
  (a limit set above ``ulimit -n``), one log line when the episode starts and one when it
  ends, not one per accept attempt; the default limit stays below ``ulimit -n``.
* Item 9: ``--send-timeout`` is about progress: a client that keeps reading, however
  slowly, is never cut; one that reads nothing for that long is.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile

import httpx
import pytest
import trio

from server.connections.connection import ServingConfig, ServingConnection
from tests.conftest import running_server, wait_http_ok
from tests.sse_record import SSE, stream_into
from tests.test_hostile import addr, split_response
from tests.test_shutdown import REPO, free_port

#: Connection limits, descriptors and bounded writes: the direct path's (server.connections.accept).
pytestmark = pytest.mark.direct_http


async def open_idle(url: str) -> trio.SocketStream:
    """A kept-alive connection that has been served one request and is now idle."""
    sock = await trio.open_tcp_stream(*addr(url))
    await sock.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    with trio.fail_after(30):  # (a hang guard)
        while b'{"status":"ok"}' not in got:
            got += await sock.receive_some(65536)
    return sock


async def closed_by_server(sock: trio.SocketStream, wait: float = 30.0) -> bool:
    """Whether the server closes ``sock`` within ``wait``: a hang guard by default; a short
    ``wait`` only where the answer expected is no (a busy machine cannot make that fail)."""
    with trio.move_on_after(wait):
        try:
            return await sock.receive_some(65536) == b""
        except trio.BrokenResourceError:
            return True
    return False


async def test_at_the_limit_the_oldest_idle_connection_makes_room():
    async with running_server(max_connections=10) as url:
        pool = url.app.connections
        idle = [await open_idle(url) for _ in range(10)]
        with trio.fail_after(30):  # (a hang guard)
            while pool.statistics().idle < 10:
                await trio.sleep(0.01)
        try:
            for i in range(3):  # each new connection (served) ends the oldest idle one
                idle.append(await open_idle(url))
                assert await closed_by_server(idle[i])
            assert not await closed_by_server(idle[3], wait=0.2)
            stats = pool.statistics()
            assert stats.reaped_idle == 3 and stats.refused == 0 and stats.open == 10
        finally:
            for sock in idle:
                await sock.aclose()


async def test_at_the_limit_with_every_connection_busy_a_new_one_gets_a_503():
    async with running_server(max_connections=4) as url:
        pool = url.app.connections
        async with trio.open_nursery() as nursery:
            busy = []
            for _ in range(4):
                rec = SSE()
                busy.append(rec)
                client = httpx.AsyncClient(base_url=url, timeout=30)
                nursery.start_soon(
                    # 16 s at the sim's 2 ms a token: busy still when the new one comes,
                    # however slow the starts (the cancel below ends them)
                    stream_into, client, {"prompt": "a", "max_tokens": 8000}, rec
                )
            with trio.fail_after(30):
                for rec in busy:
                    await rec.started.wait()
            sock = await trio.open_tcp_stream(*addr(url))
            await sock.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = b""
            with trio.fail_after(30):
                while chunk := await sock.receive_some(65536):
                    raw += chunk
            await sock.aclose()
            status, headers, body = split_response(raw)
            assert status == 503 and headers["retry-after"] == "1"
            assert headers["connection"] == "close"
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            assert pool.statistics().refused == 1
            nursery.cancel_scope.cancel()


async def run_limited(nofile: int, *args: str):
    """The CLI in a shell with ``ulimit -n nofile``; returns (process, url, log file)."""
    port = free_port()
    log = tempfile.TemporaryFile()
    cmd = (
        f"ulimit -n {nofile} && exec {sys.executable} -m server --port {port} "
        "--sim-itl-ms 2 --sim-ttft-ms 5 --keep-alive-timeout 60 " + " ".join(args)
    )
    proc = await trio.lowlevel.open_process(["bash", "-c", cmd], stdout=log, stderr=log, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    await wait_http_ok(url + "/health")
    return proc, url, log


async def open_waiting(url: str, count: int) -> list[trio.SocketStream]:
    """``count`` connections that each sent a request (served or still in the backlog)."""
    socks = []
    for _ in range(count):
        sock = await trio.open_tcp_stream(*addr(url))
        await sock.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        socks.append(sock)
    return socks


def output(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


async def test_out_of_descriptors_is_one_episode_in_the_log_and_ends():
    proc, url, log = await run_limited(64, "--max-connections", "1000")
    idle = []
    try:
        idle = await open_waiting(url, 80)  # more than the process has descriptors for
        with trio.fail_after(30):  # (a hang guard) the episode begins...
            while "cannot accept connections" not in output(log):
                await trio.sleep(0.05)
        await trio.sleep(1.5)  # ...and lasts: about 15 more accept attempts, logged or not
        text = output(log)
        assert text.count("cannot accept connections") == 1, text[-2000:]
        for sock in idle:
            await sock.aclose()
        await wait_http_ok(url + "/health", timeout=30)
        text = output(log)
        assert text.count("cannot accept connections") == 1, text[-2000:]
        assert text.count("accepting connections again") == 1, text[-2000:]
        assert "Traceback" not in text
    finally:
        proc.kill()
        await proc.wait()
        log.close()


async def test_the_default_connection_limit_stays_below_ulimit():
    proc, url, log = await run_limited(256)  # default limit: 256 - 128 = 128
    idle = []
    try:
        idle = await open_waiting(url, 160)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.get("/health")
            assert r.status_code == 200
            metrics = (await http.get("/metrics")).text
        assert "cannot accept" not in output(log)
        name = "trio_llm:connections_reaped_total"
        reaped = [line for line in metrics.splitlines() if line.startswith(name)]
        assert reaped and float(reaped[0].split()[-1]) >= 30, reaped
    finally:
        for sock in idle:
            await sock.aclose()
        proc.kill()
        await proc.wait()
        log.close()


# -- item 9: progress, not one write -----------------------------------------------------------


def tight_pair() -> tuple[trio.SocketStream, socket.socket]:
    """A connected TCP pair with small buffers: the server side (trio) and the client."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server.setblocking(False)
    client.setblocking(False)
    return trio.SocketStream(trio.socket.from_stdlib_socket(server)), client


def connection(stream: trio.SocketStream, send_timeout: float) -> ServingConnection:
    hc = ServingConfig()
    hc.send_timeout = send_timeout
    return ServingConnection(None, hc, None, {}, stream)


# Both run in virtual time (autojump_clock): the sockets are real, but the clocks that matter
# (the reader's pace and the write's deadline) are the test's, so a loaded machine cannot
# stretch one against the other.


async def test_a_slow_but_steady_reader_is_never_cut(autojump_clock):
    stream, client = tight_pair()
    conn = connection(stream, send_timeout=0.5)
    data = b"x" * 200_000
    received = 0

    async def read_slowly():  # ~50 KB/s: the write takes ~4 s, eight times the timeout
        nonlocal received
        while received < len(data):
            await trio.sleep(0.02)
            try:
                received += len(client.recv(1024))
            except BlockingIOError:
                pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_slowly)
        t = trio.current_time()
        scope = trio.CancelScope(shield=True)
        with scope:
            broken = await conn._send_all(data, scope)
        elapsed = trio.current_time() - t
        if broken or scope.cancelled_caught:
            nursery.cancel_scope.cancel()  # cut: the rest will never come
    assert not broken and not scope.cancelled_caught and received == len(data)
    assert elapsed > 2.0  # it did take many timeouts' worth of (virtual) time
    client.close()
    await stream.aclose()


async def test_a_reader_that_stops_is_cut_after_the_timeout(autojump_clock):
    stream, client = tight_pair()
    conn = connection(stream, send_timeout=0.5)
    t = trio.current_time()
    scope = trio.CancelScope(shield=True)
    with scope:
        await conn._send_all(b"x" * 1_000_000, scope)
    assert scope.cancelled_caught
    # cut the timeout after its last progress (filling the buffers, at once)
    assert trio.current_time() - t == pytest.approx(0.5)
    client.close()
    await stream.aclose()
