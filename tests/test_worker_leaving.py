"""A listening worker told to stop (SIGTERM: a Kubernetes scale-down) tells its frontends
first (LEAVING), refuses what they send later, lets its streams finish and exits 0
(server.workers.leaving); the frontend sends it nothing new and takes the end of its
session for a planned leave (server.manager.worker). Real processes, so real time with
generous ``trio.fail_after`` bounds that pass at once when all is well.
"""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import AsyncExitStack

import httpx
import pytest
import trio

from server import SamplingParams, open_engine
from server.worker_protocol import handshake, wire
from tests.conftest import running_server
from tests.remote import (
    SECRET, FrameProxy, free_port, listening_worker, make_certificate, remote_config,
    wait_until,
)
from tests.sse_record import assert_whole, completion_payloads
from tests.test_dns_discovery import NAME, dns_config, dns_server

LIMIT = 120  # (generous: 2 busy cores)


@pytest.mark.parametrize("discovery", ["list", "dns"])
async def test_sigterm_drains_64_streams_and_new_requests_go_to_the_other_worker(
        tmp_path, caplog, discovery):
    """64 streams over two workers; one gets SIGTERM mid-stream: every stream ends [DONE]
    at its full length with no error event (those on the leaving worker finish there:
    nothing moves), new requests all go to the other worker, the leaving one exits 0, and
    its frontend logs the leave as info, counting no restart (only the tries at its
    address after the first that failed are warned about and counted: it is gone)."""
    caplog.set_level(logging.INFO)
    port = free_port()
    hosts = ["127.0.0.2", "127.0.0.3"]
    args = ("--shutdown-timeout", str(LIMIT))  # (no cut: they finish there)
    with dns_server() as records:
        records.set(NAME, *hosts)
        async with AsyncExitStack() as stack:
            workers = [await stack.enter_async_context(listening_worker(
                tmp_path, f"{h}:{port}", *args, name=h)) for h in hosts]
            if discovery == "dns":
                config = dns_config(f"dns:{NAME}:{port}", records, dns_drain_grace=LIMIT)
            else:
                config = remote_config(*workers, heartbeat_interval=0.2,
                                       restart_backoff=0.05, restart_backoff_max=0.2)
            async with running_server(config) as url:
                engine = url.engine
                await wait_until(lambda: sum(w.routable for w in engine.workers) == 2, LIMIT)
                body = {"model": "sim", "prompt": "hi", "max_tokens": 2000}
                started: list = []
                results: dict[int, list[str]] = {}
                limits = httpx.Limits(max_connections=100)
                async with httpx.AsyncClient(base_url=url, timeout=LIMIT, limits=limits) as http:
                    with trio.fail_after(LIMIT):
                        async with trio.open_nursery() as nursery:
                            async def one(i: int) -> None:
                                results[i] = await completion_payloads(http, "", body, started)

                            for i in range(64):
                                nursery.start_soon(one, i)
                            await wait_until(lambda: len(started) == 64, LIMIT)
                            leaving = next(w for w in engine.workers
                                           if w.address.host == hosts[0])
                            staying = next(w for w in engine.workers if w is not leaving)
                            assert leaving.outstanding  # (mid-stream)
                            workers[0].proc.send_signal(signal.SIGTERM)
                            await wait_until(lambda: leaving.leaving, LIMIT)
                            # (one takes none; the other, heard 1.1 s ago at most, may
                            # seem silent for a moment to a loop the machine starves)
                            while (ready := (await http.get("/ready")).json())[
                                    "status"] != "degraded":
                                assert ready["status"] == "unavailable", ready
                                await trio.sleep(0.05)
                            assert ready["workers_alive"] == 1, ready
                            routed = list(engine.statistics().routing.routed)
                            for _ in range(16):  # new ones, while the streams run
                                r = await http.post("/v1/completions", json={
                                    "model": "sim", "prompt": "new", "max_tokens": 4})
                                assert r.status_code == 200, r.text
                            now = engine.statistics().routing.routed
                            assert now[leaving.index] == routed[leaving.index]
                            assert now[staying.index] == routed[staying.index] + 16
                    assert await workers[0].proc.wait() == 0, workers[0].text()
                    await wait_until(lambda: not leaving.alive, LIMIT)
                stats = engine.statistics()
    assert len(results) == 64
    for events in results.values():
        assert_whole(events, 2000)
    assert stats.migration is not None and sum(stats.migration.migrations.values()) == 0
    assert not stats.workers[staying.index].restarts
    text = workers[0].text()
    assert "stopping (SIGTERM): told 1 of 1 frontend(s)" in text, text
    assert "stopped: every frontend was told" in text, text
    lines = [r for r in caplog.records if r.name.startswith("server")]
    assert any("left, as it said it would" in r.getMessage() for r in lines)
    assert not [r.getMessage() for r in lines if r.levelno >= logging.ERROR]
    assert not [r.getMessage() for r in lines
                if r.levelno >= logging.WARNING and "reconnecting" in r.getMessage()
                and "cannot connect" not in r.getMessage()]
    tries = [r for r in lines if "cannot connect" in r.getMessage()]
    assert not tries or tries[0].levelno == logging.INFO  # (the first: the leave's)


async def test_a_cut_drain_moves_its_streams_and_the_worker_back_at_its_address_is_used(
        tmp_path):
    """--shutdown-timeout 0: told, then cut at once: its streams move to the other worker
    (cause ``left``) and end whole; it exits 0. A worker started again at the same address
    is reconnected to and routed to again; the leave counts no restart (the tries at
    its address after the first that failed do, as for any worker away)."""
    address = f"127.0.0.1:{free_port()}"
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(listening_worker(
            tmp_path, address, "--shutdown-timeout", "0", name="first"))
        other = await stack.enter_async_context(listening_worker(tmp_path, name="other"))
        later = await stack.enter_async_context(AsyncExitStack())  # exits after the server
        config = remote_config(first, other, heartbeat_interval=0.2, restart_backoff=0.05,
                               restart_backoff_max=0.2)
        later_pids: set[int] = set()
        async with running_server(config, not_ours=later_pids) as url:
            engine = url.engine
            leaving, staying = engine.workers
            await wait_until(lambda: leaving.routable and staying.routable, LIMIT)
            body = {"model": "sim", "prompt": "hi", "max_tokens": 2000}
            started: list = []
            results: dict[int, list[str]] = {}
            async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
                with trio.fail_after(LIMIT):
                    async with trio.open_nursery() as nursery:
                        async def one(i: int) -> None:
                            results[i] = await completion_payloads(http, "", body, started)

                        for i in range(8):
                            nursery.start_soon(one, i)
                        await wait_until(lambda: len(started) == 8, LIMIT)
                        held = leaving.outstanding
                        assert held
                        first.proc.send_signal(signal.SIGTERM)
                    assert await first.proc.wait() == 0, first.text()
                    moved = engine.statistics().migration.migrations
                    assert moved["left"] == held, moved
                    # back at the same address: reconnected, routed to again
                    second = await later.enter_async_context(
                        listening_worker(tmp_path, address, name="second"))
                    later_pids.add(second.proc.pid)
                    await wait_until(lambda: leaving.routable, LIMIT)
                    routed = engine.statistics().routing.routed[leaving.index]
                    while engine.statistics().routing.routed[leaving.index] == routed:
                        r = await http.post("/v1/completions", json={
                            "model": "sim", "prompt": "new", "max_tokens": 4})
                        assert r.status_code == 200, r.text
            assert not staying.restarts
    for events in results.values():
        assert_whole(events, 2000)
    assert "--shutdown-timeout is over: cutting" in first.text()


async def _connect(address: handshake.WorkerAddress, topics: list[str]):
    """A frontend's connection of our own, authenticated, subscribed to ``topics``; and
    ``receive(kind)``: its next message of that kind (the others are skipped)."""
    stream = await trio.open_tcp_stream(address.host, address.port)
    decoder = wire.FrameDecoder()
    pending: list = []

    async def receive(kind: int) -> list:
        while True:
            while pending:
                message = pending.pop(0)
                if message[0] == kind:
                    return message
            pending.extend(decoder.feed(await stream.receive_some(1 << 16)))

    challenge = await receive(wire.CHALLENGE)
    cnonce = handshake.new_nonce()
    proof = handshake.client_proof(SECRET.encode(), challenge[2], cnonce)
    await stream.send_all(wire.encode([wire.AUTH, cnonce, proof]))
    hello = await receive(wire.HELLO)
    assert hello[1][wire.LEAVING_KEY] is True
    await stream.send_all(wire.encode([wire.SUBSCRIBE, topics]))
    return stream, receive


async def test_the_worker_refuses_a_late_submit_to_a_frontend_it_told_and_not_to_another(
        tmp_path):
    """On the wire: a frontend that subscribed gets LEAVING, and its SUBMIT after that an
    error row of the kind ``leaving``; one that did not subscribe (an older frontend) gets
    neither, and its SUBMIT runs on. A second SIGTERM stops the worker at once."""
    async with listening_worker(tmp_path) as w:
        with trio.fail_after(LIMIT):
            told, receive_told = await _connect(w.address, [wire.LEAVING_TOPIC])
            older, receive_older = await _connect(w.address, [wire.PARTS_TOPIC])
            params = {"max_tokens": 8000, "temperature": 1.0, "top_p": 1.0, "seed": 1,
                      "stop": [], "ignore_eos": False}
            await older.send_all(wire.encode([wire.SUBMIT, 1, "p", params]))
            accepted = await receive_older(wire.STEP)
            assert accepted[1] == [[1, 1]], accepted  # (it runs)
            w.proc.send_signal(signal.SIGTERM)
            leaving = await receive_told(wire.LEAVING)
            assert leaving[1] > 0, leaving
            await told.send_all(wire.encode([wire.SUBMIT, 7, "p", params]))
            while not (step := await receive_told(wire.STEP))[2]:
                pass
            assert step[2][0][:4] == [7, "", 0, "error"], step
            assert step[2][0][4][0] == wire.LEAVING_KIND
            assert "told 1 of 2 frontend(s); 1 request(s) may finish" in w.text(), w.text()
            await receive_older(wire.STEP)  # (its request runs on)
            w.proc.send_signal(signal.SIGTERM)
            assert await w.proc.wait() == -signal.SIGTERM
            await told.aclose()
            await older.aclose()


async def test_a_submit_refused_as_the_worker_leaves_goes_to_another_and_the_client_sees_nothing(
        tmp_path):
    """The frontend's side of the race: a request the worker refused as it left (here, as
    if it had: frames slipped in by a proxy) goes on on another worker, whole, counted as
    sent again (cause ``left``), not as a migration of the request."""
    async with (
        listening_worker(tmp_path, name="a") as a,
        listening_worker(tmp_path, name="b") as b,
        trio.open_nursery() as nursery,
    ):
        proxy = await nursery.start(FrameProxy(a.address).run)
        config = remote_config(proxy, b, routing="least-loaded", heartbeat_interval=0.2)
        async with open_engine(config) as engine:
            through, direct = engine.workers
            await wait_until(lambda: through.routable and direct.routable
                             and proxy.current is not None, LIMIT)
            params = SamplingParams(max_tokens=2000)
            with trio.fail_after(LIMIT):
                async with (engine.generate("one", params) as first,
                            engine.generate("two", params) as second):
                    stream = next(s for s in (first, second)
                                  if s.choice_states()[0].worker is through)
                    [choice] = stream.choice_states()
                    outs = [await stream.__anext__()]
                    relay = proxy.current
                    assert relay is not None
                    await proxy.inject(relay, wire.encode([wire.LEAVING, 30.0]))
                    await proxy.inject(relay, wire.encode([wire.STEP, [], [[
                        choice.rid, "", 0, "error", [wire.LEAVING_KIND, "stopping"]]]]))
                    outs += [out async for out in stream]
                    other = first if stream is second else second
                    rest = [out async for out in other]
            assert outs[-1].finish_reason == "length" and rest[-1].finish_reason == "length"
            assert sum(o.num_tokens for o in outs) == 2000
            assert choice.worker is direct and choice.migrations == 0
            assert through.leaving and not through.routable
            assert engine.statistics().migration.migrations == {"left": 1}
        nursery.cancel_scope.cancel()  # (the proxy)


async def _held_by(engine, params: SamplingParams, stack: AsyncExitStack):
    """Two requests, least-loaded over the proxied worker and the direct one: the stream
    on the proxied one, its choice, and the other stream."""
    first = await stack.enter_async_context(engine.generate("one", params))
    second = await stack.enter_async_context(engine.generate("two", params))
    through = engine.workers[0]
    stream = next(s for s in (first, second) if s.choice_states()[0].worker is through)
    return stream, stream.choice_states()[0], first if stream is second else second


async def test_a_submit_that_reached_the_worker_after_its_drain_goes_to_another_uncounted(
        tmp_path):
    """The race of a SUBMIT sent as LEAVING was on its way, that reached the worker after
    its drain: the worker closed without answering it. The frontend sends it again (it
    never started), uncounted, so it ends whole on the other worker with migration off
    too (here the proxy holds the worker's accept back, says LEAVING and closes)."""
    async with (
        listening_worker(tmp_path, name="a") as a,
        listening_worker(tmp_path, name="b") as b,
        trio.open_nursery() as nursery,
    ):
        proxy = await nursery.start(FrameProxy(a.address).run)
        config = remote_config(proxy, b, routing="least-loaded", heartbeat_interval=0.2,
                               max_migrations=0)
        async with open_engine(config) as engine:
            through, direct = engine.workers
            await wait_until(lambda: through.routable and direct.routable
                             and proxy.current is not None, LIMIT)
            relay = proxy.current
            assert relay is not None
            with trio.fail_after(LIMIT):
                async with AsyncExitStack() as stack:
                    async with relay.lock:  # (the worker's frames wait: no accept comes)
                        stream, choice, other = await _held_by(
                            engine, SamplingParams(max_tokens=2000), stack)
                        await wait_until(lambda: choice.rid in through.states, LIMIT)
                        await relay.stream.send_all(wire.encode([wire.LEAVING, 30.0]))
                        await relay.stream.send_eof()  # (a clean end: the drain was over)
                    outs = [out async for out in stream]
                    rest = [out async for out in other]
            assert outs[-1].finish_reason == "length" and rest[-1].finish_reason == "length"
            assert sum(o.num_tokens for o in outs) == 2000
            assert choice.worker is direct and choice.migrations == 0
            assert through.restarts == 0
            assert engine.statistics().migration.migrations == {"left": 1}  # (counted apart)
        nursery.cancel_scope.cancel()  # (the proxy)


@pytest.mark.parametrize("end", ["eof", "garbage"])
async def test_a_worker_that_said_leaving_then_died_early_counts_as_a_crash(
        tmp_path, caplog, end):
    """LEAVING promised 30 s; the session then ends early with a stream still running there
    (a clean EOF: the process was OOM-killed; or a protocol violation): a crash, not the
    planned leave. Its stream moves with the session's own cause, a restart is counted,
    and the frontend warns."""
    caplog.set_level(logging.INFO)
    async with (
        listening_worker(tmp_path, name="a") as a,
        listening_worker(tmp_path, name="b") as b,
        trio.open_nursery() as nursery,
    ):
        proxy = await nursery.start(FrameProxy(a.address).run)
        config = remote_config(proxy, b, routing="least-loaded", heartbeat_interval=0.2,
                               restart_backoff=0.05, restart_backoff_max=0.2)
        async with open_engine(config) as engine:
            through, direct = engine.workers
            await wait_until(lambda: through.routable and direct.routable
                             and proxy.current is not None, LIMIT)
            relay = proxy.current
            assert relay is not None
            with trio.fail_after(LIMIT):
                async with AsyncExitStack() as stack:
                    stream, choice, other = await _held_by(
                        engine, SamplingParams(max_tokens=2000), stack)
                    outs = [await stream.__anext__()]  # (it runs there)
                    async with relay.lock:
                        await relay.stream.send_all(wire.encode([wire.LEAVING, 30.0]))
                        if end == "eof":
                            await relay.stream.send_eof()
                        else:
                            await relay.stream.send_all(wire.encode([wire.AUTH, b"x", b"y"]))
                    outs += [out async for out in stream]
                    rest = [out async for out in other]
                await wait_until(lambda: proxy.current not in (None, relay), LIMIT)
                await wait_until(lambda: through.routable, LIMIT)
            assert outs[-1].finish_reason == "length" and rest[-1].finish_reason == "length"
            assert choice.migrations == 1
            cause = "disconnected" if end == "eof" else "protocol_error"
            assert engine.statistics().migration.migrations == {cause: 1}
            assert through.restarts == 1
        nursery.cancel_scope.cancel()  # (the proxy)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("server")]
    assert not any("left, as it said it would" in line for line in lines), lines
    assert any("reconnecting in" in line for line in lines), lines


async def test_after_a_leave_only_the_first_failed_reconnect_is_quiet(tmp_path, caplog):
    """A worker at a fixed address leaves for good: the first try at its address that
    fails is the leave's (quiet, not counted); those after it are warned about and
    counted, as for any worker that is gone."""
    caplog.set_level(logging.INFO)
    async with (
        listening_worker(tmp_path, f"127.0.0.1:{free_port()}", "--shutdown-timeout", "0",
                         name="a") as a,
        listening_worker(tmp_path, name="b") as b,
    ):
        config = remote_config(a, b, heartbeat_interval=0.2, restart_backoff=0.05,
                               restart_backoff_max=0.2)
        async with open_engine(config) as engine:
            gone = engine.workers[0]
            await wait_until(lambda: gone.routable, LIMIT)
            a.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(LIMIT):
                assert await a.proc.wait() == 0
            await wait_until(lambda: gone.restarts >= 1, LIMIT)
            assert not gone.leaving
    lines = [r for r in caplog.records if r.name.startswith("server")]
    assert any("left, as it said it would" in r.getMessage() for r in lines)
    assert any(r.levelno == logging.WARNING and "reconnecting in" in r.getMessage()
               for r in lines)


#: A listening worker whose engine's cleanup (as vLLM's: seconds) lasts until a file exists.
_SLOW_CLEANUP = """
import os, sys, time
from server.engines.sim.engine import SimEngine
def close_before_exit(self):
    print("closing the engine", file=sys.stderr, flush=True)
    while not os.path.exists({flag!r}):
        time.sleep(0.01)
    print("engine closed", file=sys.stderr, flush=True)
SimEngine.close_before_exit = close_before_exit
from server.workers.listen import main
main(sys.argv[4:])
"""


async def test_a_sigterm_during_the_engines_cleanup_after_a_leave_does_not_cut_it(tmp_path):
    """After a completed leave the engine's cleanup runs; a supervisor that signals the
    whole group sends SIGTERM again meanwhile: it is ignored, the cleanup ends, and the
    worker exits 0."""
    flag = tmp_path / "cleanup may end"
    prefix = (sys.executable, "-c", _SLOW_CLEANUP.format(flag=str(flag)))
    async with listening_worker(tmp_path, "127.0.0.1:0", "--shutdown-timeout", "0",
                                prefix=prefix) as w:
        w.proc.send_signal(signal.SIGTERM)
        await wait_until(lambda: "closing the engine" in w.text(), LIMIT)
        w.proc.send_signal(signal.SIGTERM)
        await trio.sleep(0.5)  # (the signal arrives while the cleanup still waits)
        flag.touch()
        with trio.fail_after(LIMIT):
            assert await w.proc.wait() == 0, w.text()
        assert "engine closed" in w.text(), w.text()


async def test_a_frontend_that_was_not_told_is_closed_once_its_requests_are_over(tmp_path):
    """An older frontend (it did not subscribe to LEAVING) cannot be told: once its own
    request is over the worker closes its connection (it finds the worker gone), rather
    than taking its new requests until the cut; a frontend that was told keeps streaming."""
    async with listening_worker(tmp_path, "127.0.0.1:0", "--shutdown-timeout", str(LIMIT)) as w:
        with trio.fail_after(LIMIT):
            told, receive_told = await _connect(w.address, [wire.LEAVING_TOPIC])
            older, receive_older = await _connect(w.address, [wire.PARTS_TOPIC])
            params = {"max_tokens": 8000, "temperature": 1.0, "top_p": 1.0, "seed": 1,
                      "stop": [], "ignore_eos": False}
            await told.send_all(wire.encode([wire.SUBMIT, 1, "p", params]))
            await older.send_all(wire.encode([wire.SUBMIT, 1, "p", {**params, "max_tokens": 50}]))
            await receive_told(wire.STEP)
            await receive_older(wire.STEP)
            w.proc.send_signal(signal.SIGTERM)
            await receive_told(wire.LEAVING)
            while await older.receive_some(1 << 16):  # (to its request's end, then EOF)
                pass
            await told.send_all(wire.encode([wire.PING, 1]))
            while (pong := await receive_told(wire.PONG))[1] != 1:  # (not the pulse's)
                pass
            assert pong[4] == 1, pong  # (its stream goes on)
            await older.aclose()
            await told.aclose()
        assert await w.proc.wait() == 0, w.text()


async def test_a_leave_over_tls_is_a_planned_leave(tmp_path, caplog):
    """Over TLS the worker ends its side with TLS's close_notify, so the frontend reads a
    clean end: its leave is planned, its cut streams move with the cause ``left`` and end
    whole. (A bare shut of the socket reads as a broken link there: a crash.)"""
    caplog.set_level(logging.INFO)
    cert, key = make_certificate(tmp_path, "127.0.0.1")
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    async with (
        listening_worker(tmp_path, "127.0.0.1:0", "--shutdown-timeout", "0", *tls,
                         name="a") as a,
        listening_worker(tmp_path, "127.0.0.1:0", *tls, name="b") as b,
    ):
        config = remote_config(a, b, worker_tls_ca=str(cert), routing="least-loaded",
                               heartbeat_interval=0.2, restart_backoff=0.05,
                               restart_backoff_max=0.2)
        async with open_engine(config) as engine:
            leaving, staying = engine.workers
            await wait_until(lambda: leaving.routable and staying.routable, LIMIT)
            params = SamplingParams(max_tokens=2000)
            with trio.fail_after(LIMIT):
                async with AsyncExitStack() as stack:
                    streams = [await stack.enter_async_context(engine.generate("hi", params))
                               for _ in range(4)]
                    firsts = [await stream.__anext__() for stream in streams]  # (each runs)
                    held = leaving.outstanding
                    assert held
                    a.proc.send_signal(signal.SIGTERM)
                    for first, stream in zip(firsts, streams):
                        outs = [first] + [out async for out in stream]
                        assert outs[-1].finish_reason == "length"
                        assert sum(out.num_tokens for out in outs) == 2000
                assert await a.proc.wait() == 0, a.text()
            assert engine.statistics().migration.migrations == {"left": held}
            assert not staying.restarts
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("server")]
    assert any("left, as it said it would" in line for line in lines), lines
    assert not any("connection broke" in line for line in lines), lines


async def test_a_scale_down_as_kubernetes_does_it_logs_no_warning(tmp_path, caplog):
    """Kubernetes' order: the pod leaves the Service's DNS answers (its preStop), then gets
    SIGTERM. Its streams finish there, it exits 0, and the frontend says nothing above info:
    neither the removal from the pool nor the planned leave is a fault."""
    caplog.set_level(logging.INFO)
    port = free_port()
    hosts = ["127.0.0.2", "127.0.0.3"]
    with dns_server() as records:
        records.set(NAME, *hosts)
        async with AsyncExitStack() as stack:
            workers = [await stack.enter_async_context(listening_worker(
                tmp_path, f"{h}:{port}", "--shutdown-timeout", str(LIMIT), name=h))
                for h in hosts]
            config = dns_config(f"dns:{NAME}:{port}", records, dns_drain_grace=LIMIT,
                                routing="least-loaded")
            async with open_engine(config) as engine:
                await wait_until(lambda: sum(w.routable for w in engine.workers) == 2, LIMIT)
                params = SamplingParams(max_tokens=2000)
                with trio.fail_after(LIMIT):
                    async with AsyncExitStack() as streams:
                        held = [await streams.enter_async_context(engine.generate("hi", params))
                                for _ in range(4)]
                        firsts = [await stream.__anext__() for stream in held]
                        leaving = next(w for w in engine.workers if w.address.host == hosts[0])
                        assert leaving.outstanding
                        records.set(NAME, hosts[1])  # (its preStop)
                        await wait_until(lambda: leaving.retired, LIMIT)
                        workers[0].proc.send_signal(signal.SIGTERM)
                        for first, stream in zip(firsts, held):
                            outs = [first] + [out async for out in stream]
                            assert sum(out.num_tokens for out in outs) == 2000
                    assert await workers[0].proc.wait() == 0, workers[0].text()
                    await wait_until(lambda: leaving.removed, LIMIT)
                assert sum(engine.statistics().migration.migrations.values()) == 0
    said = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records
            if r.name.startswith("server") and r.levelno >= logging.WARNING]
    assert not said, said
