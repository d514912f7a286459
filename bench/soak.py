#!/usr/bin/env python3
"""A bounded soak test of trio-llm-server under faults (loopback only).

It starts the server (``python -m server --engine-workers 2 --sim-faults ...``) on a free
port, then for ``--duration`` seconds runs ``--concurrency`` clients that each loop over a
random mix of:

* streaming requests read to the end (completions and chat, sometimes ``n`` > 1),
* non-streaming requests,
* clients that disconnect at a random point (mid-request, before or during the response),
* slow readers (a small receive buffer, a little read now and then),
* requests with an injected fault (``error``, ``stall``, ``ignore_abort``),
* malformed requests (answered 4xx),

while a killer task SIGKILLs one of the server's worker processes every ``--kill-every``
seconds (found in /proc as children of the server).

It prints, and writes as one JSON object on the last line of stdout:

* requests completed, by kind and outcome (a request whose worker was killed under it ends
  with a ``worker_died`` error, which is the specified outcome, not a failure);
* ``missing_done``: 200 streams read to their end by a client that did not leave early but
  that ended without ``data: [DONE]`` (must be 0);
* ``bad_status``: answers with a status that is wrong for what was sent (a 5xx other than
  the ``worker_died`` 500 and the 503s of a restart, or a malformed request not answered
  with a 4xx); must be 0;
* what is left in the server once the load has stopped: requests in flight in the manager
  and running or waiting in each worker, from ``GET /metrics`` (must all be 0);
* the server's RSS after the warm-up and at the end (growth must stay under 10 %);
* the server's exit status after SIGTERM (must be 0) and whether a worker process was left.

Exit status: 0 when every check passed, 1 otherwise, 2 on a setup error.

Example::

    python bench/soak.py --duration 150          # the default: 2.5 minutes
    python bench/soak.py --duration 60 --concurrency 12 --kill-every 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import tempfile
from pathlib import Path

import trio

from loadgen_lib import smoke

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


# -- the server process ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- a minimal HTTP/1.1 client on raw sockets ------------------------------------------------


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.complete = False  # the whole body arrived (Content-Length or the last chunk)


async def read_response(sock: trio.SocketStream, *, slow: tuple[int, float] | None = None) -> Response:
    """Read one response; ``slow=(bytes, pause)`` reads at most that much per pause.

    Returns what arrived, with ``complete`` False if the connection ended early.
    """
    resp = Response()
    buf = b""
    size, pause = slow if slow else (65536, 0.0)

    async def more() -> bool:
        nonlocal buf
        if pause:
            await trio.sleep(pause)
        try:
            chunk = await sock.receive_some(size)
        except trio.BrokenResourceError:
            return False
        buf += chunk
        return bool(chunk)

    while b"\r\n\r\n" not in buf:
        if not await more():
            return resp
    head, _, buf = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    resp.status = int(lines[0].split()[1])
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        resp.headers[name.strip().lower()] = value.strip()
    if b"content-length" in resp.headers:
        length = int(resp.headers[b"content-length"])
        while len(buf) < length:
            if not await more():
                resp.body = buf
                return resp
        resp.body = buf[:length]
        resp.complete = True
        return resp
    body = []
    while True:  # chunked
        while b"\r\n" not in buf:
            if not await more():
                resp.body = b"".join(body)
                return resp
        size_line, _, buf = buf.partition(b"\r\n")
        n = int(size_line.split(b";")[0], 16)
        while len(buf) < n + 2:
            if not await more():
                resp.body = b"".join(body) + buf
                return resp
        if n == 0:
            resp.body = b"".join(body)
            resp.complete = True
            return resp
        body.append(buf[:n])
        buf = buf[n + 2 :]


def request_bytes(path: str, body: bytes, port: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def connect(port: int, small_window: bool = False) -> trio.SocketStream:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if small_window:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((HOST, port))
    return trio.SocketStream(sock)


# -- the load --------------------------------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.missing_done = 0
        self.bad_status = 0
        self.examples: list[str] = []
        self.kills = 0

    def add(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def problem(self, what: str, detail: bytes | str) -> None:
        if len(self.examples) < 10:
            self.examples.append(f"{what}: {detail!r:.300}")


def _body(rng: random.Random, *, stream: bool, max_tokens: int) -> tuple[str, dict]:
    params: dict = {"max_tokens": max_tokens, "stream": stream}
    if rng.random() < 0.2:
        params["n"] = rng.randint(2, 3)
    if stream and rng.random() < 0.3:
        params["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        words = " ".join(rng.choice(("hello", "trio", "soak", "stream")) for _ in range(rng.randint(1, 40)))
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": words}], **params}
    return "/v1/completions", {"prompt": "soak " * rng.randint(1, 60), **params}


def _check_answer(stats: Stats, kind: str, resp: Response, *, stream: bool) -> None:
    """Classify a response that was read to its end by a client that did not leave."""
    if resp.status == 200:
        if stream:
            if not resp.complete or not resp.body.endswith(b"data: [DONE]\n\n"):
                stats.missing_done += 1
                stats.problem("stream without [DONE]", resp.body[-200:])
                return
            if b'"worker_died"' in resp.body:
                stats.add(f"{kind}:worker_died")
                return
            if b'"error"' in resp.body[-600:]:
                stats.add(f"{kind}:error_event")
                return
        elif not resp.complete:
            stats.bad_status += 1
            stats.problem("non-streaming body cut off", resp.body[-200:])
            return
        stats.add(f"{kind}:ok")
    elif resp.status == 500 and b"worker_died" in resp.body:
        stats.add(f"{kind}:worker_died")
    elif kind == "fault:error" and resp.status == 500 and b"injected engine failure" in resp.body:
        stats.add(f"{kind}:500")  # failed before its first token: a status, not a stream
    elif resp.status == 503:
        stats.add(f"{kind}:503")  # no worker up for a moment (both restarting)
    else:
        stats.bad_status += 1
        stats.problem(f"{kind} status {resp.status}", resp.body[:300])


async def one_request(rng: random.Random, port: int, stats: Stats) -> None:
    r = rng.random()
    if r < 0.35:
        kind, stream = "stream", True
    elif r < 0.55:
        kind, stream = "plain", False
    elif r < 0.70:
        kind, stream = "disconnect", rng.random() < 0.7
    elif r < 0.80:
        kind, stream = "slow", True
    elif r < 0.92:
        kind, stream = "fault", rng.random() < 0.7
    else:
        kind, stream = "malformed", False
    max_tokens = rng.randint(64, 384) if kind == "slow" else rng.randint(4, 200)
    path, body = _body(rng, stream=stream, max_tokens=max_tokens)
    fault = None
    if kind == "fault":
        fault = rng.choice(["error", "stall", "ignore_abort"])
        body["fault"] = {"kind": fault, "after": rng.randint(0, 8)}
    payload = json.dumps(body).encode()
    if kind == "malformed":
        payload = rng.choice([b"{", b'{"prompt": 5}', b'{"messages": []}', b"\xff\xfe", b"[]"])
    data = request_bytes(path, payload, port)
    sock = await connect(port, small_window=(kind == "slow"))
    try:
        if kind == "disconnect":
            when = rng.random()
            if when < 0.2:  # inside the request
                await sock.send_all(data[: rng.randint(1, len(data) - 1)])
                await trio.sleep(rng.random() * 0.05)
            else:  # while waiting for, or during, the response
                await sock.send_all(data)
                with trio.move_on_after(rng.random() * 0.5):
                    await read_response(sock)
            stats.add("disconnect:left")
            return
        await sock.send_all(data)
        if kind == "fault" and fault in ("stall", "ignore_abort"):
            with trio.move_on_after(rng.uniform(0.05, 1.0)) as scope:
                resp = await read_response(sock)
            if scope.cancelled_caught:
                stats.add(f"fault:{fault}:left")
                return
            _check_answer(stats, f"fault:{fault}", resp, stream=stream)
            return
        slow = (rng.choice([256, 512, 1024]), rng.uniform(0.01, 0.05)) if kind == "slow" else None
        with trio.move_on_after(120) as scope:
            resp = await read_response(sock, slow=slow)
        if scope.cancelled_caught:
            stats.bad_status += 1
            stats.problem(f"{kind}: no answer in 120 s", "")
            return
        if kind == "malformed":
            if 400 <= resp.status < 500 and resp.complete:
                stats.add("malformed:4xx")
            else:
                stats.bad_status += 1
                stats.problem(f"malformed answered {resp.status}", resp.body[:200])
            return
        _check_answer(stats, f"fault:{fault}" if fault else kind, resp, stream=stream)
    except (trio.BrokenResourceError, OSError) as exc:
        # the server closed the connection under us: only expected when we left early
        stats.bad_status += 1
        stats.problem(f"{kind}: connection error", str(exc))
    finally:
        await sock.aclose()


async def scrape_left(port: int) -> dict | None:
    """In flight in the manager, and running/waiting per worker, from /metrics."""
    try:
        sock = await connect(port)
    except OSError:
        return None
    try:
        await sock.send_all(f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
        with trio.fail_after(10):
            resp = await read_response(sock)
    finally:
        await sock.aclose()
    if resp.status != 200:
        return None
    left = {"in_flight": 0, "running": 0, "waiting": 0}
    for line in resp.body.decode().splitlines():
        for name, key in (
            ("trio_llm:num_requests_in_flight", "in_flight"),
            ("trio_llm:num_requests_running", "running"),
            ("trio_llm:num_requests_waiting", "waiting"),
        ):
            if line.startswith(name + "{") or line.startswith(name + " "):
                left[key] += int(float(line.rsplit(" ", 1)[1]))
    return left


async def soak(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    log = tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False)
    cmd = [
        sys.executable, "-m", "server", "--port", str(port), "--engine-workers", "2",
        "--sim-faults", "--sim-itl-ms", str(args.itl_ms), "--sim-ttft-ms", "10",
        "--max-restarts", "100000", "--shutdown-timeout", "10", "--drain-timeout", "1",
        "--log-level", "warning", *args.server_args,
    ]
    print(f"soak: starting {' '.join(cmd[1:])} (log: {log.name})", file=sys.stderr)
    proc = await trio.lowlevel.open_process(cmd, stdout=log, stderr=log, cwd=REPO)
    stats = Stats()
    seen_workers: set[int] = set()
    result: dict = {}
    try:
        with trio.fail_after(60):
            while True:
                if proc.poll() is not None:
                    print("soak: the server exited during startup", file=sys.stderr)
                    return 2
                kids = children(proc.pid)
                if len(kids) == 2 and (await scrape_left(port)) is not None:
                    break
                await trio.sleep(0.1)
        await trio.sleep(1.0)  # both workers said HELLO
        seen_workers.update(children(proc.pid))

        start = trio.current_time()
        end = start + args.duration
        warm_at = start + max(10.0, args.duration * 0.15)
        rss = {"start": None, "peak": 0}
        tty = sys.stderr.isatty()
        rng = random.Random(args.seed)

        async def client(k: int) -> None:
            my_rng = random.Random(rng.random())
            while trio.current_time() < end:
                await one_request(my_rng, port, stats)

        async def killer() -> None:
            while True:
                await trio.sleep(args.kill_every)
                if trio.current_time() >= end:
                    return
                kids = children(proc.pid)
                seen_workers.update(kids)
                if kids:
                    os.kill(rng.choice(kids), signal.SIGKILL)
                    stats.kills += 1

        async def progress() -> None:
            while True:
                await trio.sleep(1.0)
                now = trio.current_time()
                kb = rss_kib(proc.pid)
                rss["peak"] = max(rss["peak"], kb)
                if rss["start"] is None and now >= warm_at:
                    rss["start"] = kb
                seen_workers.update(children(proc.pid))
                done = sum(stats.counts.values())
                line = (
                    f"soak: {now - start:5.0f}/{args.duration:.0f} s  requests {done}  "
                    f"kills {stats.kills}  missing [DONE] {stats.missing_done}  "
                    f"bad {stats.bad_status}  rss {kb / 1024:.1f} MiB"
                )
                if tty:
                    print("\r" + line, end="", file=sys.stderr, flush=True)
                elif round(now - start) % 10 == 0:
                    print(line, file=sys.stderr, flush=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress)
            async with trio.open_nursery() as load:
                load.start_soon(killer)
                for k in range(args.concurrency):
                    load.start_soon(client, k)
            nursery.cancel_scope.cancel()
        if tty:
            print(file=sys.stderr)
        elapsed = trio.current_time() - start

        # Quiesce: requests that ignore aborts run to their end in the worker; the worker
        # counts in /metrics come from heartbeats (one a second).
        left = None
        with trio.move_on_after(20):
            while True:
                await trio.sleep(2.5)
                left = await scrape_left(port)
                if left is not None and not any(left.values()):
                    break
        rss_end = rss_kib(proc.pid)
        rss_start = rss["start"] or rss_end

        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(30):
            await proc.wait()
        exit_code = proc.returncode
        await trio.sleep(0.5)
        leftover = sorted(pid for pid in seen_workers if alive(pid))

        completed = sum(v for k, v in stats.counts.items())
        result = {
            "duration_s": round(elapsed, 1),
            "concurrency": args.concurrency,
            "requests": completed,
            "requests_per_s": round(completed / elapsed, 1),
            "by_outcome": dict(sorted(stats.counts.items())),
            "worker_kills": stats.kills,
            "missing_done": stats.missing_done,
            "bad_status": stats.bad_status,
            "left_in_server": left,
            "rss_start_mib": round(rss_start / 1024, 1),
            "rss_end_mib": round(rss_end / 1024, 1),
            "rss_peak_mib": round(rss["peak"] / 1024, 1),
            "rss_growth_pct": round(100.0 * (rss_end - rss_start) / rss_start, 1),
            "server_exit": exit_code,
            "workers_left": leftover,
            "problems": stats.examples,
        }
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    ok = (
        result["missing_done"] == 0
        and result["bad_status"] == 0
        and result["left_in_server"] is not None
        and not any(result["left_in_server"].values())
        and result["rss_growth_pct"] < 10.0
        and result["server_exit"] == 0
        and not result["workers_left"]
    )
    print(
        f"requests completed      {result['requests']} ({result['requests_per_s']}/s over "
        f"{result['duration_s']} s, {args.concurrency} clients)"
    )
    for key, value in result["by_outcome"].items():
        print(f"  {key:28} {value}")
    print(f"worker kills            {result['worker_kills']}")
    print(f"streams without [DONE]  {result['missing_done']}   (must be 0)")
    print(f"wrong statuses          {result['bad_status']}   (must be 0)")
    print(f"left in the server      {result['left_in_server']}   (must be all 0)")
    print(
        f"server RSS              {result['rss_start_mib']} MiB after warm-up -> "
        f"{result['rss_end_mib']} MiB at the end ({result['rss_growth_pct']:+.1f} %, peak "
        f"{result['rss_peak_mib']} MiB; must be < +10 %)"
    )
    print(
        f"server exit status      {result['server_exit']}, worker processes left: "
        f"{result['workers_left'] or 'none'}"
    )
    for p in result["problems"]:
        print(f"  problem: {p}")
    print("PASS" if ok else f"FAIL (server log: {log.name})")
    result["pass"] = ok
    print(json.dumps(result))
    if ok:
        os.unlink(log.name)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load (after startup)")
    p.add_argument("--concurrency", type=int, default=16, help="clients running at once")
    p.add_argument("--kill-every", type=float, default=12.0, help="seconds between worker kills")
    p.add_argument("--itl-ms", type=float, default=5.0, help="the sim engine's inter-token latency")
    p.add_argument("--port", type=int, default=0, help="port for the server (0: a free one)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random mix")
    p.add_argument("--server-arg", dest="server_args", action="append", default=[],
                   metavar="ARG", help="one more argument for the server (repeatable), "
                   "e.g. --server-arg=--keep-alive-timeout --server-arg=5")
    args = smoke.parse_args(p, argv, duration=3.0, concurrency=4, kill_every=1.5)
    return trio.run(soak, args)


if __name__ == "__main__":
    sys.exit(main())
