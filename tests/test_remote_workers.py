"""Remote workers (``python -m server.workers --listen``) as real processes on loopback and a
unix socket: a frontend (the real HTTP server, or an Engine) with two of them, the shared
secret, TLS, a worker killed mid-stream and its successor on the same address, and a
frontend process killed while its requests run (the connection is the unit of abort).

Real processes, so real time and ``trio.fail_after``. Network namespaces: test_remote_netns.py.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
from contextlib import AsyncExitStack

import httpx
import openai
import pytest
import trio

from server import Engine, EngineConfig, SamplingParams, open_engine
from server.cli import build_parser, config_from_args
from server.manager.transport import open_connected
from server.manager.worker import WorkerStartupError
from server.worker_protocol import wire
from server.worker_protocol.handshake import SECRET_ENV
from tests.conftest import child_pids, running_server, wait_http_ok
from tests.remote import (
    SECRET, free_port, listening_worker, make_certificate, remote_config, wait_until, worker_env,
)
from tests.sse_record import SSE, stream_into


# -- a frontend with two remote workers ------------------------------------------------------


async def test_two_remote_workers_share_the_load_and_stream_to_the_openai_sdk(tmp_path):
    async with (
        listening_worker(tmp_path, name="a") as a,
        listening_worker(tmp_path, name="b") as b,
    ):
        async with running_server(remote_config(a, b)) as url:
            engine = url.engine
            await wait_until(lambda: engine.statistics().workers_alive == 2, 10)
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            texts: dict[int, str] = {}
            finishes: dict[int, str | None] = {}
            started = trio.Semaphore(0)

            async def one(i: int) -> None:
                # long enough (3 s at 2 ms a token) that none ends before the 4th started
                stream = await client.completions.create(
                    model="sim", prompt=f"p{i}", max_tokens=1500, stream=True)
                parts = []
                async for chunk in stream:
                    if not parts:
                        started.release()
                    parts.append(chunk.choices[0].text)
                    finishes[i] = chunk.choices[0].finish_reason
                texts[i] = "".join(parts)

            with trio.fail_after(60):  # (a hang guard)
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
                    for _ in range(4):
                        await started.acquire()
                    # each worker runs two of them, by its own count (a PING round trip)
                    assert await engine.ping_all() == [(2, 0), (2, 0)]
            assert sorted(finishes.values()) == ["length"] * 4
            assert all(len(t.split()) == 1500 for t in texts.values())
    assert "frontend 127.0.0.1:" in a.text() and "frontend 127.0.0.1:" in b.text()


# -- the shared secret -----------------------------------------------------------------------


async def test_a_wrong_or_missing_secret_is_refused_with_a_line_on_both_sides(tmp_path):
    async with listening_worker(tmp_path) as w:
        with trio.fail_after(30):
            with pytest.raises(WorkerStartupError, match="authentication failed: wrong secret"):
                async with open_engine(remote_config(w, secret="another secret, 16+ chars")):
                    pass
            with pytest.raises(WorkerStartupError, match="requires a shared secret"):
                async with open_engine(remote_config(w, secret=None)):
                    pass
            # the worker still serves those who know the secret
            async with open_engine(remote_config(w)) as engine:
                async with engine.generate("x", SamplingParams(max_tokens=3)) as s:
                    outs = [o async for o in s]
                # (a busy worker may send several tokens in one event: the total, not the events)
                assert sum(o.num_tokens for o in outs) == 3
                assert len("".join(o.text for o in outs).split()) == 3
                assert outs[-1].finish_reason == "length"
    assert "refused: authentication failed: wrong secret" in w.text()


async def test_a_frontend_with_a_secret_refuses_a_worker_without_one(tmp_path):
    async with listening_worker(tmp_path, secret=None) as w:
        with trio.fail_after(30), pytest.raises(WorkerStartupError, match="did not prove"):
            async with open_engine(remote_config(w)):
                pass


async def test_the_server_command_exits_with_one_line_on_a_wrong_secret(tmp_path):
    async with listening_worker(tmp_path) as w:
        env = worker_env("a wrong secret of some length")
        with trio.fail_after(20):
            done = await trio.run_process(
                [sys.executable, "-m", "server", "--port", "0",
                 "--worker-address", str(w.address)],
                env=env, capture_stderr=True, check=False,
            )
    assert done.returncode == 1
    lines = [line for line in done.stderr.decode().splitlines() if "ERROR" in line]
    assert len(lines) == 1 and f"engine worker 0 at {w.address}: " in lines[0]
    assert lines[0].endswith("the worker refused us: authentication failed: wrong secret")
    assert "Traceback" not in done.stderr.decode()


def test_a_worker_refuses_to_listen_beyond_loopback_without_a_secret():
    done = subprocess.run(
        [sys.executable, "-m", "server.workers", "--listen", "0.0.0.0:0"],
        env=worker_env(None), capture_output=True, timeout=20,
    )
    assert done.returncode == 1
    assert b"reachable from other machines: set a shared secret" in done.stderr


def test_remote_workers_refuse_the_options_of_spawned_workers(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    parse = build_parser().parse_args

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as info:
            config_from_args(parse(["--worker-address", "10.0.0.2:7100", *argv]))
        return str(info.value)

    message = refused("--engine-workers", "2", "--sim-itl-ms", "3", "--max-restarts", "9")
    assert message.startswith("trio-llm-server: --engine-workers, --sim-itl-ms, --max-restarts: "
                              "not with --worker-address")
    assert "give its options to 'python -m server.workers --listen'" in message
    assert "not HOST:PORT" in refused("--worker-address", "nowhere")
    with pytest.raises(SystemExit, match="--worker-tls-ca is an option of remote workers"):
        config_from_args(parse(["--worker-tls-ca", "ca.pem"]))
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(SystemExit, match="5 characters; use at least 16"):
        config_from_args(parse(["--worker-address", "10.0.0.2:7100"]))
    monkeypatch.setenv(SECRET_ENV, SECRET)
    config = config_from_args(parse(["--worker-address", "10.0.0.2:7100,unix:/run/w.sock"]))
    assert [str(a) for a in config.engine.worker_addresses] == ["10.0.0.2:7100", "unix:/run/w.sock"]
    assert config.engine.workers == 2 and config.engine.worker_secret == SECRET.encode()
    assert SECRET not in repr(config)


# -- a worker dies; another takes its address ------------------------------------------------


async def test_a_killed_worker_ends_its_streams_and_the_frontend_reconnects(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    async with AsyncExitStack() as stack:
        w = await stack.enter_async_context(listening_worker(tmp_path, address, name="first"))
        later = await stack.enter_async_context(AsyncExitStack())  # exits after the server
        config = remote_config(w, heartbeat_interval=0.2, restart_backoff=0.05, max_restarts=1,
                               restart_backoff_max=0.2)
        later_pids: set[int] = set()
        async with running_server(config, not_ours=later_pids) as url:
            engine = url.engine
            recs = [SSE(), SSE()]
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                async with trio.open_nursery() as nursery:
                    for rec in recs:
                        nursery.start_soon(stream_into, http, {"prompt": "p", "max_tokens": 5000}, rec)
                    with trio.fail_after(30):
                        for rec in recs:
                            await rec.started.wait()
                    w.proc.send_signal(signal.SIGKILL)
                    with trio.fail_after(30):
                        for rec in recs:
                            await rec.finished.wait()
                for rec in recs:
                    assert rec.status == 200 and rec.done  # error event, then [DONE]
                    assert rec.error()["code"] == "worker_died"
                    assert 0 < rec.tokens() < 5000
                # no worker: /health and /ready say so, a request gets 503
                await wait_until(lambda: not engine.workers[0].alive, 2)
                assert (await http.get("/health")).status_code == 503
                assert (await http.get("/ready")).status_code == 503
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
                # a new worker on the same address: the frontend reconnects by itself
                second = await later.enter_async_context(
                    listening_worker(tmp_path, address, name="second"))
                later_pids.add(second.proc.pid)
                await wait_http_ok(url + "/ready", timeout=10)
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert engine.statistics().workers[0].restarts >= 1
                assert "frontend 127.0.0.1:" in second.text()


# -- a long step is not a hang (server.workers.pulse) -----------------------------------------


async def test_a_listening_worker_in_a_long_step_is_not_hung(tmp_path):
    """One step of the listening worker computes for more than twice the frontend's heartbeat
    timeout: its pulse (unasked PONGs, one a second) keeps the frontend from taking it for
    hung, and the streams finish on the same connection."""
    slow = SamplingParams(max_tokens=10, extra={"fault": {"kind": "slow_step", "after": 3,
                                                          "seconds": 12.0}})
    async with listening_worker(tmp_path, "127.0.0.1:0", "--sim-faults") as w:
        config = remote_config(w, heartbeat_interval=0.2, heartbeat_timeout=5.0)
        async with open_engine(config) as engine:
            results = []

            async def consume(params):
                async with engine.generate("p", params) as stream:
                    results.append([o async for o in stream])

            with trio.fail_after(60):  # (a hang guard)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consume, slow)
                    nursery.start_soon(consume, SamplingParams(max_tokens=10))
            for outs in results:
                assert outs[-1].finish_reason == "length", outs[-1]
                assert sum(o.num_tokens for o in outs) == 10
            assert engine.statistics().workers[0].restarts == 0
            assert "disconnected" not in w.text(), w.text()
            # (and it froze its startup heap, as a pipe worker does: see test_engine_processes)
            assert engine.workers[0].info["gc_frozen"] > 1000


async def test_a_listening_worker_answering_a_long_embedding_keeps_its_frontends(tmp_path):
    """An embedding computing on the listening worker's loop for longer than both its
    ``--frontend-timeout`` and the frontend's heartbeat timeout: the pulse speaks for the
    worker, the frontend's pings (unread meanwhile) are read before its silence is judged,
    so the connection stays, the embedding is answered and a stream beside it finishes."""
    slow = {"op": "embed", "input": ["a b c"], "fault": {"kind": "slow_step", "seconds": 6.0}}
    async with listening_worker(tmp_path, "127.0.0.1:0", "--sim-faults",
                                "--frontend-timeout", "2") as w:
        config = remote_config(w, heartbeat_interval=0.2, heartbeat_timeout=3.0)
        async with open_engine(config) as engine:
            results: dict = {}

            async def consume():
                async with engine.generate("p", SamplingParams(max_tokens=10)) as stream:
                    results["stream"] = [o async for o in stream]

            async def embed():
                results["embed"] = await engine.tokenize(slow)

            with trio.fail_after(60):  # (a hang guard)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(embed)
                    nursery.start_soon(consume)
            assert results["embed"]["prompt_tokens"] == 3
            assert results["stream"][-1].finish_reason == "length"
            assert engine.statistics().workers[0].restarts == 0
            assert "disconnected" not in w.text(), w.text()


async def test_a_silent_frontend_is_dropped_while_long_answers_come_back_to_back(tmp_path):
    """Every read pass of the listening worker is long: a frontend (by hand, no pings)
    sends an embedding computing 1 s on the worker's loop every 0.6 s, so one always waits
    unread when a pass ends. A frontend that authenticated and then sent nothing is still
    dropped for its silence (it used to be checked only after a short pass: never here),
    and the busy one, whose requests wait unread, is not."""
    embed = {"op": "embed", "input": ["a"], "fault": {"kind": "slow_step", "seconds": 1.0}}
    async with listening_worker(tmp_path, "127.0.0.1:0", "--sim-faults",
                                "--frontend-timeout", "2") as w:
        config = remote_config(w)
        busy = await open_connected(config, w.address, None)
        silent = await open_connected(config, w.address, None)
        try:
            with trio.fail_after(120):  # (a hang guard: it used to wait for ever here)
                await busy.handshake()
                await silent.handshake()
                async with trio.open_nursery() as nursery:

                    async def pump() -> None:
                        for seq in itertools.count(1):
                            await busy.send.send_all(wire.encode([wire.CALL, seq, embed]))
                            await trio.sleep(0.6)

                    async def drain() -> None:
                        while await busy.receive.receive_some(1 << 16):
                            pass

                    nursery.start_soon(pump)
                    nursery.start_soon(drain)
                    while await silent.receive.receive_some(1 << 16):
                        pass  # (what the worker sends until it closes the connection)
                    nursery.cancel_scope.cancel()
                # (the worker says why after closing)
                await wait_until(lambda: "disconnected (silent" in w.text(), 60)
        finally:
            with trio.CancelScope(shield=True):
                await busy.aclose(0)
                await silent.aclose(0)
    log = w.text()
    assert log.count("disconnected (silent for 2 s)") == 1, log


# -- a frontend dies; the worker aborts its requests, other frontends go on --------------------


async def test_a_killed_frontend_process_has_its_requests_aborted_in_the_shared_worker(tmp_path):
    # The other frontend's requests stall in the worker after 3 tokens (a sim fault): they are
    # still running when it is killed, however long a busy machine takes to get there.
    async with listening_worker(tmp_path, "127.0.0.1:0", "--sim-faults") as w:
        port = free_port()
        before = child_pids()
        frontend = await trio.lowlevel.open_process(
            [sys.executable, "-m", "server", "--port", str(port), "--stream-interval-ms", "0",
             "--worker-address", str(w.address), "--sim-faults"],
            env=worker_env(SECRET), stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_http_ok(url + "/ready", timeout=20)
            async with open_engine(remote_config(w, heartbeat_interval=0.2)) as mine:
                recs = [SSE() for _ in range(3)]
                stalled = {"prompt": "p", "max_tokens": 5000, "fault": {"kind": "stall", "after": 3}}
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    async with trio.open_nursery() as nursery:
                        async def doomed(rec: SSE) -> None:
                            with pytest.raises(httpx.RemoteProtocolError):  # its server dies
                                await stream_into(http, stalled, rec, started_after=1)

                        for rec in recs:
                            nursery.start_soon(doomed, rec)
                        with trio.fail_after(30):  # (a hang guard)
                            for rec in recs:
                                await rec.started.wait()
                        # our own stream on the same worker, alongside the other frontend's
                        async with mine.generate("q", SamplingParams(max_tokens=400)) as s:
                            got, killed = 0, False
                            async for out in s:
                                got += out.num_tokens
                                if got >= 10 and not killed:  # (events may carry several)
                                    killed = True
                                    assert await mine.ping_all() == [(4, 0)]
                                    # the other frontend's requests count in our pick
                                    assert mine.workers[0].foreign == 3
                                    frontend.send_signal(signal.SIGKILL)
                                    await frontend.wait()
                                    # its three are aborted in the worker (a hang guard)
                                    with trio.fail_after(20):
                                        while (await mine.ping_all()) != [(1, 0)]:
                                            await trio.sleep(0.02)
                            assert got == 400 and out.finish_reason == "length"
                with trio.fail_after(20):  # (a hang guard)
                    while (await mine.ping_all()) != [(0, 0)]:
                        await trio.sleep(0.02)
        finally:
            if frontend.returncode is None:
                frontend.kill()
            await frontend.wait()
        # (closed, or reset: the kernel resets a socket closed with unread bytes)
        assert re.search(r"disconnected \((closed by the frontend|connection broke: .*reset"
                         r".*)\); aborted 3 request\(s\)", w.text()), w.text()
        assert child_pids() - before == set()


# -- a unix socket ---------------------------------------------------------------------------


async def test_a_worker_on_a_unix_socket_needs_no_secret_and_removes_its_socket(tmp_path):
    path = tmp_path / "w.sock"
    async with listening_worker(tmp_path, f"unix:{path}", secret=None) as w:
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        with trio.fail_after(30):
            async with open_engine(remote_config(w, secret=None)) as engine:
                async with engine.generate("x", SamplingParams(max_tokens=20)) as s:
                    assert sum([o.num_tokens async for o in s]) == 20
    assert not path.exists()


# -- TLS -------------------------------------------------------------------------------------


async def test_tls_streams_and_an_untrusted_certificate_is_refused(tmp_path):
    cert, key = make_certificate(tmp_path, "127.0.0.1")
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other, _ = make_certificate(other_dir, "127.0.0.1")
    async with listening_worker(tmp_path, "127.0.0.1:0", "--tls-cert", str(cert),
                                "--tls-key", str(key)) as w:
        assert "(TLS, secret required" in w.text()
        with trio.fail_after(30):
            async with open_engine(remote_config(w, worker_tls_ca=str(cert))) as engine:
                async with engine.generate("x", SamplingParams(max_tokens=50)) as s:
                    outs = [o async for o in s]
                assert sum(o.num_tokens for o in outs) == 50
                assert outs[-1].finish_reason == "length"
            with pytest.raises(WorkerStartupError, match="certificate verify failed"):
                async with open_engine(remote_config(w, worker_tls_ca=str(other))):
                    pass
            await wait_until(lambda: "TLS handshake failed" in w.text(), 2)


# -- a frontend that stops reading -----------------------------------------------------------


async def test_a_frontend_that_does_not_read_is_dropped_and_its_requests_aborted(tmp_path):
    path = tmp_path / "w.sock"  # unix socket buffers are small: the worker's fills soon
    async with listening_worker(tmp_path, f"unix:{path}", "--max-buffer-bytes", "100000",
                                secret=None) as w:
        config = remote_config(w, secret=None)
        with trio.fail_after(15):
            async with open_engine(config) as engine:
                link = await open_connected(config, w.address, None)  # a frontend by hand
                try:
                    await link.handshake()
                    params = SamplingParams(max_tokens=5000).to_wire(0)
                    await link.send.send_all(b"".join(
                        wire.encode([wire.SUBMIT, rid, "p", params]) for rid in range(200)))
                    # ... and it never reads: its output piles up in the worker
                    while (await engine.ping_all())[0][0] < 200:
                        await trio.sleep(0.02)
                    while (await engine.ping_all()) != [(0, 0)]:
                        await trio.sleep(0.02)
                finally:
                    await link.aclose(0)
    assert re.search(r"disconnected \(not reading \(\d+ bytes of output waiting\)\); "
                     r"aborted 200 request\(s\)", w.text()), w.text()


async def test_an_engine_with_remote_workers_refuses_what_only_spawned_ones_honour():
    def engine(**kw) -> Engine:
        return Engine(EngineConfig(worker_addresses=("127.0.0.1:7100", "unix:/run/w"), **kw))

    with pytest.raises(ValueError, match="engine_options and devices_per_worker are the rem"):
        engine(engine_options={"itl_ms": 1.0})
    with pytest.raises(ValueError, match="workers=3 with 2 worker addresses"):
        engine(workers=3)
    assert [str(w.address) for w in engine().workers] == ["127.0.0.1:7100", "unix:/run/w"]


def test_the_secret_reads_the_same_from_a_file_and_the_environment(tmp_path):
    # kustomize makes the Secret from a file, newline included, and hands it to the pods'
    # environment; a frontend given the file must agree with a worker given the variable.
    from server.worker_protocol.handshake import SECRET_ENV, read_secret

    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert read_secret(str(path), {}) == read_secret(None, {SECRET_ENV: SECRET + "\n"})
    assert read_secret(None, {SECRET_ENV: SECRET + "\r\n"}) == SECRET.encode()


async def test_connecting_to_a_host_that_does_not_answer_gives_up_at_the_heartbeat_timeout():
    # A listener whose backlog is full drops new SYNs, as a host that is gone does: the
    # connect would wait for the kernel's connect timeout (minutes).
    import pytest

    from server.config import EngineConfig
    from server.manager.transport import SessionEnded, open_connected
    from server.worker_protocol.handshake import parse_address

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filled = []
    try:
        for _ in range(4):  # fill the backlog (its size is the kernel's choice for 0)
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            filled.append(s)
        config = EngineConfig(heartbeat_timeout=0.3)
        started = trio.current_time()
        # (the guard: the kernel's connect timeout is minutes)
        with trio.fail_after(60), pytest.raises(SessionEnded, match="no answer within 0.3 s"):
            await open_connected(config, parse_address(f"127.0.0.1:{port}"), None)
        assert trio.current_time() - started >= 0.3  # not before the timeout
    finally:
        for s in filled:
            s.close()
        listener.close()
