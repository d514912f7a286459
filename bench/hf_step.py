#!/usr/bin/env python3
"""What does one step of the transformers engine cost, as its batch grows? (issue 23)

In process, no server: the transformers engine (``TransformersEngine``) on the tiny model of
tests/tiny_model.py (the size bench/isolation.py serves: hidden 256, 4 query heads over 2
key/value heads, 2 layers, 2,048 positions) or ``--model-path``, one torch thread. ``--rows``
requests with prompts of different lengths (so the batch is padded, as a server's is) and
``ignore_eos`` join; then the engine steps and, every ``--every`` steps, the script prints
the batch's length and the steps' median and largest wall time and CPU (user, system: the
kernel's share is page faults on fresh tensors). After ``--steps`` steps, ``--logprobs-rows``
requests asking for ``logprobs`` (``--top``) join, as bench/isolation.py's ``logprobs``
request does (n=16, 20 alternatives), and it measures ``--every`` steps more.

Run it pinned to one core, as the isolation figures ran the worker::

    taskset -c 1 python bench/hf_step.py
    taskset -c 1 python bench/hf_step.py --attn sdpa     # transformers' own attention

Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen_lib import smoke  # noqa: E402

#: As bench/isolation.py's TINY.
TINY = {"hidden_size": 256, "heads": 4, "layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 2048}
WORDS = "once upon a time there was a small model that served many streams".split()


def _measure(engine, steps: int, refill) -> dict:
    walls = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        t = time.perf_counter()
        outputs = engine.step(0.0)
        walls.append(time.perf_counter() - t)
        engine.notes.clear()  # the worker loop takes them
        for out in outputs:
            if out[3] is not None:
                refill(out[0])
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    walls.sort()
    return {
        "rows": engine.running(),
        "length": engine._batch.length,
        "p50_ms": round(walls[len(walls) // 2] * 1000, 1),
        "p99_ms": round(walls[int(len(walls) * 0.99)] * 1000, 1),
        "max_ms": round(walls[-1] * 1000, 1),
        "user_ms": round((r1.ru_utime - r0.ru_utime) / steps * 1000, 1),
        "sys_ms": round((r1.ru_stime - r0.ru_stime) / steps * 1000, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model-path", help="a local model (default: the tiny model, built here)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000, help="steps before the logprobs rows")
    ap.add_argument("--every", type=int, default=200, help="steps per printed line")
    ap.add_argument("--logprobs-rows", type=int, default=16)
    ap.add_argument("--top", type=int, default=20, help="logprobs alternatives")
    ap.add_argument("--churn", type=int, default=0, metavar="N",
                    help="requests of N to 2N tokens (N > 0) that are replaced as they finish, "
                         "as a server's back-to-back streams (default: one long request per "
                         "row, so the batch only grows)")
    ap.add_argument("--attn", default=None,
                    help="attn_implementation (default: the engine's choice)")
    args = smoke.parse_args(ap, rows=2, steps=4, every=2, logprobs_rows=2, top=2)

    import torch

    torch.set_num_threads(1)
    from server.engines.transformers.engine import TransformersEngine
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or str(build_tiny_model(Path(tmp) / "tiny", **TINY))
        engine = TransformersEngine(model_path=path, max_batch=args.rows + args.logprobs_rows,
                                    attn_implementation=args.attn, prepare_process=False)
        attn = engine.model.config._attn_implementation
        rng = random.Random(0)
        cap = engine.max_model_len
        rids = iter(range(10**9))

        def add(_finished=None):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
            n = rng.randint(args.churn, 2 * args.churn) if args.churn else cap - 200
            engine.add(next(rids), words, {"max_tokens": n, "ignore_eos": True})

        for _ in range(args.rows):
            add()
        engine.step(0.0)  # the prefill
        lines = []
        for _ in range(args.steps // args.every):
            lines.append({"phase": "rows", **_measure(engine, args.every, add)})
            print(lines[-1], flush=True)
        if args.logprobs_rows:
            for _ in range(args.logprobs_rows):
                engine.add(next(rids), "once upon a time",
                           {"max_tokens": cap - 200, "ignore_eos": True, "logprobs": args.top})
            engine.step(0.0)
            lines.append({"phase": f"+{args.logprobs_rows} logprobs",
                          **_measure(engine, args.every, add)})
            print(lines[-1], flush=True)
        engine.close()
    print(f"\nattention {attn}, torch threads 1")
    print(f"{'phase':>14} {'rows':>5} {'length':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'user ms':>8} {'sys ms':>8}")
    for ln in lines:
        print(f"{ln['phase']:>14} {ln['rows']:>5} {ln['length']:>7} {ln['p50_ms']:>8} "
              f"{ln['p99_ms']:>8} {ln['max_ms']:>8} {ln['user_ms']:>8} {ln['sys_ms']:>8}")
    print(json.dumps({"attention": attn, "phases": lines}))


if __name__ == "__main__":
    main()
