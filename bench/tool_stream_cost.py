#!/usr/bin/env python3
"""Frontend CPU per token of a streaming tool call, against plain text.

What it measures
----------------
A real server (``python -m server --engine sim --tool-call-parser hermes``, one event per
token: ``--stream-interval-ms 0``) and ``--streams`` concurrent streaming chat requests of
``--max-tokens`` tokens each, two ways, alternated ``--repeat`` times:

* **plain**: no tools: the sim's words, the plain SSE path;
* **tools**: with one tool: the sim answers with one Hermes ``<tool_call>`` of that many
  tokens, parsed incrementally into ``tool_calls`` deltas (the rich event path).

The figure is the frontend process's CPU time (user + system, from /proc; the sim workers
are not counted) over the run, divided by the tokens streamed, in microseconds; the best run
of each variant is compared. Also: the parser alone, in this process (``ToolCallParser.feed``
over the sim's tokens), in microseconds per token.

Example::

    python bench/tool_stream_cost.py --streams 64 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import threading
import sys
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.procstat import CLK_TCK, read_stat  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}


async def run(url: str, pid: int, streams: int, max_tokens: int, tools: bool) -> float:
    body: dict = {"model": "sim", "messages": [{"role": "user", "content": "find it"}],
                  "max_tokens": max_tokens, "stream": True, "temperature": 0}
    if tools:
        body["tools"] = [TOOL]
    seen = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        data = b""
        async with client.stream("POST", "/v1/chat/completions", json={**body, "seed": i}) as r:
            async for chunk in r.aiter_raw():
                data += chunk
        assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
        seen.append(data.count(b"tool_calls") if tools else 0)

    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        before = read_stat(pid)[1]
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, client, i)
        ticks = read_stat(pid)[1] - before
    assert not tools or all(seen), "no tool calls in the answers"
    return ticks / CLK_TCK / (streams * max_tokens) * 1e6


def parser_alone(max_tokens: int, rounds: int = 200) -> float:
    from server.openai.tool_parsers import ToolCallParser
    from server.engines.sim.engine import _tool_call

    pieces = _tool_call([TOOL], max_tokens, 1)
    start = time.perf_counter()
    for _ in range(rounds):
        p = ToolCallParser("hermes")
        for piece in pieces:
            p.feed(piece)
        p.finish()
    return (time.perf_counter() - start) / (rounds * len(pieces)) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    args = smoke.parse_args(p, argv, streams=2, max_tokens=16, repeat=1)
    cmd = [sys.executable, "-m", "server", "--engine", "sim", "--port", "0",
           "--tool-call-parser", "hermes", "--stream-interval-ms", "0", "--sim-itl-ms", "4",
           "--sim-ttft-ms", "1", "--sim-prefill-us-per-token", "0", "--shutdown-timeout", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url = ""
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"serving on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        # the server's log goes on to stderr: drain it, or the pipe fills and blocks it
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        for _ in range(200):
            if httpx.get(url + "/ready").status_code == 200:
                break
            time.sleep(0.05)
        results: dict[str, list[float]] = {"plain": [], "tools": []}
        trio.run(run, url, proc.pid, 8, 16, True)  # warm up both paths
        trio.run(run, url, proc.pid, 8, 16, False)
        for _ in range(args.repeat):
            for name in results:
                us = trio.run(run, url, proc.pid, args.streams, args.max_tokens, name == "tools")
                results[name].append(us)
                print(f"{name}: {us:.1f} us/token (frontend CPU)", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    alone = parser_alone(args.max_tokens)
    best = {name: min(v) for name, v in results.items()}
    print(f"parser alone: {alone:.2f} us/token")
    print(json.dumps({"streams": args.streams, "max_tokens": args.max_tokens,
                      "plain_us": round(best["plain"], 1), "tools_us": round(best["tools"], 1),
                      "parser_alone_us": round(alone, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
