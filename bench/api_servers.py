#!/usr/bin/env python3
"""Several frontends (``--api-servers N``) against one: the same load through a server with
N = 1 and N = 2 frontends (one sim worker), alternating, each run by ``bench/loadgen.py
--spawn-server``. Prints, per run: delivered and steady tokens/s, frontend CPU (every
frontend process of the supervisor: loadgen's procstat counts them as frontend) in % of a
core and per token, the worker's and the load generator's CPU, time to first token, and
the load average of the machine before the run (other jobs share it).

Example::

    python bench/api_servers.py --duration 12 --order 1,2,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loadgen_lib import smoke

ROOT = Path(__file__).resolve().parent.parent


def run(n: int, args) -> dict:
    server = (f"--engine-workers 1 --sim-max-batch {args.concurrency} "
              f"--max-concurrent-sequences {4 * args.concurrency} --disable-log-requests "
              f"--api-servers {n}")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "loadgen.py"), "-q", "--spawn-server", server,
             "--concurrency", str(args.concurrency), "--duration", str(args.duration),
             "--prompt-tokens", "128", "--max-tokens", str(args.max_tokens),
             "--json-out", out.name],
            check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(out.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1024)
    p.add_argument("--duration", type=float, default=12.0)
    p.add_argument("--order", default="1,2,1,2", help="the N of each run, in order")
    p.add_argument("--max-tokens", type=int, default=256)
    args = smoke.parse_args(p, concurrency=4, duration=0.5, order="2", max_tokens=16)
    rows = []
    for n in (int(x) for x in args.order.split(",")):
        load = os.getloadavg()[0]
        r = run(n, args)
        rows.append((n, load, r))
        print(f"N={n}: {r['delivered_tokens_per_s']:,.0f} tokens/s "
              f"(steady {r['steady_tokens_per_s']:,.0f}), frontend "
              f"{r['frontend_cpu_percent']} % ({r['frontend_cpu_us_per_token']} us/token), "
              f"worker {r['worker_cpu_percent']} %, loadgen {r['loadgen_cpu_percent']} %, "
              f"TTFT p50/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms, "
              f"errors {r['errors']}, load before {load:.2f}", flush=True)
    print()
    print("| N | load avg before | delivered tokens/s | steady tokens/s | frontend CPU % "
          "| frontend us/token | worker CPU % | loadgen CPU % | TTFT p50 / p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, load, r in rows:
        print(f"| {n} | {load:.2f} | {r['delivered_tokens_per_s']:,.0f} | "
              f"{r['steady_tokens_per_s']:,.0f} | {r['frontend_cpu_percent']} | "
              f"{r['frontend_cpu_us_per_token']} | {r['worker_cpu_percent']} | "
              f"{r['loadgen_cpu_percent']} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{r['errors']} |")


if __name__ == "__main__":
    main()
