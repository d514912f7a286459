#!/usr/bin/env python3
"""An interactive request's time to first token beside a running batch (docs/batches.md):
batch lines run below every interactive request and only fill idle capacity.

What it measures
----------------
A server is spawned on the sim (``--spawn-args``, with a ``--state-dir`` of its own). Then
``--requests`` streamed chat completions, one after another, each timed from the request
to its first content chunk: first alone, then while a batch of ``--lines`` chat lines
(``--line-tokens`` tokens each) runs. The batch is cancelled at the end. Printed: TTFT p50
and p90 in ms alone and beside the batch, their ratio, and the batch lines the server
finished meanwhile (so that the batch did run).

Example::

    python bench/batch_ttft.py --lines 10000 --requests 200
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import openai  # noqa: E402
import trio  # noqa: E402

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.spawn import SpawnedServer  # noqa: E402
from bench.loadgen_lib.stats import percentile  # noqa: E402


def batch_file(lines: int, tokens: int) -> bytes:
    body = {"model": "sim", "messages": [{"role": "user", "content": "batch line"}],
            "max_tokens": tokens, "ignore_eos": True}
    return b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}).encode() + b"\n"
                    for i in range(lines))


async def ttfts(client: openai.AsyncOpenAI, requests: int) -> list[float]:
    """Milliseconds to the first content chunk of each of ``requests`` streams, in turn."""
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "interactive"}], max_tokens=4,
            stream=True)
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        times.append(((first or time.perf_counter()) - start) * 1000)
    return times


def line(name: str, times: list[float]) -> str:
    times = sorted(times)
    return (f"{name}: {len(times)} requests, TTFT p50 {percentile(times, 50):.2f} ms, "
            f"p90 {percentile(times, 90):.2f} ms")


async def run(args) -> int:
    with tempfile.TemporaryDirectory() as state:
        server = SpawnedServer(f"--state-dir {state} {args.spawn_args}", "server", None)
        try:
            await server.wait_healthy(120)
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                        max_retries=0, timeout=120)
            await ttfts(client, 3)  # (warm-up)
            alone = await ttfts(client, args.requests)
            file = await client.files.create(
                file=("lines.jsonl", io.BytesIO(batch_file(args.lines, args.line_tokens))),
                purpose="batch")
            batch = await client.batches.create(input_file_id=file.id,
                                                endpoint="/v1/chat/completions",
                                                completion_window="24h")
            with trio.fail_after(120):
                while (await client.batches.retrieve(batch.id)).request_counts.completed < 1:
                    await trio.sleep(0.05)
            started = (await client.batches.retrieve(batch.id)).request_counts.completed
            beside = await ttfts(client, args.requests)
            during = (await client.batches.retrieve(batch.id)).request_counts.completed
            await client.batches.cancel(batch.id)
            with trio.fail_after(120):
                while (await client.batches.retrieve(batch.id)).status != "cancelled":
                    await trio.sleep(0.05)
        finally:
            server.stop()
    print(line("alone", alone))
    print(line(f"beside a {args.lines}-line batch", beside))
    ratio = percentile(sorted(beside), 50) / percentile(sorted(alone), 50)
    print(f"p50 beside / alone: {ratio:.3f}; batch lines finished while measured: "
          f"{during - started}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=10_000, help="the batch's lines")
    p.add_argument("--line-tokens", type=int, default=32, help="tokens of each batch line")
    p.add_argument("--requests", type=int, default=200, help="interactive requests timed")
    p.add_argument("--spawn-args", default="--engine-workers 1",
                   help="the server's options (besides --state-dir)")
    args = smoke.parse_args(p, lines=40, requests=5)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
