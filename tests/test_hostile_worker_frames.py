"""What one frontend may cost a listening worker (issue 42, item 2), against a real worker
process: a frame of millions of empty arrays (24 MB took the worker from 33 MB to 1.77 GB
and stalled it ~19 s, so that every frontend took it for hung), a request over the
decoding budget, a 1-byte AUTH nonce, the authenticated connections' cap, the buffers of
all connections together, and the log lines of connections that never authenticate.

The bounds themselves are tested sans-IO in tests/test_frame_limits.py. Real processes:
every ``fail_after`` is a hang guard; memory is read from /proc (VmHWM: the peak).
"""

from __future__ import annotations

import logging
import os
import re
import socket

import msgpack
import pytest
import trio

from server import SamplingParams, open_engine
from server.worker_protocol import handshake, wire
from tests.remote import SECRET, listening_worker, remote_config, wait_until
from tests.test_malformed_frames import HandFrontend

#: How much a worker's peak memory may grow while it refuses a hostile frame.
GROWTH = 300 << 20


def peak(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
    assert found
    return int(found.group(1)) << 10


def _empties(n: int) -> bytes:
    """The frame of the issue: one array of ``n`` empty arrays (24M of them: 24 MB)."""
    body = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    return len(body).to_bytes(4, "big") + body


def _submit_of_empties(n: int, rid: int) -> bytes:
    """``[SUBMIT, rid, [[], [], ...n], {}]``: a well-formed request whose prompt decodes to
    ``n`` lists."""
    body = (b"\x94" + msgpack.packb(wire.SUBMIT) + msgpack.packb(rid)
            + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\x80")
    return len(body).to_bytes(4, "big") + body


def _send_until_closed(frontend: HandFrontend, data: bytes) -> bool:
    """Send ``data``; whether the worker then ended the connection (it may stop reading
    before the end: the send breaks)."""
    try:
        frontend.sock.sendall(data)
    except OSError:  # reset or broken pipe: it closed on us
        return True
    while frontend.next() is not None:
        pass
    return True


@pytest.mark.parametrize("n", [24_000_000, 8_000_000])
async def test_a_frame_of_empty_arrays_ends_its_connection_and_the_worker_stays_small(
        tmp_path, n):
    async with listening_worker(tmp_path) as w:
        async with open_engine(remote_config(w)) as engine:
            # another frontend streams meanwhile
            async with engine.generate("x", SamplingParams(max_tokens=1500)) as stream:
                first = await stream.__anext__()
                before = peak(w.proc.pid)
                frame = _empties(n)

                def hostile() -> bool:
                    frontend = HandFrontend(w.address, SECRET)
                    try:
                        return _send_until_closed(frontend, frame)
                    finally:
                        frontend.close()

                with trio.fail_after(120):
                    assert await trio.to_thread.run_sync(hostile)
                outs = [first, *[o async for o in stream]]
            after = peak(w.proc.pid)
            assert after - before < GROWTH, (before, after)
            # the stream beside it finished intact
            assert sum(o.num_tokens for o in outs) == 1500
            assert outs[-1].finish_reason == "length"
            assert len("".join(o.text for o in outs).split()) == 1500
            assert w.proc.returncode is None
            assert await engine.ping_all() == [(0, 0)]
    assert re.search(rf"disconnected \(protocol violation: a non-message frame of {n + 5} "
                     r"bytes exceeds its limit of 4096\); aborted 0 request\(s\)$",
                     w.text(), re.M), w.text()
    assert "Traceback" not in w.text()


async def test_a_request_over_the_decoding_budget_is_refused_as_its_own_error(tmp_path):
    """A well-formed SUBMIT of 8M empty lists (8 MB), or of 65,537 nested ones: that
    request's error (a client's absurd body, passed on by its frontend, must not end the
    frontend's other streams), the connection kept, the worker's memory bounded."""
    frames = [_submit_of_empties(8_000_000, rid=5),
              wire.encode([wire.SUBMIT, 6, [[[]] * 1000] * 66, {}])]
    async with listening_worker(tmp_path) as w:
        before = peak(w.proc.pid)

        def hostile() -> list:
            frontend = HandFrontend(w.address, SECRET)
            try:
                frontend.sock.sendall(b"".join(frames))
                errors: list = []
                while len(errors) < 2:
                    reply = frontend.next()
                    assert reply is not None and reply[0] == wire.STEP, reply
                    errors += reply[2]
                assert frontend.kept([wire.PING, 1])  # the connection serves on
                return errors
            finally:
                frontend.close()

        with trio.fail_after(120):
            errors = await trio.to_thread.run_sync(hostile)
        after = peak(w.proc.pid)
        assert after - before < GROWTH, (before, after)
        assert errors == [
            [5, "", 0, "error", ["invalid_request", "the request is too large for the worker "
                                 "to decode: more than 1,048,576 values"]],
            [6, "", 0, "error", ["invalid_request", "the request is too large for the worker "
                                 "to decode: more than 65,536 arrays and maps"]],
        ]
        async with open_engine(remote_config(w)) as engine:
            async with engine.generate("x", SamplingParams(max_tokens=3)) as stream:
                assert sum([o.num_tokens async for o in stream]) == 3
    assert "Traceback" not in w.text()


async def test_an_auth_with_a_1_byte_cnonce_is_refused(tmp_path):
    async with listening_worker(tmp_path) as w:
        assert w.address is not None

        def auth(cnonce: bytes) -> list | None:
            sock = socket.create_connection((w.address.host, w.address.port), timeout=30)
            decoder = wire.FrameDecoder()
            try:
                got: list = []
                while not got:
                    got = decoder.feed(sock.recv(1 << 16))
                challenge = got[0]
                proof = handshake.client_proof(SECRET.encode(), challenge[2], cnonce)
                sock.sendall(wire.encode([wire.AUTH, cnonce, proof]))
                while True:
                    try:
                        data = sock.recv(1 << 16)
                    except ConnectionResetError:
                        return None
                    if not data:
                        return None
                    if got := decoder.feed(data):
                        return got[0]
            finally:
                sock.close()

        with trio.fail_after(60):
            assert await trio.to_thread.run_sync(auth, b"\x01") is None
            hello = await trio.to_thread.run_sync(auth, os.urandom(32))
        assert hello is not None and hello[0] == wire.HELLO
    assert re.search(r"connection from 127\.0\.0\.1:\d+ ended: protocol violation: malformed "
                     r"AUTH", w.text()), w.text()


async def test_a_frontend_over_the_cap_starts_retries_and_connects_once_there_is_room(
        tmp_path, caplog):
    """--max-frontends 1 (a rolling restart, or a dead frontend's connection still counted):
    the second frontend is not refused as with wrong credentials, which would end its
    server at once (WorkerStartupError, exit 1) or log an error per retry; the worker
    closes its connection before HELLO, and it retries until the first goes away."""
    caplog.set_level(logging.INFO, logger="server")
    async with listening_worker(tmp_path, "127.0.0.1:0", "--max-frontends", "1") as w:
        with trio.fail_after(120):  # (a hang guard: real processes)
            async with trio.open_nursery() as nursery:
                first_up, first_go = trio.Event(), trio.Event()

                async def first_frontend() -> None:
                    async with open_engine(remote_config(w)) as first:
                        assert await first.ping_all() == [(0, 0)]
                        first_up.set()
                        await first_go.wait()

                nursery.start_soon(first_frontend)
                await first_up.wait()
                # started as the HTTP server starts its engine: the workers come up behind it
                config = remote_config(w, restart_backoff=0.05, restart_backoff_max=0.2)
                async with open_engine(config, wait_ready=False) as second:
                    client = second.workers[0]
                    await wait_until(lambda: client.restarts >= 3, 100)  # it keeps trying
                    assert not client.alive
                    first_go.set()  # the first goes away: the second gets its place
                    await client.wait_ready()
                    assert await second.ping_all() == [(0, 0)]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "after our AUTH (as a worker at its --max-frontends does)" in caplog.text
    assert re.search(r"connection from 127\.0\.0\.1:\d+ ended: this worker serves 1 "
                     r"frontends already \(--max-frontends 1\): closed before HELLO",
                     w.text()), w.text()


async def test_the_connections_together_hold_at_most_the_buffer_budget(tmp_path):
    """Two frontends each park an unfinished 10 MB SUBMIT; past --max-total-buffer-bytes
    the one holding the most is dropped, the other kept."""
    async with listening_worker(tmp_path, "127.0.0.1:0", "--max-total-buffer-bytes",
                                "1000000") as w:
        head = (10_000_000).to_bytes(4, "big") + b"\x94\x01\x07\xda"

        big, small = HandFrontend(w.address, SECRET), HandFrontend(w.address, SECRET)
        try:

            def park() -> bool:
                big.sock.sendall(head + bytes(700_000))
                small.sock.sendall(head + bytes(400_000))
                return big.next() is None

            with trio.fail_after(60):
                assert await trio.to_thread.run_sync(park)  # dropped
                # the worker went round its loop since (a round trip): the other is kept
                async with open_engine(remote_config(w)) as engine:
                    assert await engine.ping_all() == [(0, 0)]
            budget = re.findall(r"frontend (\S+) disconnected \(over the worker's buffer "
                                r"budget: it held \d+ of the \d+ bytes held "
                                r"\(--max-total-buffer-bytes 1000000\)\)", w.text())
            assert budget == [f"127.0.0.1:{big.sock.getsockname()[1]}"], w.text()
        finally:
            big.close()
            small.close()


async def test_connections_that_never_authenticate_are_logged_a_line_at_a_time(tmp_path):
    """200 connections that close before authenticating: a line or two, and the count of
    the others (it was a line each: 1,649 connects wrote 2,669 lines)."""
    async with listening_worker(tmp_path) as w:
        assert w.address is not None

        def connects() -> None:
            for _ in range(200):
                socket.create_connection((w.address.host, w.address.port), timeout=30).close()

        with trio.fail_after(60):
            await trio.to_thread.run_sync(connects)
        # the count comes once the interval is over (the worker's housekeeping)
        await wait_until(lambda: "not logged one by one" in w.text(), 60)
        # ... and the worker serves on
        async with open_engine(remote_config(w)) as engine:
            assert await engine.ping_all() == [(0, 0)]
    text = w.text()
    # (closed, or reset: the worker's challenge unread)
    plain = re.findall(r"connection from 127\.0\.0\.1:\d+ ended: ", text)
    counted = re.findall(r"(\d+) more connection\(s\) ended before authenticating", text)
    assert len(plain) + len(counted) <= 4, text
    assert len(plain) + sum(map(int, counted)) == 200, text
