#!/usr/bin/env python3
"""How long does a big frame take to cross a worker's stdout pipe? (issue 23, the end gap)

A child process (the worker's side: a blocking loop) writes one frame of ``--mb`` MB to its
stdout with one blocking write, then small frames every ``--tick-ms`` ms (its STEPs); the
parent reads the pipe as the frontend's router does (a Trio process pipe,
``receive_some(1 MiB)``) and prints, per pipe size: how many times the child slept in its
write of the big frame (voluntary context switches: the hand-offs), how long that write was
blocked (its step loop stood still that long) and the largest gap between the
small frames the parent received around it (what every stream on that worker sees).

A pipe holds 64 KiB by default, so a 14 MB frame (3.5M packed token ids) crosses in ~213
hand-offs between the two processes, each a wake-up of a process that may wait its turn
for a core; ``--pipe-kib`` sets the pipe's size (``F_SETPIPE_SZ``), 0 for the system's
default, to see whether fewer hand-offs shorten the write (measured: not at load 6, see
docs/changelog.md, 2026-12-02, so the worker keeps the default)::

    nice -n 10 python bench/pipe_handoff.py --mb 14 --pipe-kib 0,1024 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import resource
import struct
import subprocess
import sys
import time

import trio

from loadgen_lib import smoke

_HEAD = struct.Struct("<Id")  # length of the rest, the child's clock when written


def child(mb: float, pipe_kib: int, tick_ms: float, ticks: int) -> None:
    fd = sys.stdout.fileno()
    if pipe_kib:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, pipe_kib * 1024)

    def write_all(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def tick() -> None:
        write_all(_HEAD.pack(0, time.monotonic()))

    for _ in range(ticks):
        tick()
        time.sleep(tick_ms / 1000)
    big = bytes(int(mb * 1e6))
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    t0 = time.monotonic()
    write_all(_HEAD.pack(len(big), t0) + big)
    blocked = time.monotonic() - t0
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - switches
    for _ in range(ticks):
        tick()
        time.sleep(tick_ms / 1000)
    sys.stderr.write(f"{switches} {blocked}\n")


async def parent(args, pipe_kib: int) -> tuple[int, float, float]:
    cmd = [sys.executable, __file__, "--child", "--mb", str(args.mb), "--pipe-kib",
           str(pipe_kib), "--tick-ms", str(args.tick_ms), "--ticks", str(args.ticks)]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    buf = bytearray()
    arrivals: list[float] = []
    assert proc.stdout is not None and proc.stderr is not None
    while True:
        data = await proc.stdout.receive_some(1 << 20)
        if not data:
            break
        buf += data
        while len(buf) >= _HEAD.size:
            length, _ = _HEAD.unpack_from(buf)
            if len(buf) < _HEAD.size + length:
                break
            del buf[:_HEAD.size + length]
            arrivals.append(time.monotonic())
    err = b""
    while chunk := await proc.stderr.receive_some(1 << 16):
        err += chunk
    await proc.wait()
    switches, blocked = err.decode().split()[-2:]
    gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    return int(switches), float(blocked), gap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=14.0, help="the big frame, MB")
    p.add_argument("--pipe-kib", default="0,1024",
                   help="pipe sizes to compare, KiB, comma-separated (0: the default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tick-ms", type=float, default=10.0)
    p.add_argument("--ticks", type=int, default=20)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = smoke.parse_args(p, mb=1.0, rounds=1, ticks=3)
    if args.child:
        child(args.mb, int(args.pipe_kib), args.tick_ms, args.ticks)
        return
    sizes = [int(s) for s in args.pipe_kib.split(",")]
    print(f"{args.mb} MB frame; load average {os.getloadavg()[0]:.1f}")
    print("pipe KiB | writer's sleeps in the write | write blocked (ms) | "
          "largest gap between small frames (ms)")
    for _ in range(args.rounds):
        for size in sizes:
            switches, blocked, gap = trio.run(parent, args, size)
            print(f"{size or 'default':>8} | {switches:6d} | {blocked * 1000:8.1f} | "
                  f"{gap * 1000:8.1f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
