"""Where the time to first token goes at one stream: the same request measured at three points.

1. ``worker``: a blocking client writes a SUBMIT straight to a sim worker's pipe and reads
   until the STEP frame with the first token (the engine and the pipes, no frontend).
2. ``manager``: ``Engine.generate`` in a Trio program, until the first output (plus the
   request manager: dispatch, router, wakeup).
3. ``http``: a raw-socket client against ``python -m server`` (plus hypercorn, the app, the
   SSE writer and the loopback socket both ways), until the first content event.

Each is printed as p50 / min / max over ``--n`` requests, with the sim's configured time to
first token (``ttft_ms + prefill_us_per_token * prompt tokens``) to subtract. Usage::

    python bench/ttft_path.py [--n 40] [--prompt-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import trio  # noqa: E402

import server  # noqa: E402
from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.spawn import SpawnedServer  # noqa: E402
from server.worker_protocol import wire  # noqa: E402

SIM = {"itl_ms": 8.0, "ttft_ms": 20.0, "prefill_us_per_token": 20.0}


def summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000.0 for v in values)
    return f"{name:8s} p50 {statistics.median(ms):7.2f} ms   min {ms[0]:7.2f}   max {ms[-1]:7.2f}"


def measure_worker(prompt: str, n: int) -> list[float]:
    config = server.EngineConfig(engine_options=SIM)
    cmd = [sys.executable, "-m", "server.workers", json.dumps(config.worker_argument())]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    decoder = wire.FrameDecoder()
    out_fd, in_fd = proc.stdout.fileno(), proc.stdin.fileno()
    decoder.feed(os.read(out_fd, 1 << 16))  # HELLO
    times = []
    try:
        for i in range(n):
            start = time.perf_counter()
            os.write(in_fd, wire.encode([wire.SUBMIT, i + 1, prompt, {"max_tokens": 1}]))
            first = None
            while first is None:
                for msg in decoder.feed(os.read(out_fd, 1 << 20)):
                    if msg[0] == wire.STEP and msg[2]:
                        first = time.perf_counter() - start
            times.append(first)
            time.sleep(0.01)
    finally:
        proc.stdin.close()
        proc.wait(10)
    return times


async def measure_manager(prompt: str, n: int) -> list[float]:
    times = []
    async with server.open_engine(server.EngineConfig(engine_options=SIM)) as engine:
        for _ in range(n):
            start = time.perf_counter()
            async with engine.generate(prompt, server.SamplingParams(max_tokens=1)) as stream:
                async for _ in stream:
                    times.append(time.perf_counter() - start)
                    break
            await trio.sleep(0.01)
    return times


def measure_http(prompt: str, n: int) -> list[float]:
    srv = SpawnedServer("--disable-log-requests", "server", None)
    try:
        trio.run(srv.wait_healthy, 60.0)
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                   b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        times = []
        for i in range(n + 1):  # the first one is a warmup: not counted
            start = time.perf_counter()
            sock.sendall(request)
            buf, first = b"", None
            while not buf.endswith(b"0\r\n\r\n"):
                data = sock.recv(1 << 16)
                if not data:
                    raise RuntimeError(f"the server closed the connection: {buf[:200]!r}")
                buf += data
                if first is None and b'"text":"' in buf:
                    first = time.perf_counter() - start
            if i:
                times.append(first)
            time.sleep(0.01)
        sock.close()
        return times
    finally:
        srv.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=40, help="requests per measure")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    args = smoke.parse_args(parser, n=3, prompt_tokens=8)
    prompt = " ".join(["w"] * args.prompt_tokens)
    configured = SIM["ttft_ms"] + SIM["prefill_us_per_token"] * args.prompt_tokens / 1000.0
    print(f"sim configured time to first token: {configured:.2f} ms")
    print(summary("worker", measure_worker(prompt, args.n)))
    print(summary("manager", trio.run(measure_manager, prompt, args.n)))
    print(summary("http", measure_http(prompt, args.n)))


if __name__ == "__main__":
    main()
