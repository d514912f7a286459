#!/usr/bin/env python3
"""How long is one engine step of the transformers worker with long prompts? (issue 29's
busy worker taken for hung; docs/scaling.md, "Busy is not hung")

In process, no server: the transformers engine on the tiny model of tests/tiny_model.py
(the size bench/schema_validity.py uses, 16,384 positions) gets ``--requests`` prompts of
``--prompt-tokens`` tokens at once, and is stepped until all are done, the way the worker's
loop steps it (a PING is answered between two steps only). Each step's wall time is split
with the kernel's counters for this thread (``/proc/thread-self/schedstat``) into ``cpu``
(running) and ``runq`` (runnable, waiting for a core another process had). Per prompt size it
prints the longest step, its CPU and run-queue time, and the prompt tokens that step
prefilled (``--prefill-tokens`` is the engine's budget per step; a single prompt longer than
the budget is prefilled whole in one step)::

    python bench/long_steps.py --prompt-tokens 500,2000,8000,16000 --requests 8

Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen_lib import smoke  # noqa: E402


def _schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting) of this thread so far."""
    with open("/proc/thread-self/schedstat") as f:
        cpu, runq, _ = f.read().split()
    return int(cpu) / 1e9, int(runq) / 1e9


def measure(engine, prompt_tokens: int, requests: int) -> dict:
    steps = []
    for rid in range(requests):
        engine.add(rid, [5 + (rid + i) % 500 for i in range(prompt_tokens)],
                   {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
    while engine.next_deadline() is not None:
        waiting = engine.waiting()
        cpu0, runq0 = _schedstat()
        t0 = time.perf_counter()
        engine.step(time.monotonic())
        wall = time.perf_counter() - t0
        cpu1, runq1 = _schedstat()
        admitted = waiting - engine.waiting()
        steps.append({"wall": wall, "cpu": cpu1 - cpu0, "runq": runq1 - runq0,
                      "prefilled": admitted * prompt_tokens})
    worst = max(steps, key=lambda s: s["wall"])
    return {"prompt_tokens": prompt_tokens, "requests": requests, "steps": len(steps),
            "longest_s": round(worst["wall"], 3), "its_cpu_s": round(worst["cpu"], 3),
            "its_runq_s": round(worst["runq"], 3), "its_prefill_tokens": worst["prefilled"],
            "all_steps_s": round(sum(s["wall"] for s in steps), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", default="500,2000,8000,16000")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--num-threads", type=int, default=1)
    args = smoke.parse_args(p, argv, prompt_tokens="16,64", requests=2)
    from server.engines.transformers.engine import TransformersEngine
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=16384)
    engine = TransformersEngine(model_path=str(model), max_batch=args.requests,
                                prefill_tokens=args.prefill_tokens,
                                num_threads=args.num_threads, prepare_process=False)
    rows = [measure(engine, int(n), args.requests) for n in args.prompt_tokens.split(",")]
    print(f"{'prompt':>7} {'steps':>5} {'longest s':>9} {'cpu s':>7} {'runq s':>7} "
          f"{'prefilled':>9} {'total s':>8}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['steps']:>5} {r['longest_s']:>9} {r['its_cpu_s']:>7} "
              f"{r['its_runq_s']:>7} {r['its_prefill_tokens']:>9} {r['all_steps_s']:>8}")
    print(json.dumps({"prefill_tokens": args.prefill_tokens, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
