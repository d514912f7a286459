#!/usr/bin/env python3
"""The cost of structured output in the transformers engine, per generated token.

What it measures
----------------
The transformers engine in this process (no worker, no HTTP) on the tiny test model (or
``--model-path``), ``--requests`` greedy requests at once, ``--max-tokens`` each, run twice:
plain, and with a ``json_schema`` response format (a small object of enums, booleans,
bounded integers and arrays, as a tool's arguments would be). Reports the engine's wall time
per generated token for both and the difference: what the grammar (xgrammar's bitmask fill
per row, the mask applied to the batch, one accept per token) adds. The first constrained
run compiles the schema; it is timed apart (``compile_ms``) and the measured run reuses it.

Output: a line per variant, then one JSON line.

Example::

    python bench/grammar_cost.py --requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen_lib import smoke  # noqa: E402

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["unit", "ok", "count", "tags"],
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["a", "b", "c"]}},
    },
}


def run(engine, n: int, max_tokens: int, fmt: dict | None) -> tuple[float, int]:
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": fmt is None}
    if fmt:
        params["response_format"] = fmt
    for i in range(n):
        engine.add(i, f"request {i} the model", dict(params))
    tokens = 0
    start = time.perf_counter()
    while engine.next_deadline() is not None:
        tokens += sum(row[2] for row in engine.step(0.0))
    return time.perf_counter() - start, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = smoke.parse_args(p, argv, requests=2, max_tokens=4, repeat=1)
    import torch

    torch.set_num_threads(1)
    from server.engines.transformers.engine import TransformersEngine

    path = args.model_path
    if path is None:
        from tests.tiny_model import build_tiny_model

        path = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    engine = TransformersEngine(model_path=path, max_batch=args.requests)
    fmt = {"type": "json_schema", "schema": SCHEMA}
    start = time.perf_counter()
    run(engine, 1, 4, fmt)  # compiles the schema (and imports xgrammar)
    compile_ms = (time.perf_counter() - start) * 1000
    results = {}
    for name, f in (("plain", None), ("json_schema", fmt)) * args.repeat:
        seconds, tokens = run(engine, args.requests, args.max_tokens, f)
        us = seconds / tokens * 1e6
        results.setdefault(name, []).append(round(us, 1))
        print(f"{name:>12}: {tokens} tokens, {us:.1f} us/token")
    plain = min(results["plain"])
    constrained = min(results["json_schema"])
    print(json.dumps({"us_per_token": results, "grammar_us_per_token": round(constrained - plain, 1),
                      "compile_ms": round(compile_ms, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
