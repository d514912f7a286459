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

import trio
from hypothesis import HealthCheck, given, settings

from server import SamplingParams, open_engine
from server.protocol import handshake, wire
from tests import frames
from tests.conftest import assert_engine_idle
from tests.remote import (
    ROOT, SECRET, listening_worker, remote_config,
)

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
        kind = {1: "SUBMIT", 2: "ABORT", 3: "PING", 7: "TOKENIZE"}[frame[0]]
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
