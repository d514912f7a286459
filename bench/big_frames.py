"""How long the frontend's event loop stalls while a big worker frame is decoded or a big
answer encoded (issue 23 item 3), in process: a Trio task sleeps 1 ms in a loop and the
largest gap between its wake-ups is printed, with the operation's own time, for

* a RESULT frame of 1.9M token ids (9 MB): ``FrameDecoder.feed`` on the loop (what the
  router did) against ``decode_frames`` (a thread, ``wire.decode_sliced``: what it does);
* a logprobs answer (16 choices x 900 tokens x 20 alternatives, 13 MB):
  ``dumps_document`` in a thread (one msgspec call holds the GIL) against ``dumps_sliced``.

Usage: ``python bench/big_frames.py [--rounds 2]``. Figures vary with the machine's load.
"""

from __future__ import annotations

import argparse
import time

import trio

from loadgen_lib import smoke
from server.manager.worker import decode_frames
from server.openai.encode import dumps_document, dumps_sliced
from server.worker_protocol import wire


async def _ticker(gaps: list) -> None:
    last = time.perf_counter()
    while True:
        await trio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _case(name: str, fn) -> None:
    gaps: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ticker, gaps)
        await trio.sleep(0.05)
        start = time.perf_counter()
        await fn()
        took = time.perf_counter() - start
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    print(f"{name:<52} took {took * 1e3:7.0f} ms, loop's largest gap {max(gaps) * 1e3:6.0f} ms")


async def _main(rounds: int) -> None:
    ids = list(range(1000, 1000 + 1_900_000))
    frame = wire.encode([wire.RESULT, 1, wire.pack_sliced(
        {"tokens": ids, "max_model_len": 2048}), None])
    alt = {"token": "u", "logprob": -2.0, "bytes": [117]}
    entry = {"token": "t", "logprob": -0.1, "bytes": [116], "top_logprobs": [alt] * 20}
    doc = {"choices": [{"index": i, "logprobs": {"content": [entry] * 900}}
                       for i in range(16)]}

    async def feed() -> None:
        wire.FrameDecoder().feed(frame)

    async def sliced() -> None:
        await decode_frames(wire.FrameDecoder(), frame)

    async def one_call() -> None:
        await trio.to_thread.run_sync(dumps_document, doc)

    async def in_pieces() -> None:
        await trio.to_thread.run_sync(dumps_sliced, doc)

    for _ in range(rounds):
        await _case("RESULT 1.9M ids: feed on the loop", feed)
        await _case("RESULT 1.9M ids: decode_frames (thread, sliced)", sliced)
        await _case("logprobs answer: dumps_document in a thread", one_call)
        await _case("logprobs answer: dumps_sliced in a thread", in_pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    trio.run(_main, smoke.parse_args(parser, rounds=1).rounds)


if __name__ == "__main__":
    main()
