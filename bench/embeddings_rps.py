#!/usr/bin/env python3
"""Embeddings requests per second on the sim engine, for 1, 16 and 256 inputs per request.

What it measures
----------------
A real server (``python -m server --engine sim``, one worker, a process of its own) on a
loopback port, driven by ``--concurrency`` client tasks (httpx, in this process) that post
``/v1/embeddings`` back to back for ``--seconds`` per batch size. Each input is an 8-word
sentence of the sim's vocabulary (so the sim's token vectors are cached: this is the cost of
the path, HTTP + parse + one worker round trip + JSON of the vectors, not of making
vectors). Figures: requests/s and inputs/s per batch size, with ``encoding_format`` float
(``--base64`` for base64). The client shares the machine with the server: on a small one
it is part of what is measured.

Example::

    python bench/embeddings_rps.py --seconds 5 --concurrency 8
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import trio

from loadgen_lib import smoke

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "trio", "worker",
         "pipe", "frame", "batch", "step", "model", "token")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(url: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient() as http:
        with trio.fail_after(60):
            while True:
                if proc.poll() is not None:
                    raise SystemExit("the server exited")
                try:
                    if (await http.get(url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)


async def measure(url: str, inputs: int, seconds: float, concurrency: int, encoding: str):
    rng = random.Random(inputs)
    body = {"model": "sim", "encoding_format": encoding,
            "input": [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(inputs)]}
    done = 0
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        await http.post("/v1/embeddings", json=body)  # warm up (vector cache, connections)
        start = time.perf_counter()
        end = start + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                r = await http.post("/v1/embeddings", json=body)
                if r.status_code != 200:
                    raise SystemExit(f"HTTP {r.status_code}: {r.text[:200]}")
                done += 1

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(client)
        elapsed = time.perf_counter() - start
    return done / elapsed


async def drive(args: argparse.Namespace, url: str, proc: subprocess.Popen) -> None:
    encoding = "base64" if args.base64 else "float"
    await wait_ready(url, proc)
    print(f"sim engine, 384 dimensions, encoding_format {encoding}, "
          f"concurrency {args.concurrency}, {args.seconds:g} s per size")
    for size in (int(s) for s in args.sizes.split(",")):
        rps = await measure(url, size, args.seconds, args.concurrency, encoding)
        print(f"inputs/request {size:4d}: {rps:8.1f} requests/s  {rps * size:9.0f} inputs/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sizes", default="1,16,256")
    p.add_argument("--base64", action="store_true")
    args = smoke.parse_args(p, seconds=0.3, concurrency=2, sizes="1,16")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--engine", "sim", "--port", str(port),
         "--disable-log-requests", "--log-level", "warning"], env=dict(os.environ))
    try:
        trio.run(drive, args, f"http://127.0.0.1:{port}", proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
