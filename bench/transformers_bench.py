#!/usr/bin/env python3
"""Tokens per second and time to first token of the transformers engine, by concurrency.

What it measures
----------------
One :func:`server.open_engine` with real worker processes (``--workers``, default 1) serving
a local model (``--model-path``; without it, the tiny random model of tests/tiny_model.py is
built in a temporary directory). After one warm-up request, for each concurrency level C in
``--concurrency`` (default ``1,4,16``), C clients each run ``--rounds`` requests back to back
(closed loop), every request greedy with ``ignore_eos`` so it makes exactly ``--max-tokens``
tokens, from a prompt of about ``--prompt-tokens`` tokens (random corpus words, different
per request). It reports, per level:

* ``tok_s``: completion tokens of all requests / wall time of the level;
* ``ttft_ms``: time to first token (from ``engine.generate`` to the first output with a
  token), p50 and p90 over the requests;
* ``itl_ms``: mean time between tokens within a request (``(e2e - ttft) / (tokens - 1)``);
* ``e2e_ms``: p50 request latency.

This is the engine as the frontend sees it (pipes, framing and the request manager
included), without HTTP. Output: a table, then as the last line of stdout one JSON object.

Example::

    python bench/transformers_bench.py                       # tiny model, CPU
    python bench/transformers_bench.py --model-path ~/models/qwen2.5-0.5b --num-threads 2 \\
        --concurrency 1,4,16 --max-tokens 64 --prompt-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

import server  # noqa: E402
from bench.loadgen_lib import smoke  # noqa: E402
from server import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="a local Hugging Face model directory (default: tiny)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (cpu default), auto, bfloat16, ...")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return smoke.parse_args(p, argv, concurrency="1,2", rounds=1, max_tokens=4, prompt_tokens=8)


def make_prompts(n: int, approx_tokens: int, seed: int) -> list[str]:
    from tests.tiny_model import WORDS

    rng = random.Random(seed)
    # about one token per corpus word for the tiny tokenizer; a rough guide for others
    return [" ".join(rng.choice(WORDS) for _ in range(approx_tokens)) for _ in range(n)]


async def one_request(engine, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft, e2e, tokens) of one greedy request, in seconds."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first = None
    tokens = 0
    async with engine.generate(prompt, params) as stream:
        async for out in stream:
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
            if out.num_tokens and first is None:
                first = time.perf_counter() - start
            tokens += out.num_tokens
    return first or 0.0, time.perf_counter() - start, tokens


async def run_level(engine, concurrency: int, args, level_seed: int) -> dict:
    prompts = make_prompts(concurrency * args.rounds, args.prompt_tokens, level_seed)
    results: list[tuple[float, float, int]] = []

    async def client(c: int) -> None:
        for r in range(args.rounds):
            prompt = prompts[c * args.rounds + r]
            results.append(await one_request(engine, prompt, args.max_tokens))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for c in range(concurrency):
            nursery.start_soon(client, c)
    wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    itls = [(e2e - ttft) / (n - 1) for ttft, e2e, n in results if n > 1]
    tokens = sum(r[2] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1),
        "ttft_ms_p50": round(1000 * _quantile(ttfts, 0.5), 1),
        "ttft_ms_p90": round(1000 * _quantile(ttfts, 0.9), 1),
        "itl_ms": round(1000 * statistics.fmean(itls), 2) if itls else None,
        "e2e_ms_p50": round(1000 * _quantile(sorted(r[1] for r in results), 0.5), 1),
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


async def bench(args, model_path: str) -> dict:
    options = {"model_path": model_path, "device": args.device, "max_batch": args.max_batch}
    if args.dtype:
        options["dtype"] = args.dtype
    if args.num_threads:
        options["num_threads"] = args.num_threads
    config = server.EngineConfig(
        engine="transformers", workers=args.workers, engine_options=options
    )
    t0 = time.perf_counter()
    async with server.open_engine(config) as engine:
        startup = time.perf_counter() - t0
        await one_request(engine, "warm up", 4)
        levels = []
        for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
            levels.append(await run_level(engine, c, args, args.seed + i))
            print(_row(levels[-1]), file=sys.stderr, flush=True)
        info = engine.info
    return {
        "bench": "transformers",
        "model": info.get("model"),
        "device": info.get("device"),
        "dtype": info.get("dtype"),
        "workers": args.workers,
        "num_threads": args.num_threads,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "startup_s": round(startup, 2),
        "levels": levels,
    }


HEADER = (
    f"{'conc':>5} {'reqs':>5} {'tok/s':>9} {'ttft p50':>9} {'ttft p90':>9} {'itl ms':>7}"
    f" {'e2e p50':>9}"
)


def _row(r: dict) -> str:
    return (
        f"{r['concurrency']:>5} {r['requests']:>5} {r['tok_s']:>9.1f} {r['ttft_ms_p50']:>9.1f}"
        f" {r['ttft_ms_p90']:>9.1f} {r['itl_ms'] or 0:>7.2f} {r['e2e_ms_p50']:>9.1f}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path
        if model_path is None:
            from tests.tiny_model import build_tiny_model

            model_path = str(build_tiny_model(Path(tmp) / "tiny-llama"))
        print(HEADER, file=sys.stderr)
        report = trio.run(bench, args, model_path)
    print(HEADER)
    for level in report["levels"]:
        print(_row(level))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
