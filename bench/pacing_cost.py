#!/usr/bin/env python3
"""CPU per token of paced and unpaced streams: events written by the router's sink, or by
each request's task (issue 25 item 7).

What it measures
----------------
``--streams`` requests of ``--tokens`` tokens on the in-memory sim engine
(:func:`server.testing.open_in_memory_engine`, 8 ms steps, one batch) under Trio's
``MockClock`` with autojump: every wait is skipped, so the run is pure CPU and the figure
does not depend on how busy the machine is. Each request's consumer writes every event it
takes (its text, encoded) with one ``os.write`` to ``/dev/null``, as the HTTP layer writes
to a socket; with ``sink`` it first gives its stream a sink that does the same from the
router (``RequestStream.set_sink``, as ``server.connections.sink`` does), and is woken only for
the first output and the end.

Variants (``--variants``): ``task-0`` (an event per step, every event a task wakeup),
``sink-0`` (the default's path), ``task-20`` (20 ms interval, every paced event a task
wakeup: the path before issue 25), ``sink-20`` (20 ms, the paced sink). Figures: process CPU
time per token (engine, router and consumers together: compare them with each other) and
events per stream. Each variant runs ``--repeat`` times, alternating; the best is printed.

    python bench/pacing_cost.py --streams 512 --tokens 256
"""

from __future__ import annotations

import argparse
import os
import time

import trio
import trio.testing

import server
from loadgen_lib import smoke
from server.testing import open_in_memory_engine, sim_engine_config


async def _run(streams: int, tokens: int, interval: float, sink: bool) -> tuple[float, float]:
    config = sim_engine_config(itl_ms=8.0, ttft_ms=20.0, prefill_us_per_token=0.0,
                               max_batch=streams, faults=False, stream_interval=interval)
    fd = os.open(os.devnull, os.O_WRONLY)
    events = 0

    def write(text: str) -> None:
        nonlocal events
        events += 1
        os.write(fd, text.encode())

    def sink_write(choice) -> bool:
        write(choice.text)
        choice.text, choice.ntok = "", 0
        return True

    async def one(i: int) -> None:
        params = server.SamplingParams(max_tokens=tokens)
        async with engine.generate(f"p{i}", params) as stream:
            first = True
            while outs := await stream.next_batch():
                for out in outs:
                    write(out.text)
                if first and sink:
                    stream.set_sink(sink_write)
                first = False

    try:
        async with open_in_memory_engine(config) as engine:
            start = time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, i)
            cpu = time.process_time() - start
    finally:
        os.close(fd)
    return cpu * 1e6 / (streams * tokens), events / streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", default="task-0,sink-0,task-20,sink-20")
    args = smoke.parse_args(parser, streams=8, tokens=8, repeat=1)
    variants = args.variants.split(",")
    best: dict[str, tuple[float, float]] = {}
    for r in range(args.repeat):
        for name in variants:
            kind, ms = name.split("-")
            result = trio.run(
                _run, args.streams, args.tokens, float(ms) / 1000, kind == "sink",
                clock=trio.testing.MockClock(autojump_threshold=0),
            )
            print(f"run {r + 1} {name:8s} {result[0]:6.2f} us/token  {result[1]:6.1f} events/stream",
                  flush=True)
            if name not in best or result[0] < best[name][0]:
                best[name] = result
    for name in variants:
        us, ev = best[name]
        print(f"best {name:8s} {us:6.2f} us/token  {ev:6.1f} events/stream")


if __name__ == "__main__":
    main()
