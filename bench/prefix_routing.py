"""Prefix-aware routing against least-loaded and round-robin, on sim workers with a prefix
cache (docs/routing.md). Prints the figures; nothing is asserted.

The workload: ``--conversations`` chats of ``--turns`` turns each, all opening with the same
long system prompt; each turn resends the whole conversation (system prompt, every earlier
question and answer, the new question), as a chat client does. Conversations start spread
over ``--ramp`` seconds and a user "thinks" between an answer and the next question
(exponential, mean ``--think`` seconds). Each policy runs the same workload (same seed) on a
fresh server with ``--workers`` sim workers, each with a prefix cache of
``--cache-tokens``; a baseline runs it on one worker holding all the cache
(``workers x cache-tokens``). The sim's prefill is ``--prefill-us`` per uncached prompt
token, so time to first token shows what the cache saved.

Figures: prefix reuse (cached prompt tokens / prompt tokens, from each response's usage);
TTFT p50/p99 twice: the engine's (what the sim spends before the first token: its TTFT
plus prefill of the uncached tokens, from usage; immune to a busy machine) and the
client's (request sent to first content token: includes every process's CPU contention);
and the requests and prefill tokens (uncached) each worker served, as a ratio of the
largest to the mean.

    python bench/prefix_routing.py                     # 64 x 8 over 4 workers, ~2 min
    python bench/prefix_routing.py --conversations 16 --turns 4 --think 0.5   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(client: httpx.AsyncClient, url: str, args, system: str, k: int,
                       results: list) -> None:
    rng = random.Random(args.seed * 1000 + k)
    await trio.sleep(rng.uniform(0, args.ramp))
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"conversation {k} turn {turn}: "
                         + words(rng, args.question_words)})
        body = {"model": "sim", "messages": messages, "max_tokens": args.answer_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first = None
        answer = []
        usage = None
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    text = choice.get("delta", {}).get("content")
                    if text:
                        if first is None:
                            first = time.perf_counter() - sent
                        answer.append(text)
        assert usage is not None and first is not None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        results.append((first, usage["prompt_tokens"], cached))
        messages.append({"role": "assistant", "content": "".join(answer).strip()})
        await trio.sleep(rng.expovariate(1.0 / args.think) if args.think else 0)


def metric_values(text: str, name: str) -> list[float]:
    """Per-worker values of ``trio_llm:<name>_total``, by worker index."""
    found = {}
    for m in re.finditer(r"^trio_llm:%s_total\{[^}]*worker=\"(\d+)\"[^}]*\} (\S+)$" % name,
                         text, re.M):
        found[int(m.group(1))] = float(m.group(2))
    return [found[i] for i in sorted(found)]


async def run_policy(args, routing: str, workers: int, cache_tokens: int) -> dict:
    server = SpawnedServer(
        f"--engine-workers {workers} --routing {routing} --routing-balance {args.balance} "
        f"--sim-prefix-cache-tokens {cache_tokens} --sim-prefill-us-per-token {args.prefill_us} "
        f"--sim-itl-ms {args.itl_ms} --sim-ttft-ms 5 --disable-log-requests "
        "--log-level warning", "server", None)
    try:
        await server.wait_healthy(60)
        rng = random.Random(args.seed)
        system = "You are a helpful assistant. " + words(rng, args.system_words)
        results: list = []
        limits = httpx.Limits(max_connections=args.conversations + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async with trio.open_nursery() as nursery:
                for k in range(args.conversations):
                    nursery.start_soon(conversation, client, server.url, args, system, k,
                                       results)
            metrics = (await client.get(server.url + "/metrics")).text
    finally:
        server.stop()
    ttfts = sorted(r[0] for r in results)
    engine = sorted((5.0 + args.prefill_us / 1000 * (r[1] - r[2])) / 1000 for r in results)
    prompt = sum(r[1] for r in results)
    cached = sum(r[2] for r in results)
    routed = metric_values(metrics, "routed_requests")
    queries = metric_values(metrics, "prefix_cache_queries")
    hits = metric_values(metrics, "prefix_cache_hits")
    prefill = [q - h for q, h in zip(queries, hits)]
    decisions = {m.group(1): int(float(m.group(2))) for m in re.finditer(
        r'^trio_llm:routing_decisions_total\{[^}]*reason="(\w+)"\} (\S+)$', metrics, re.M)}
    return {
        "routing": routing, "workers": workers, "requests": len(results),
        "reuse": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "engine_ttft_p50_ms": 1000 * percentile(engine, 50),
        "engine_ttft_p99_ms": 1000 * percentile(engine, 99),
        "routed": routed, "prefill_tokens": prefill, "decisions": decisions,
    }


def imbalance(values: list[float]) -> float:
    """Largest over mean (1.0: perfectly even)."""
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--system-words", type=int, default=1000)
    p.add_argument("--question-words", type=int, default=40)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--cache-tokens", type=int, default=32768, help="per worker")
    p.add_argument("--prefill-us", type=float, default=200.0)
    p.add_argument("--itl-ms", type=float, default=8.0)
    p.add_argument("--think", type=float, default=2.0, help="mean seconds between turns")
    p.add_argument("--ramp", type=float, default=4.0)
    p.add_argument("--balance", type=int, default=8, help="--routing-balance")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--policies", default="prefix,least-loaded,round-robin")
    args = smoke.parse_args(p, conversations=2, turns=2, workers=2, system_words=50,
                            question_words=5, answer_tokens=4, think=0.05, ramp=0.1,
                            policies="prefix")

    async def run_all() -> None:
        rows = [await run_policy(args, "prefix", 1, args.cache_tokens * args.workers)]
        for routing in args.policies.split(","):
            rows.append(await run_policy(args, routing, args.workers, args.cache_tokens))
        single = rows[0]["reuse"]
        print(f"{args.conversations} conversations x {args.turns} turns, system prompt "
              f"{args.system_words} words, {args.workers} sim workers x {args.cache_tokens} "
              f"cache tokens, prefill {args.prefill_us} us/token, balance {args.balance}")
        print(f"{'routing':<14}{'workers':>8}{'reuse':>8}{'vs 1 worker':>12}"
              f"{'engine TTFT p50':>17}{'p99':>8}{'client TTFT p50':>17}{'p99':>8}"
              f"{'req max/mean':>14}{'prefill max/mean':>18}  decisions")
        for r in rows:
            print(f"{r['routing']:<14}{r['workers']:>8}{r['reuse']:>8.1%}"
                  f"{r['reuse'] / single if single else 0:>12.1%}"
                  f"{r['engine_ttft_p50_ms']:>15.0f}ms{r['engine_ttft_p99_ms']:>6.0f}ms"
                  f"{r['ttft_p50_ms']:>15.0f}ms{r['ttft_p99_ms']:>6.0f}ms"
                  f"{imbalance(r['routed']):>14.2f}{imbalance(r['prefill_tokens']):>18.2f}"
                  f"  {r['decisions']}")
        print(json.dumps(rows))

    trio.run(run_all)


if __name__ == "__main__":
    main()
