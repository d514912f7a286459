#!/usr/bin/env python3
"""The cost of a remote worker: the same load through a frontend whose worker is spawned
(pipes) and one whose worker listens on loopback TCP (``--worker-address``), plainly and
over TLS. Prints time to first token, tokens/s and CPU per delivered token of the frontend
and the worker for each, and the differences against pipes.

Each variant: start the worker (TCP: ``python -m server.workers --listen 127.0.0.1:PORT``)
and the server (``python -m server``), run ``bench/loadgen.py`` against it (``--pid`` the
frontend, and the worker), stop both. The sim engine; one event per step
(``--stream-interval-ms 0``) so that every token crosses the link in its own STEP frame.

Example::

    python bench/remote_worker.py --concurrency 128 --duration 20
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadgen_lib import smoke

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench secret, not a real one: 0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer 200 in {timeout} s")


def make_certificate(directory: Path) -> tuple[str, str]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=bench", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def run_variant(name: str, args, tmp: Path) -> dict:
    env = dict(os.environ, TRIO_LLM_WORKER_SECRET=SECRET)
    sim = ["--sim-itl-ms", str(args.itl_ms), "--sim-ttft-ms", "20"]
    procs = []
    pids = []
    try:
        server_args = ["--stream-interval-ms", "0", "--log-level", "warning",
                       "--disable-log-requests"]
        if name == "pipe":
            server_args += sim
        else:
            wport = free_port()
            worker = [sys.executable, "-m", "server.workers", "--listen", f"127.0.0.1:{wport}",
                      *sim]
            if name == "tls":
                cert, key = make_certificate(tmp)
                worker += ["--tls-cert", cert, "--tls-key", key]
                server_args += ["--worker-tls-ca", cert]
            log = open(tmp / f"{name}-worker.log", "wb")
            procs.append(subprocess.Popen(worker, cwd=ROOT, env=env, stderr=log))
            deadline = time.monotonic() + 60
            while b"listening on" not in (tmp / f"{name}-worker.log").read_bytes():
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise SystemExit(f"the {name} worker did not start")
                time.sleep(0.05)
            server_args += ["--worker-address", f"127.0.0.1:{wport}"]
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(port), *server_args],
            cwd=ROOT, env=env, stderr=open(tmp / f"{name}-server.log", "wb"),
        )
        procs.insert(0, server)
        wait_ok(f"http://127.0.0.1:{port}/ready")
        pids = ["--pid", str(server.pid)] + (
            [] if name == "pipe" else ["--pid", str(procs[1].pid)])
        out = tmp / f"{name}.json"
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "loadgen.py"), "--url",
             f"http://127.0.0.1:{port}", "--concurrency", str(args.concurrency),
             "--duration", str(args.duration), "--max-tokens", str(args.max_tokens),
             "--prompt-tokens", "128", "--itl-ms", str(args.itl_ms), "--quiet",
             "--json-out", str(out), *pids],
            check=True, stdout=subprocess.DEVNULL,
        )
        return json.loads(out.read_text())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--itl-ms", type=float, default=8.0)
    p.add_argument("--variants", default="pipe,tcp,tls")
    args = smoke.parse_args(p, concurrency=2, duration=0.5, max_tokens=8, variants="pipe,tls")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            label = name if name not in results else f"{name}#{len(results)}"
            results[label] = run_variant(name, args, Path(tmp))
    keys = ["ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "delivered_tokens_per_s",
            "frontend_cpu_us_per_token", "worker_cpu_us_per_token", "frontend_cpu_percent",
            "worker_cpu_percent", "loadgen_cpu_percent", "errors"]
    print(f"commit {commit}; {args.concurrency} streams, {args.max_tokens} tokens each, "
          f"sim itl {args.itl_ms} ms, one event per step; {os.cpu_count()} cores")
    print(f"{'':28}" + "".join(f"{n:>12}" for n in results))
    for key in keys:
        print(f"{key:28}" + "".join(f"{results[n].get(key)!s:>12}" for n in results))
    base = results.get("pipe")
    if base:
        for n in results:
            if n.startswith("pipe"):
                continue
            dt = results[n]["ttft_p50_ms"] - base["ttft_p50_ms"]
            cpu = results[n]["frontend_cpu_us_per_token"] - base["frontend_cpu_us_per_token"]
            print(f"{n} vs pipe: ttft p50 {dt:+.2f} ms, frontend cpu/token {cpu:+.2f} us "
                  f"({100 * cpu / base['frontend_cpu_us_per_token']:+.1f} %)")
    print(json.dumps({"commit": commit, **{n: {k: r.get(k) for k in keys}
                                           for n, r in results.items()}}))


if __name__ == "__main__":
    if not re.match(r"3\.(1[1-9])", sys.version.split()[0]):
        raise SystemExit("needs python >= 3.11")
    main()
