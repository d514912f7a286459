"""Migration under load: 128 streams over 4 sim workers, one worker SIGKILLed mid-stream
(docs/routing.md, "Migration"). Prints the figures; nothing is asserted.

Two rounds on one server (``--workers`` sim workers, greedy streams, each with its own
prompt of ``--prompt-words`` words): the first runs every stream uninterrupted (the
reference text, and the client's TTFT: what one prefill costs as a client sees it); the
second runs them again and SIGKILLs one worker process once every stream has passed
``--kill-after`` of its tokens. Figures of the second round: streams that ended with
``[DONE]`` and no error event; error events; streams whose text differs from the first
round's; usage that does not count each token once; and the *added delay* of the migrated
streams: how much longer each took from its first token to its last than in the first
round. The migrated streams are the ones with the largest added delays,
as many as ``trio_llm:migrations_total`` counts. "One prefill" is the
sim's time to first token of the resumed prompt (``--sim-ttft-ms`` plus
``--sim-prefill-us-per-token`` per prompt and generated token), and the client's TTFT p50
of the first round.

    python bench/migration.py                      # 128 streams x 4 workers, ~2.5 min

With ``--engine vllm --model-path DIR`` the workers are vllm-engine workers (vLLM's CPU
build here: the tests' tiny model, e.g. 16 streams over 2 workers); the streams ask for
``ignore_eos`` (a random model may end early), and "one prefill" is only the client's TTFT
of the uninterrupted round (the resumed prompt is longer by the tokens generated).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import time

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.spawn import SpawnedServer  # noqa: E402
from bench.loadgen_lib.stats import percentile  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


class Stream:
    """What one streamed completion delivered: (arrival time, text) of each content chunk."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.chunks: list[tuple[float, str]] = []
        self.errors = 0
        self.done = False
        self.usage: dict | None = None

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


async def one_stream(s: Stream, client: httpx.AsyncClient, url: str, prompt: str,
                     args) -> None:
    body = {"model": args.model, "prompt": prompt, "ignore_eos": args.engine != "sim",
            "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    s.sent = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                s.done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                s.errors += 1
                continue
            if chunk.get("usage"):
                s.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    s.chunks.append((time.perf_counter(), choice["text"]))


def worker_pids(server_pid: int) -> list[int]:
    """The server's engine worker processes (its children running server.workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"server.workers" in cmd:
            pids.append(int(entry))
    return sorted(pids)


async def run_round(client, url: str, prompts: list[str], args, kill=None) -> list[Stream]:
    """One stream per prompt, all at once; ``kill(streams)`` runs beside them."""
    streams = [Stream() for _ in prompts]
    async with trio.open_nursery() as nursery:
        for s, prompt in zip(streams, prompts):
            nursery.start_soon(one_stream, s, client, url, prompt, args)
        if kill is not None:
            await kill(streams)
    return streams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--kill-after", type=int, default=5, help="tokens every stream has")
    p.add_argument("--itl-ms", type=float, default=400.0)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--prefill-us", type=float, default=2000.0, help="per prompt token")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--model-path", help="the vllm engine's model directory")
    args = smoke.parse_args(p, streams=4, workers=2, prompt_words=10, max_tokens=10,
                            kill_after=2, itl_ms=50.0, prefill_us=100.0)
    if args.smoke and args.engine == "sim":
        smoke.skipped("the vllm engine (--smoke --engine vllm --model-path DIR runs it)")
    args.model = "sim" if args.engine == "sim" else os.path.basename(
        os.path.normpath(args.model_path or ""))
    if args.engine == "vllm" and not args.model_path:
        p.error("--engine vllm needs --model-path")
    rng = random.Random(args.seed)
    prompts = [f"stream {k}: " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
               for k in range(args.streams)]

    async def run_all() -> None:
        if args.engine == "sim":
            engine = (f"--sim-itl-ms {args.itl_ms} --sim-ttft-ms {args.ttft_ms} "
                      f"--sim-prefill-us-per-token {args.prefill_us}")
        else:
            engine = (f"--engine vllm --model-path {args.model_path} --max-model-len 1024 "
                      "--dtype float32 --engine-arg kv_cache_memory_bytes=67108864")
        server = SpawnedServer(
            f"--engine-workers {args.workers} {engine} "
            "--routing round-robin --disable-log-requests --log-level warning", "server", None)
        killed_at = 0.0
        try:
            await server.wait_healthy(60 if args.engine == "sim" else 1500)
            limits = httpx.Limits(max_connections=args.streams + 4)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                reference = await run_round(client, server.url, prompts, args)

                async def kill(streams: list[Stream]) -> None:
                    nonlocal killed_at
                    # once every stream has its first --kill-after tokens: SIGKILL a worker
                    while min(len(s.chunks) for s in streams) < args.kill_after:
                        await trio.sleep(0.005)
                    pid = worker_pids(server.proc.pid)[0]
                    killed_at = time.perf_counter()
                    os.kill(pid, signal.SIGKILL)

                migrated_round = await run_round(client, server.url, prompts, args, kill)
                metrics = (await client.get(server.url + "/metrics")).text
        finally:
            server.stop()
        report(args, reference, migrated_round, killed_at, metrics)

    trio.run(run_all)


def span(s: Stream) -> float:
    """From the stream's first token to its last."""
    return s.chunks[-1][0] - s.chunks[0][0] if s.chunks else 0.0


def report(args, reference: list[Stream], run: list[Stream], killed_at: float,
           metrics: str) -> None:
    ok = sum(1 for s in run if s.done and not s.errors)
    errors = sum(s.errors for s in run)
    mismatches = sum(1 for a, b in zip(reference, run) if a.text != b.text)
    usage_wrong = sum(1 for a, b in zip(reference, run)
                      if not b.usage or not a.usage
                      or b.usage["completion_tokens"] != a.usage["completion_tokens"]
                      or b.usage["prompt_tokens"] != a.usage["prompt_tokens"])
    moved = sum(int(float(m.group(1))) for m in re.finditer(
        r'^trio_llm:migrations_total\{[^}]*\} (\S+)$', metrics, re.M))
    # how much longer each stream took from its first token to its last than uninterrupted
    added_all = sorted(((span(b) - span(a), sum(1 for c, _ in b.chunks if c <= killed_at))
                        for a, b in zip(reference, run) if a.chunks and b.chunks),
                       key=lambda a: a[0])
    went = added_all[len(added_all) - moved:]
    stayed = sorted(a for a, _ in added_all[:len(added_all) - moved])
    added = sorted(a for a, _ in went)
    prefill = sorted(args.ttft_ms + args.prefill_us / 1000 * (args.prompt_words + 2 + n)
                     for _, n in went)
    ttft = sorted(s.chunks[0][0] - s.sent for s in reference if s.chunks)
    what = (f"sim workers (ITL {args.itl_ms} ms, TTFT {args.ttft_ms} ms + {args.prefill_us} us "
            "per prompt token" if args.engine == "sim" else f"vllm workers ({args.model}")
    print(f"{args.streams} greedy streams x {args.max_tokens} tokens over {args.workers} "
          f"{what}, prompts of {args.prompt_words} words); one worker SIGKILLed "
          f"after {args.kill_after}+ tokens of every stream")
    print(f"streams ended with [DONE] and no error event: {ok}/{len(run)}")
    print(f"error events: {errors}")
    print(f"text mismatches vs the uninterrupted run: {mismatches}")
    print(f"usage differing from the uninterrupted run: {usage_wrong}")
    print(f"streams migrated (trio_llm:migrations_total): {moved}")
    if added:
        print(f"added delay of the migrated streams: p50 {1000 * percentile(added, 50):.0f} ms, "
              f"p99 {1000 * percentile(added, 99):.0f} ms (first to last token, less the "
              f"uninterrupted run's; the other streams': p50 "
              f"{1000 * percentile(stayed, 50):.0f} ms, p99 {1000 * percentile(stayed, 99):.0f} ms)")
        if args.engine == "sim":
            print(f"one prefill of the resumed prompt (sim): p50 "
                  f"{percentile(prefill, 50):.0f} ms")
        print(f"client TTFT of the uninterrupted round: p50 {1000 * percentile(ttft, 50):.0f} ms,"
              f" p99 {1000 * percentile(ttft, 99):.0f} ms")


if __name__ == "__main__":
    main()
