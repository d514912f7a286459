"""How long the frontend's event loop stalls on the cases of issue 23 items 3 and 6.

Starts ``python -m server`` (sim engine) on port 0, keeps a probe that GETs ``/health``
every 10 ms on its own keep-alive connection, and for each case prints the longest
``/health`` answer seen while the case ran (the stall other streams see), and the case's
own time:

* ``ids``: a completions body of 1.9M token ids (3.8 MB), past ``max_model_len``;
* ``keys``: a completions body with 350k keys nobody defines (3.5 MB);
* ``burst``: 2,000 connections opened at once, each sending ``GET /v1/models``; the
  ``/health`` figure here is a probe on a *new* connection opened 0.3 s into the burst
  (what kubelet does, with a 1 s timeout), from this process (the burst runs in another);
* ``idle``: the same with connections that send nothing (held open until the probe is
  answered).

With ``--health-port``, the server also serves its probe port (``--health-port 0``) and
the burst cases probe it too, at the same moment as the API port.

Usage: ``python bench/loop_stalls.py [--cases ids,keys,burst] [--connections 2000]``.
Figures vary with the machine's load; compare runs on the same machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import trio

from loadgen_lib import smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def body_of(case: str) -> bytes:
    if case == "ids":
        return json.dumps({"prompt": [1] * 1_900_000, "max_tokens": 4},
                          separators=(",", ":")).encode()
    return json.dumps({"prompt": "x", "max_tokens": 1, **{f"{i:x}": 1 for i in range(350_000)}},
                      separators=(",", ":")).encode()


def post(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body))


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def read_response(stream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    return head


async def exchange(port: int, data: bytes) -> float:
    start = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        while await stream.receive_some(65536):
            pass
    return time.perf_counter() - start


async def probe(port: int, worst: list, stop: trio.Event) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        while not stop.is_set():
            start = time.perf_counter()
            await stream.send_all(HEALTH)
            await read_response(stream)
            worst[0] = max(worst[0], time.perf_counter() - start)
            await trio.sleep(0.01)


async def big_body(port: int, case: str) -> None:
    data = post(body_of(case))
    worst = [0.0]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe, port, worst, stop)
        await trio.sleep(0.3)
        took = await exchange(port, data)
        await trio.sleep(0.1)
        stop.set()
    print(f"{case:6} {len(data) / 1e6:5.1f} MB  request {took * 1000:7.1f} ms  "
          f"worst /health {worst[0] * 1000:7.1f} ms")


def burst_client(port: int, connections: int, idle: bool) -> None:
    """The burst itself, in its own process (the probe must not wait for its loop), with
    plain non-blocking sockets: every connect at once, as fast as the kernel takes them;
    then (unless ``idle``) a request on each; held open 5 s."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    start = time.perf_counter()
    socks = []
    for _ in range(connections):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    took = (time.perf_counter() - start) * 1000
    if not idle:
        time.sleep(0.05)
        for sock in socks:
            try:
                sock.send(request)
            except OSError:
                pass
    time.sleep(5)
    for sock in socks:
        sock.close()
    print(f"{'idle' if idle else 'burst':6} {connections} connects in {took:7.1f} ms", end="")


def listen_overflows() -> int:
    """The kernel's count of connects dropped for a full accept queue (the client then
    retries after 1 s, then 3 s: a probe's "3-4 s")."""
    with open("/proc/net/netstat") as f:
        lines = f.read().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split(), values.split()))["ListenOverflows"])
    return 0


async def burst(port: int, connections: int, idle: bool, probe_port: int | None) -> None:
    cmd = [sys.executable, __file__, "--burst-to", str(port), "--connections", str(connections)]
    before = listen_overflows()
    took: dict[int, float] = {}

    async def health(at: int) -> None:
        took[at] = await exchange(at, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(trio.run_process, cmd + ["--idle"] * idle))
        await trio.sleep(0.3)  # the burst is under way
        async with trio.open_nursery() as probes:
            for at in (port, probe_port):
                if at is not None:
                    probes.start_soon(health, at)
    on_probe_port = (f"  probe port: {took[probe_port] * 1000:7.1f} ms"
                     if probe_port is not None else "")
    print(f"  /health on a new connection 0.3 s into it: {took[port] * 1000:7.1f} ms"
          f"{on_probe_port}  connects dropped (accept queue full): "
          f"{listen_overflows() - before}")


async def main(args) -> None:
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # (a pipe unread would block it)
    proc = subprocess.Popen(  # noqa: ASYNC220 (once, before anything is measured)
        [sys.executable, "-m", "server", "--port", "0", "--sim-itl-ms", "2",
         "--max-model-len", "4096", "--backlog", str(args.backlog),
         *(["--health-port", "0"] if args.health_port else [])],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )
    try:
        port = None
        with trio.fail_after(60):
            while port is None:
                await trio.sleep(0.1)
                text = open(log.name).read()  # noqa: ASYNC230 (a small local file)
                assert proc.poll() is None, text
                found = re.search(r"serving on http://[\d.]+:(\d+)", text)
                port = int(found.group(1)) if found else None
        probes = re.search(r"probes \(/health, /ready\) on http://[\d.]+:(\d+)", text)
        probe_port = int(probes.group(1)) if probes else None
        for case in args.cases.split(","):
            if case in ("burst", "idle"):
                await burst(port, args.connections, case == "idle", probe_port)
            else:
                await big_body(port, case)
    finally:
        proc.kill()  # (its graceful shutdown is not what is measured)
        proc.wait(10)
        log.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="ids,keys,burst,idle")
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--backlog", type=int, default=2048, help="the server's --backlog")
    parser.add_argument("--health-port", action="store_true",
                        help="serve and probe the server's probe port too")
    parser.add_argument("--burst-to", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    options = smoke.parse_args(parser, connections=20, health_port=True)
    if options.burst_to:
        burst_client(options.burst_to, options.connections, options.idle)
    else:
        trio.run(main, options)
