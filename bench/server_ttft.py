"""The server's own time to first token, from its JSON request log: p50 and p90 of
``first_token_ms`` (the app being called to the writer taking the first output) over the
successful requests, and the same minus the engine's configured TTFT.

Run the server with ``--log-format json`` (for example through ``bench/loadgen.py
--spawn-server "--log-format json" --server-log LOG``), then::

    python bench/server_ttft.py LOG [LOG ...] [--configured-ms 22.56]

The default configured TTFT is the sim's at its defaults with 128-token prompts:
20 ms + 128 x 20 us.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.stats import percentile  # noqa: E402


def first_token_times(path: str) -> list[float]:
    """``first_token_ms`` of every request log line with status 200 in ``path``."""
    times = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not a JSON line (startup messages of other loggers)
            if not isinstance(record, dict) or record.get("status") != 200:
                continue
            if record.get("first_token_ms") is not None:
                times.append(float(record["first_token_ms"]))
    return times


def smoke_log(directory: str) -> str:
    """A log of a few requests: ``bench/loadgen.py --smoke`` against a server spawned with
    ``--log-format json``."""
    path = os.path.join(directory, "server.log")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "loadgen.py"),
                    "--smoke", "--quiet", "--spawn-server", "--engine-workers 1 --log-format json",
                    "--server-log", path], check=True, stdout=subprocess.DEVNULL)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*", help="server logs written with --log-format json "
                        "(with --smoke: none, the log of a few requests made here)")
    parser.add_argument("--configured-ms", type=float, default=22.56,
                        help="the engine's configured time to first token (default: %(default)s)")
    args = smoke.parse_args(parser)
    if not args.logs and not args.smoke:
        parser.error("give at least one log")
    with tempfile.TemporaryDirectory() as tmp:
        return report(args.logs or [smoke_log(tmp)], args.configured_ms, args.smoke)


def report(logs: list[str], configured_ms: float, strict: bool) -> int:
    """Print each log's figures; 1 when ``strict`` and a log has no first token (the log's
    format no longer what this reads)."""
    for path in logs:
        times = sorted(first_token_times(path))
        if not times:
            print(f"{path}: no request with a first token")
            if strict:
                return 1
            continue
        p50, p90 = percentile(times, 50), percentile(times, 90)
        c = configured_ms
        print(f"{path}: {len(times)} requests, server TTFT p50 {p50:.2f} p90 {p90:.2f} ms; "
              f"minus {c:g} ms: p50 {p50 - c:.2f} p90 {p90 - c:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
