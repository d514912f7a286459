#!/usr/bin/env python3
"""CPU cost per chunk of the request manager's hot path, against a bare trio channel.

What it measures
----------------
``--streams`` concurrent requests (default 512) each receive one chunk per engine step for
``--steps`` steps (default 200), two ways, in the same process and run:

* **manager**: the real path of :mod:`server.manager`. An :func:`server.open_engine` whose one
  worker is a fake process (the ``spawn`` seam): its stdout yields pre-encoded frames
  (HELLO; once every SUBMIT has arrived, one STEP frame accepting them all; then one STEP
  frame per step carrying one output for each rid, the last one with ``finish="length"``).
  Per chunk this costs the router task's share of decoding the frame, routing the output to
  its :class:`~server.manager.stream.Choice` (merge, queue, wake), and the consumer's
  ``async for out in stream`` (park, take a :class:`~server.outputs.RequestOutput`).
* **bare**: ``--streams`` consumer tasks, each ``async for item in receive_channel`` on its own
  trio memory channel, and one producer that sends one item into every channel per step.

Both are paced the same way, like an engine whose steps are slower than its consumers: a
step is released only when every consumer has taken the previous one (a counter that the
consumers decrement; the same few instructions in both). So each chunk is one wakeup, never
a merge of several.

The figure is CPU time (``time.process_time``: user + system of this process) from the
release of the first step to the consumption of the last, divided by streams * steps, in
microseconds per chunk. Each variant runs ``--repeat`` times, alternating; the best run of
each is compared. Setup (spawning tasks, SUBMITs, encoding frames) is not timed.

Output: one line per run, a summary line per variant, and as the last line
``ratio: X.XX`` (manager / bare). The target is a ratio of at most 2.0.

Example::

    python bench/stream_overhead.py --streams 512 --steps 200
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import trio
import trio.testing

import server
from loadgen_lib import smoke
from server.worker_protocol import wire

# ------------------------------------------------------------------------------------------
# Pacing, shared by both variants
# ------------------------------------------------------------------------------------------


class Pacer:
    """Releases a step when every consumer has taken the previous one; times the run."""

    def __init__(self, streams: int, steps: int) -> None:
        self.streams = streams
        self.steps = steps
        self.step = 0  # steps released so far
        self.remaining = 0
        self.done = trio.Event()
        self.cpu_start = 0.0
        self.cpu_end = 0.0

    def release(self) -> None:
        if self.step == 0:
            self.cpu_start = time.process_time()
        self.step += 1
        self.remaining = self.streams
        self.done = trio.Event()

    def hit(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            if self.step == self.steps:
                self.cpu_end = time.process_time()
            self.done.set()

    @property
    def us_per_chunk(self) -> float:
        return (self.cpu_end - self.cpu_start) * 1e6 / (self.streams * self.steps)


# ------------------------------------------------------------------------------------------
# The manager path, over a fake worker process
# ------------------------------------------------------------------------------------------


class _Stdin(trio.abc.SendStream):
    """The worker's stdin: collects the SUBMITted rids. Closing it ends the fake worker (its
    stdout's EOF), as a real worker exits when its stdin closes."""

    def __init__(self, expected: int) -> None:
        self.decoder = wire.FrameDecoder()
        self.rids: list[int] = []
        self.expected = expected
        self.submitted = trio.Event()
        self.closed = trio.Event()

    async def send_all(self, data) -> None:
        await trio.lowlevel.checkpoint()
        for msg in self.decoder.feed(bytes(data)):
            if msg[0] == wire.SUBMIT:
                self.rids.append(msg[1])
                if len(self.rids) == self.expected:
                    self.submitted.set()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self.closed.set()
        await trio.lowlevel.checkpoint()


class _Stdout(trio.abc.ReceiveStream):
    """The worker's stdout: HELLO, the accepts, then one pre-encoded STEP frame per step."""

    def __init__(self, stdin: _Stdin, pacer: Pacer, text: str) -> None:
        self.stdin = stdin
        self.pacer = pacer
        self.text = text
        self.frames: list[bytes] = []
        self.sent_hello = False
        self.closed = stdin.closed  # the worker ends when either pipe closes

    async def receive_some(self, max_bytes=None) -> bytes:
        await trio.lowlevel.checkpoint()
        pacer = self.pacer
        if not self.sent_hello:
            self.sent_hello = True
            return wire.encode([wire.HELLO, {"engine": "bench", "model": "bench"}])
        if not self.frames and pacer.step == 0:
            await self.stdin.submitted.wait()
            rids = self.stdin.rids
            steps = pacer.steps
            for i in range(steps):
                finish = "length" if i == steps - 1 else None
                outputs = [[rid, self.text, 1, finish, None] for rid in rids]
                self.frames.append(wire.encode([wire.STEP, [], outputs]))
            self.frames.reverse()  # pop() from the end
            return wire.encode([wire.STEP, [[rid, 1] for rid in rids], []])
        if pacer.step > 0:
            await pacer.done.wait()  # every consumer took the previous step
        if not self.frames:
            await self.closed.wait()
            return b""
        pacer.release()
        return self.frames.pop()

    async def aclose(self) -> None:
        self.closed.set()
        await trio.lowlevel.checkpoint()


class _Process:
    """What the transport reads of a :class:`trio.Process`: pipes, ``wait``, ``returncode``."""

    pid = 0

    def __init__(self, stdin: _Stdin, stdout: _Stdout) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    async def wait(self) -> int:
        await self.stdout.closed.wait()
        self.returncode = 0
        return 0

    def terminate(self) -> None:
        self.stdout.closed.set()

    def kill(self) -> None:
        self.stdout.closed.set()


async def run_manager(streams: int, steps: int) -> float:
    pacer = Pacer(streams, steps)

    async def spawn(config):
        stdin = _Stdin(streams)
        return _Process(stdin, _Stdout(stdin, pacer, " tok"))

    config = server.EngineConfig(
        workers=1, heartbeat_interval=3600.0, heartbeat_timeout=7200.0, shutdown_grace=1.0
    )
    params = server.SamplingParams(max_tokens=steps)
    got = 0

    async def consume(stream) -> None:
        nonlocal got
        hit = pacer.hit
        async with stream:
            async for _ in stream:
                hit()
                got += 1

    async with server.open_engine(config, spawn=spawn) as engine:
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(consume, engine.generate("prompt", params))
    assert got == streams * steps, got
    return pacer.us_per_chunk


# ------------------------------------------------------------------------------------------
# The bare channel
# ------------------------------------------------------------------------------------------


async def run_bare(streams: int, steps: int) -> float:
    pacer = Pacer(streams, steps)
    channels = [trio.open_memory_channel(1) for _ in range(streams)]
    got = 0

    async def consume(receive) -> None:
        nonlocal got
        hit = pacer.hit
        async with receive:
            async for _ in receive:
                hit()
                got += 1

    async def produce() -> None:
        item = " tok"
        sends = [send for send, _ in channels]
        for _ in range(steps):
            pacer.release()
            for send in sends:
                send.send_nowait(item)
            await pacer.done.wait()
        for send in sends:
            await send.aclose()

    async with trio.open_nursery() as nursery:
        for _, receive in channels:
            nursery.start_soon(consume, receive)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(produce)
    assert got == streams * steps, got
    return pacer.us_per_chunk


# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=512, help="concurrent streams (512)")
    parser.add_argument("--steps", type=int, default=200, help="chunks per stream (200)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant (3)")
    args = smoke.parse_args(parser, argv, streams=8, steps=5, repeat=1)
    if args.streams < 1 or args.steps < 1 or args.repeat < 1:
        parser.error("--streams, --steps and --repeat must be positive")

    best = {"manager": math.inf, "bare": math.inf}
    runners = {"manager": run_manager, "bare": run_bare}
    for i in range(args.repeat):
        for name in ("manager", "bare"):
            us = trio.run(runners[name], args.streams, args.steps)
            best[name] = min(best[name], us)
            print(f"run {i + 1} {name:8} {us:7.2f} us/chunk", flush=True)
    chunks = args.streams * args.steps
    print(f"{args.streams} streams x {args.steps} steps = {chunks} chunks per run, best of "
          f"{args.repeat}:")
    print(f"manager: {best['manager']:.2f} us/chunk (CPU)")
    print(f"bare:    {best['bare']:.2f} us/chunk (CPU)")
    print(f"ratio: {best['manager'] / best['bare']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
