"""Do a worker's other streams wait while the frontend decodes a big /tokenize answer?
(issue 23; the ~3 s gap in every stream at the end of the isolation bench's tokenize phase)

In process, with the testing kit's in-memory sim worker (server.testing): ``--streams``
streams run on one worker (the sim's 10 ms a token), then one CALL round trip is
answered by that worker with ``--ids`` token ids (packed beforehand, as the worker's helper
process packs them: only the frontend's side is measured). Printed per round: the round
trip's seconds, the largest gap between consecutive outputs of one stream during it (and
the median over the streams of each stream's largest), against the same figures over a
baseline window of the same length; and the event loop's own largest gap (a task sleeping
1 ms).

Compare the router before and after it decoded big RESULT frames aside: run this file
with ``PYTHONPATH`` at a checkout of each (the script imports ``server`` from there).

``--form list`` sends the ids as a msgpack array, as a worker did before packed ids
(``wire.PACKED_IDS``), and as an older worker still does.

Usage: ``python bench/router_big_frames.py [--streams 16] [--ids 3500000] [--rounds 2]
[--form packed|list]``.
Figures vary with the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

import server
from loadgen_lib import smoke
from server.testing import open_in_memory_engine, open_in_memory_spawner
from server.worker_protocol import wire

_perf = time.perf_counter


async def _stream(engine, arrivals: list) -> None:
    params = server.SamplingParams(max_tokens=1_000_000, ignore_eos=True)
    async for _ in engine.generate("a b", params):
        arrivals.append(_perf())


async def _ticker(ticks: list) -> None:
    while True:
        await trio.sleep(0.001)
        ticks.append(_perf())


def _gaps(points: list, a: float, b: float) -> list[float]:
    """Gaps between consecutive points that overlap [a, b]."""
    return [t - p for p, t in zip(points, points[1:]) if t > a and p < b]


def _summary(streams: list[list], ticks: list, a: float, b: float) -> str:
    per = [max(_gaps(s, a, b), default=0.0) for s in streams]
    loop = max(_gaps(ticks, a, b), default=0.0)
    return (f"streams' largest gap {max(per) * 1000:7.1f} ms, median of each stream's "
            f"largest {statistics.median(per) * 1000:7.1f} ms; loop's largest "
            f"{loop * 1000:6.1f} ms")


async def main(args) -> None:
    ids = [(i * 7919) % 30000 for i in range(args.ids)]
    tokens = wire.pack_ids(ids) if args.form == "packed" else ids
    packed = wire.pack_sliced({"count": len(ids), "max_model_len": 4096, "tokens": tokens,
                               "token_strs": None})
    del ids, tokens
    async with open_in_memory_spawner() as spawner:
        async with open_in_memory_engine(spawner=spawner, itl_ms=10.0, ttft_ms=20.0,
                                         max_batch=args.streams + 8,
                                         max_model_len=10_000_000) as engine:
            spawner.processes[0].engine.tokenize = lambda request: packed
            streams: list[list] = [[] for _ in range(args.streams)]
            ticks: list = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_ticker, ticks)
                for arrivals in streams:
                    nursery.start_soon(_stream, engine, arrivals)
                await trio.sleep(1.0)
                for rnd in range(args.rounds):
                    a = _perf()
                    result = await engine.tokenize({"op": "tokenize", "prompt": "x"})
                    b = _perf()
                    assert result["count"] == args.ids
                    # (dropped as the HTTP layer drops it: emptied a slice per call in a
                    # thread; a plain del would free 3.5M ids here in one 0.1 s call)
                    await trio.to_thread.run_sync(wire.release_sliced, result)
                    del result
                    await trio.sleep(0.3)
                    c = _perf()
                    await trio.sleep(b - a + 0.3)
                    d = _perf()
                    print(f"round {rnd + 1}: CALL of {args.ids:,} ids "
                          f"({len(packed.data) / 1e6:.1f} MB) in {b - a:.2f} s")
                    print(f"  during:   {_summary(streams, ticks, a, c)}")
                    print(f"  baseline: {_summary(streams, ticks, c, d)}", flush=True)
                nursery.cancel_scope.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--ids", type=int, default=3_500_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--form", choices=("packed", "list"), default="packed",
                   help="the ids as a worker that reads packed ids sends them (wire.PACKED_IDS, "
                   "the default), or as a msgpack array (an older worker)")
    trio.run(main, smoke.parse_args(p, streams=2, ids=100_000, rounds=1))
