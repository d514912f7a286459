"""Malformed frames on both ends of the worker protocol, against real processes (issue 23,
items 4 and 5).

* A listening worker given a malformed frame by one frontend drops that connection only
  (one log line naming the peer), and goes on serving the others; a pipe worker given one
  exits (its frontend restarts it).
* A frontend given a malformed frame by a worker ends that worker's session only: the
  worker is treated as dead (its streams end with an error event and ``[DONE]``) and the
  frontend reconnects (or restarts it); it never ends up serving 503 forever.
* An error that ends the engine anyway (a bug) ends the server: ``serve()`` and
  ``open_engine`` raise it, and the command exits non-zero for its supervisor to restart.

The property tests generate frames (``tests/frames.py``), feed them to a real process, and
compare what it did with the verdict of the sans-IO check (``wire.check_request`` /
``check_reply``). Real processes: real time, with generous ``trio.fail_after`` bounds.
"""

from __future__ import annotations

import collections
import os
import re
import socket
import subprocess
import sys

import httpx
import msgpack
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings

from server import EngineConfig, SamplingParams, open_engine
from server.config import ServerConfig
from server.http.serve import serve
from server.manager.worker import WorkerClient
from server.worker_protocol import handshake, wire
from tests import frames
from tests.conftest import FAST_SIM, assert_engine_idle, child_pids, pid_exists, wait_http_ok
from tests.remote import (
    ROOT, SECRET, FrameProxy, free_port, listening_worker, remote_config, stop, wait_until,
    worker_env,
)
from tests.sse_record import SSE, stream_into

#: The frames of the issue: each ended a listening worker (IndexError, TypeError).
ISSUE_FRAMES = [[3], [7], [1], [2], [1, [1], "hi", {}], [2, [1]]]


class HandFrontend:
    """A frontend by hand, on a blocking socket (for a test's thread): the handshake, then
    whatever frames the test sends."""

    def __init__(self, address: handshake.WorkerAddress, secret: str | None) -> None:
        assert address.host is not None and address.port is not None
        self.sock = socket.create_connection((address.host, address.port), timeout=30)
        self.decoder = wire.FrameDecoder()
        self.pending: list[list] = []
        challenge = self.next()
        assert challenge is not None and challenge[0] == wire.CHALLENGE
        cnonce = os.urandom(32)
        proof = None if secret is None else handshake.client_proof(
            secret.encode(), challenge[2], cnonce)
        self.sock.sendall(wire.encode([wire.AUTH, cnonce, proof]))
        hello = self.next()
        assert hello is not None and hello[0] == wire.HELLO, hello

    def next(self) -> list | None:
        """The next message, or None when the worker closed (or reset) the connection."""
        while not self.pending:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:  # closed with our bytes unread
                return None
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def kept(self, message: list) -> bool:
        """Send ``message``, then a PING: whether the PONG came (else the worker dropped
        the connection)."""
        seq = 2**40 + 1
        self.sock.sendall(wire.encode(message) + wire.encode([wire.PING, seq]))
        while (reply := self.next()) is not None:
            if reply[0] == wire.PONG and reply[1] == seq:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


# -- a listening worker, given malformed frames ----------------------------------------------


async def test_a_malformed_frame_ends_only_its_connection_and_the_worker_serves_on(tmp_path):
    async with listening_worker(tmp_path) as w:
        async with open_engine(remote_config(w)) as engine:
            # another frontend streams meanwhile
            async with engine.generate("x", SamplingParams(max_tokens=8000)) as stream:
                await stream.__anext__()

                def each() -> None:
                    for frame in ISSUE_FRAMES:
                        frontend = HandFrontend(w.address, SECRET)
                        try:
                            assert not frontend.kept(frame), frame
                        finally:
                            frontend.close()

                await trio.to_thread.run_sync(each)
                assert w.proc.returncode is None
                assert await engine.ping_all() == [(1, 0)]  # ours runs on
                got = 0
                async for out in stream:
                    got += out.num_tokens
                    if got >= 10:
                        break
            await assert_engine_idle(engine)
    lines = [line for line in w.text().splitlines() if "protocol violation" in line]
    assert len(lines) == len(ISSUE_FRAMES), w.text()
    for line, frame in zip(lines, ISSUE_FRAMES):
        kind = wire.NAMES[frame[0]]
        assert re.search(r"frontend 127\.0\.0\.1:\d+ disconnected \(protocol violation: "
                         rf"malformed {kind}: .*\); aborted 0 request\(s\)$", line), line
    assert "Traceback" not in w.text()


async def test_property_generated_frames_end_at_most_their_connection(tmp_path):
    async with listening_worker(tmp_path, secret=None) as w:
        seen: collections.Counter = collections.Counter()

        def fuzz() -> None:
            @settings(max_examples=frames.EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(frames.requests)
            # (one of each outcome always: the generated ones were all kept in some runs)
            @example([wire.PING, 1])
            @example([wire.PING])
            def one(message):
                frontend = HandFrontend(w.address, None)
                try:
                    kept = frontend.kept(message)
                finally:
                    frontend.close()
                good = frames.verdict(wire.check_request, message)
                assert kept == (good and message[0] != wire.SHUTDOWN), message
                assert w.proc.returncode is None
                seen["kept" if kept else "violation" if not good else "shutdown"] += 1

            one()

        await trio.to_thread.run_sync(fuzz)
        print("outcomes:", dict(seen))
        assert seen["kept"] and seen["violation"]
        # the worker still serves, and holds nothing of the connections that ended
        async with open_engine(remote_config(w, secret=None)) as engine:
            async with engine.generate("x", SamplingParams(max_tokens=3)) as stream:
                assert sum([o.num_tokens async for o in stream]) == 3
            await assert_engine_idle(engine)
    lines = [line for line in w.text().splitlines() if "protocol violation" in line]
    assert len(lines) == seen["violation"]
    assert all(len(line) < 400 for line in lines)
    assert "Traceback" not in w.text()


async def test_packed_ids_reach_a_listening_worker_and_a_malformed_payload_ends_only_its_connection(
        tmp_path):
    """A worker reads packed ids (it says so in its HELLO, and the frontend then sends a
    long token-id prompt packed); a packed payload that is not whole uint32s is a protocol
    violation that drops that connection only."""
    bad = msgpack.ExtType(wire.PACKED_IDS, b"\x01\x02\x03\x04\x05")
    async with listening_worker(tmp_path, secret=None) as w:
        async with open_engine(remote_config(w, secret=None)) as engine:
            assert engine.workers[0].reads_packed
            prompt = [7] * (wire.PACK_MIN + 1)
            async with engine.generate(prompt, SamplingParams(max_tokens=3)) as stream:
                outs = [o async for o in stream]
            assert outs[0].prompt_tokens == len(prompt)
            assert sum(o.num_tokens for o in outs) == 3

            def each() -> None:
                frontend = HandFrontend(w.address, None)
                try:
                    assert not frontend.kept([wire.SUBMIT, 1, bad, {}])
                finally:
                    frontend.close()

            await trio.to_thread.run_sync(each)
            assert w.proc.returncode is None
            assert await engine.ping_all() == [(0, 0)]  # ours serves on
            await assert_engine_idle(engine)
    assert re.search(r"disconnected \(protocol violation: undecodable frame: packed ids of 5 "
                     r"bytes \(not a multiple of 4\)\); aborted 0 request\(s\)$", w.text(), re.M), w.text()
    assert "Traceback" not in w.text()


def test_a_pipe_worker_given_a_malformed_frame_exits_with_a_line():
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.workers", '{"engine": "sim"}'], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        decoder = wire.FrameDecoder()
        while not (hello := decoder.feed(os.read(proc.stdout.fileno(), 1 << 16))):
            pass
        assert hello[0][0] == wire.HELLO
        _, err = proc.communicate(wire.encode([wire.SUBMIT, [1], "hi", {}]), timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert b"protocol violation by the frontend, exiting: malformed SUBMIT" in err
    assert b"Traceback" not in err


# -- a frontend, given malformed frames by its worker ----------------------------------------


async def test_a_malformed_pong_ends_that_session_and_the_server_reconnects(tmp_path):
    async with listening_worker(tmp_path) as w, trio.open_nursery() as nursery:
        proxy = await nursery.start(FrameProxy(w.address).run)
        port = free_port()
        log = tmp_path / "frontend.log"
        with log.open("wb") as err:  # noqa: ASYNC230 (a local file, before the process)
            frontend = await trio.lowlevel.open_process(
                [sys.executable, "-m", "server", "--port", str(port),
                 "--worker-address", str(proxy.address)],
                env=worker_env(SECRET), stdin=subprocess.DEVNULL, stderr=err, cwd=ROOT,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_http_ok(url + "/ready", timeout=30)
            recs = [SSE(), SSE()]
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                async with trio.open_nursery() as streams:
                    for rec in recs:
                        streams.start_soon(stream_into, http,
                                           {"prompt": "p", "max_tokens": 8000}, rec)
                    with trio.fail_after(30):
                        for rec in recs:
                            await rec.started.wait()
                    relay = proxy.current
                    assert relay is not None
                    await proxy.inject(relay, wire.encode([wire.PONG]))
                    with trio.fail_after(30):
                        for rec in recs:
                            await rec.finished.wait()
                for rec in recs:
                    assert rec.status == 200 and rec.done  # an error event, then [DONE]
                    error = rec.error()
                    assert error["code"] == "worker_died"
                    assert "protocol violation: malformed PONG: [4]" in error["message"]
                # the frontend reconnects by itself, and serves
                await wait_http_ok(url + "/ready", timeout=20)
                assert (await http.get("/health")).status_code == 200
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200, r.text
            assert frontend.returncode is None
            assert proxy.connections == 2
        finally:
            with trio.CancelScope(shield=True):
                await stop(frontend)  # SIGTERM (then SIGKILL)
            nursery.cancel_scope.cancel()
        assert frontend.returncode == 0, log.read_text()
        text = log.read_text()
        assert re.search(r"worker 0: .*protocol violation: malformed PONG: \[4\]; reconnecting",
                         text), text
        assert "Traceback" not in text
        # the worker aborted what the dropped connection held (closed, or reset: the kernel
        # resets a socket closed with unread bytes)
        assert re.search(r"disconnected \((closed by the frontend|connection broke: .*reset.*)"
                         r"\); aborted 2 request\(s\)", w.text()), w.text()


async def test_property_generated_frames_from_a_worker_end_at_most_its_session(tmp_path):
    async with listening_worker(tmp_path, secret=None) as w, trio.open_nursery() as nursery:
        proxy = await nursery.start(FrameProxy(w.address).run)
        config = remote_config(proxy, secret=None, restart_backoff=0.02,
                               restart_backoff_max=0.02)
        seen: collections.Counter = collections.Counter()
        async with open_engine(config) as engine:
            worker = engine.workers[0]

            async def one(message: list) -> None:
                await wait_until(lambda: worker.alive and proxy.current is not None, 20)
                relay, restarts = proxy.current, worker.restarts
                assert relay is not None
                good = frames.verdict(wire.check_reply, message)
                await proxy.inject(relay, wire.encode(message))
                if good and message[0] == wire.LEAVING:  # (said to stop: no longer routed
                    # to, its session goes on; the relay is closed, as the worker would)
                    with trio.fail_after(20):
                        await engine.ping_all()
                    assert worker.leaving and not worker.routable
                    await relay.stream.aclose()
                    await wait_until(lambda: worker.routable
                                     and proxy.current not in (None, relay), 20)
                    assert worker.restarts == restarts  # (a planned leave)
                elif good:  # a round trip after it, on the same session: it went on
                    with trio.fail_after(20):
                        await engine.ping_all()
                    assert worker.alive and worker.restarts == restarts
                    assert proxy.current is relay
                else:  # the session ended; the frontend reconnected (a reconnection that
                    # failed on a busy machine and was retried counts twice: at least one)
                    await wait_until(lambda: worker.restarts > restarts and worker.alive
                                     and proxy.current not in (None, relay), 20)
                seen[good] += 1
                with trio.fail_after(20):
                    async with engine.generate("x", SamplingParams(max_tokens=3)) as stream:
                        assert sum([o.num_tokens async for o in stream]) == 3

            def fuzz() -> None:
                @settings(max_examples=frames.EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(frames.replies)
                # (one of each outcome always: generated ones were all well formed in a CI
                # run, 40 of 40; the share varies from run to run, 3 to 25 malformed seen)
                @example([wire.RESULT, 1, {"tokens": [1, 2], "max_model_len": 9}, None])
                @example([wire.RESULT])
                @example([wire.LEAVING, 1.5])  # (well formed, and the worker is left)
                def each(message):
                    trio.from_thread.run(one, message)

                each()

            await trio.to_thread.run_sync(fuzz)
            await assert_engine_idle(engine)
        nursery.cancel_scope.cancel()
    print("outcomes (well formed?):", dict(seen))
    assert seen[True] and seen[False]


# -- an error that ends the engine ends the server -------------------------------------------

#: The server's command, with a bug put in the router (what a bug would do; no frame can).
_BUGGY_SERVER = """
import sys
from server.manager.worker import WorkerClient

def _route(self, messages):
    raise RuntimeError("a bug in the router")

WorkerClient._route = _route
from server.cli import main
main(sys.argv[1:])
"""


def _broken_route(self, messages):
    raise RuntimeError("a bug in the router")


def break_route_in_this_run(monkeypatch) -> None:
    """WorkerClient._route raising, for the engines of the calling test's Trio run only. A
    session's shared server (tests/conftest.py, ThreadServer) runs in this process too, in a
    Trio run of its own: its heartbeat's answers must not meet the bug (they ended it)."""
    ours = trio.lowlevel.current_trio_token()
    real = WorkerClient._route

    def route(self, messages):
        if trio.lowlevel.current_trio_token() is ours:
            _broken_route(self, messages)
        return real(self, messages)

    monkeypatch.setattr(WorkerClient, "_route", route)


async def test_an_error_that_ends_the_engine_ends_the_server_process_non_zero(tmp_path):
    log = tmp_path / "frontend.log"
    before = child_pids()
    with log.open("wb") as err:  # noqa: ASYNC230 (a local file, before the process)
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-c", _BUGGY_SERVER, "--port", "0",
                 "--sim-itl-ms", "2", "--sim-ttft-ms", "5"],
                stdin=subprocess.DEVNULL, stderr=err, cwd=ROOT, check=False,
            )
    text = log.read_text()
    assert done.returncode == 1, text
    assert "the engine failed: RuntimeError('a bug in the router'); stopping the server" in text
    # its worker was stopped with it
    pids = [int(p) for p in re.findall(r"worker 0 \(pid (\d+)\) is up", text)]
    assert pids and not any(pid_exists(p) for p in pids)
    assert child_pids() - before == set()


async def test_an_error_that_ends_the_engine_comes_out_of_serve_and_open_engine(monkeypatch):
    break_route_in_this_run(monkeypatch)
    config = EngineConfig(engine_options=dict(FAST_SIM), shutdown_grace=0.3)
    with trio.fail_after(60):
        with pytest.raises(RuntimeError, match="a bug in the router"):
            await serve(ServerConfig(engine=config, host="127.0.0.1", port=0,
                                     shutdown_timeout=0, close_timeout=0.2))
        with pytest.raises(ExceptionGroup) as info:
            async with open_engine(config) as engine:
                await engine.ping_all()
    assert info.group_contains(RuntimeError, match="a bug in the router", depth=None)
