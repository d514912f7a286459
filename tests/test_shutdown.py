"""Graceful shutdown through the real command line (``python -m server``), and through the
embedding API.

Each CLI test starts the server as a child process on a free port, opens streams, signals it
and watches from the outside: ``/health`` and new requests get 503, in-flight streams keep
streaming until ``--shutdown-timeout``, then every open choice ends with
``finish_reason: "abort"`` and ``data: [DONE]``; the process exits 0 and its worker
processes (found in /proc) are gone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

import server
from server.config import EngineConfig
from tests.conftest import FAST_SIM, child_pids, children_of, pid_exists
from tests.sse_record import SSE, stream_into

REPO = Path(__file__).resolve().parents[1]

# -- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CLIServer:
    def __init__(self, proc: trio.Process, url: str, log) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.workers: set[int] = set()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    async def wait_exit(self, timeout: float) -> int:
        with trio.fail_after(timeout):
            return await self.proc.wait()


@asynccontextmanager
async def cli_server(*args: str, workers: int = 1):
    """``python -m server`` on a free port, up (every worker process started and /health
    200); killed if the test did not make it exit."""
    port = free_port()
    log = tempfile.TemporaryFile()
    cmd = [
        sys.executable, "-m", "server", "--port", str(port), "--sim-itl-ms", "2",
        "--sim-ttft-ms", "5", "--engine-workers", str(workers), "--log-level", "info", *args,
    ]
    proc = await trio.lowlevel.open_process(cmd, stdout=log, stderr=log, cwd=REPO)
    srv = CLIServer(proc, f"http://127.0.0.1:{port}", log)
    try:
        async with httpx.AsyncClient(base_url=srv.url) as http:
            with trio.fail_after(120):
                while True:
                    assert proc.poll() is None, srv.output()
                    try:
                        if (await http.get("/health")).status_code == 200:
                            srv.workers = children_of(proc.pid)
                            if len(srv.workers) == workers:
                                break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)
        await trio.sleep(0.5)  # let the other workers say HELLO too
        yield srv
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in srv.workers:
            if pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


async def assert_gone(srv: CLIServer, timeout: float = 30.0) -> None:
    """The server exited 0, and every worker process it had is gone."""
    code = await srv.wait_exit(timeout)
    assert code == 0, srv.output()
    assert srv.workers
    with trio.fail_after(30):
        while any(pid_exists(pid) for pid in srv.workers):
            await trio.sleep(0.05)
    assert "Traceback" not in srv.output()


# -- through the CLI -------------------------------------------------------------------------


async def test_sigterm_drains_for_the_shutdown_timeout_then_aborts():
    T = 6.0  # (room for the probes below on busy cores, before the drain ends)
    async with cli_server("--shutdown-timeout", str(T), workers=2) as srv:
        long1, long2, short = SSE(), SSE(), SSE()
        plain = {}
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_into, http, {"prompt": "a", "max_tokens": 8000}, long1)
                nursery.start_soon(stream_into, http, {"prompt": "b", "max_tokens": 8000}, long2)

                async def non_streaming():
                    plain["r"] = await http.post(
                        "/v1/completions", json={"prompt": "c", "max_tokens": 8000}
                    )

                nursery.start_soon(non_streaming)
                with trio.fail_after(30):
                    await long1.started.wait()
                    await long2.started.wait()
                # finishes by itself well within the shutdown timeout (0.1 s at 2 ms a token:
                # twenty times that on busy cores still does)
                nursery.start_soon(stream_into, http, {"prompt": "d", "max_tokens": 50}, short)
                with trio.fail_after(30):
                    await short.started.wait()
                srv.proc.send_signal(signal.SIGTERM)
                signalled = trio.current_time()
                tokens_at_signal = long1.tokens()
                async with httpx.AsyncClient(base_url=srv.url, timeout=30) as probe:
                    with trio.fail_after(30):
                        while (await probe.get("/health")).status_code == 200:
                            await trio.sleep(0.02)
                    health = await probe.get("/health")
                    assert health.status_code == 503
                    r = await probe.post("/v1/completions", json={"prompt": "new", "max_tokens": 2})
                    assert r.status_code == 503, r.text
                    assert r.json()["error"]["code"] == "shutting_down"
                    assert r.headers["retry-after"]
                    r = await probe.post(
                        "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
                    )
                    assert r.status_code == 503
                with trio.fail_after(T + 30):  # (a hang guard)
                    await long1.finished.wait()
                    await long2.finished.wait()
        # the short one finished normally during the drain (the drain's end would be "abort")
        assert short.done and not short.has_error()
        assert short.finish_reasons() == ["length"] and short.tokens() == 50
        # the long ones streamed on after the signal until the timeout, then ended with
        # abort and [DONE]: tokens came well into the drain (not only ones in flight at the
        # signal), whenever the busy test got to look
        assert long1.tokens() > tokens_at_signal
        for rec in (long1, long2):
            late = [json.loads(e[6:]) for e, t in zip(rec.events, rec.times)
                    if t > signalled + 1.0 and e.startswith(b"data: {")]
            assert sum(len(ch["text"].split()) for c in late for ch in c.get("choices", ())) > 0
            assert rec.status == 200 and rec.done and not rec.has_error()
            assert rec.finish_reasons() == ["abort"]
            assert rec.ended - signalled >= T - 0.5  # (causal: the drain starts after the
            # signal; how soon after T they end is not asserted on a busy machine)
        # a non-streaming request aborted by the shutdown is a 503
        r = plain["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        await assert_gone(srv)
        assert "draining: 4 request(s) in flight" in srv.output()  # long1, long2, plain, short


async def test_shutdown_timeout_zero_aborts_at_once_on_sigint():
    async with cli_server("--shutdown-timeout", "0") as srv:
        rec = SSE()
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_into, http, {"prompt": "a", "max_tokens": 8000}, rec)
                with trio.fail_after(30):
                    await rec.started.wait()
                srv.proc.send_signal(signal.SIGINT)
                with trio.fail_after(30):  # (a hang guard: "abort" below, not "length")
                    await rec.finished.wait()
        # cut by the signal, not run to its end (then "length")
        assert rec.done and rec.finish_reasons() == ["abort"] and not rec.has_error()
        await assert_gone(srv)


async def test_second_signal_stops_at_once():
    async with cli_server("--shutdown-timeout", "60") as srv:
        rec = SSE()
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_into, http, {"prompt": "a", "max_tokens": 8000}, rec)
                with trio.fail_after(30):
                    await rec.started.wait()
                srv.proc.send_signal(signal.SIGTERM)
                # the first signal read (two signals not yet read would be one): draining
                with trio.fail_after(30):  # (a hang guard)
                    while "draining: 1 request(s) in flight" not in srv.output():
                        await trio.sleep(0.02)
                tokens = rec.tokens()
                with trio.fail_after(30):  # (a hang guard) a token comes while draining
                    while rec.tokens() == tokens and not rec.finished.is_set():
                        await trio.sleep(0.02)
                assert not rec.finished.is_set() and rec.tokens() > tokens  # draining
                srv.proc.send_signal(signal.SIGTERM)
                with trio.fail_after(30):  # (a hang guard: "abort" below, not "length")
                    await rec.finished.wait()
        assert rec.done and rec.finish_reasons() == ["abort"] and not rec.has_error()
        await assert_gone(srv)
        assert "second signal" in srv.output()


async def test_a_client_that_never_reads_does_not_hold_up_the_shutdown():
    async with cli_server("--shutdown-timeout", "0.5") as srv:
        host, port = srv.url.rsplit("/", 1)[1].split(":")
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills up fast
        await sock.connect((host, int(port)))
        stream = trio.SocketStream(sock)
        body = json.dumps({"prompt": "p", "max_tokens": 8000, "stream": True}).encode()
        await stream.send_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await trio.sleep(1.5)  # the server's writes are blocked on the full socket by now
        srv.proc.send_signal(signal.SIGTERM)
        try:
            await assert_gone(srv, timeout=15)
        finally:
            await stream.aclose()


# -- through the embedding API ---------------------------------------------------------------


async def test_embedding_drain_with_the_engine_api_then_leaving_the_block():
    """The HTTP drain's steps, by hand: stop accepting, wait (bounded) for in-flight
    requests, abort the rest; then leaving ``open_engine`` stops the worker processes."""
    before = child_pids()
    ends = {}

    short_done = trio.Event()

    async def consume(name, stream):
        async with stream:
            async for out in stream:
                if out.finish_reason is not None:
                    ends[name] = (out.finish_reason, out.completion_tokens, stream.abort_cause)
        if name == "short":
            short_done.set()

    config = EngineConfig(engine_options=dict(FAST_SIM), workers=2)
    async with server.open_engine(config) as engine:
        pids = [w.pid for w in engine.statistics().workers]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume, "short", engine.generate("a", server.SamplingParams(max_tokens=300)))
            nursery.start_soon(consume, "long", engine.generate("b", server.SamplingParams(max_tokens=8000)))
            engine.stop_accepting()
            with pytest.raises(server.ServiceUnavailable):
                engine.generate("c")
            # the drain's bounded wait for in-flight requests, here ended by its condition
            # (the short one is done) rather than a time; the long one is still running
            with trio.fail_after(60):
                await short_done.wait()
            assert "long" not in ends
            assert engine.abort_all() == 1
            with trio.fail_after(config.drain_timeout + 1):
                await engine.wait_idle()
    assert ends["short"] == ("length", 300, None)
    assert ends["long"][0] == "abort" and ends["long"][2] == "shutdown"
    assert 0 < ends["long"][1] < 8000
    assert all(pid is not None for pid in pids)
    assert not any(pid_exists(pid) for pid in pids)
    assert child_pids() - before == set()


async def test_leaving_open_engine_aborts_open_streams_like_the_http_shutdown():
    before = child_pids()
    ends = []

    async def consume(stream):
        async with stream:
            async for out in stream:
                if out.finish_reason is not None:
                    ends.append((out.finish_reason, out.error_kind, stream.abort_cause))

    config = EngineConfig(engine_options=dict(FAST_SIM))
    async with trio.open_nursery() as outer:
        async with server.open_engine(config) as engine:
            pid = engine.statistics().workers[0].pid
            for prompt in ("a", "b"):
                outer.start_soon(consume, engine.generate(prompt, server.SamplingParams(max_tokens=8000)))
            await trio.sleep(0.2)
    # the streams were ended by the engine's exit (abort, cause shutdown), not by their 8000
    # tokens: how soon is not asserted on a busy machine
    assert not pid_exists(pid) and child_pids() - before == set()
    assert ends == [("abort", None, "shutdown")] * 2


def test_the_cli_exits_1_when_its_engine_cannot_start():
    # A worker that cannot load its engine ends the server with one line and status 1 (not
    # a server that answers 503 forever), here and for systemd or Kubernetes to see.
    import subprocess
    import sys

    r = subprocess.run(
        # (in the options' ranges: the engine is what refuses it)
        [sys.executable, "-m", "server", "--port", "0", "--max-model-len", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "cannot start engine: the sim engine needs max_batch >= 1" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_cli_says_in_one_line_that_its_port_is_taken():
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"trio-llm-server: cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "Traceback" not in r.stderr
