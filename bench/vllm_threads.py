#!/usr/bin/env python3
"""How long the vllm engine takes for 256 greedy tokens, and with how many torch threads.

    python bench/cpu_load.py --cores 2 --seconds 120 &     # optional: a loaded host
    python bench/vllm_threads.py [--tokens 256] [--runs 3]

Builds the tests' tiny vLLM model (tests/test_vllm_engine.py's shape, float32), starts the
engine as a worker process does (:class:`server.engines.vllm.engine.VLLMEngine`, engine core
in this process), and times one greedy request of ``--tokens`` tokens (``ignore_eos``)
``--runs`` times, stepping the engine as the worker loop does. Prints torch's intra-op thread
count once the engine is built, the host's load average, and each run's seconds; the last
line of stdout is one JSON object. Each run is bounded (``--timeout`` seconds). ``--smoke``
builds the model only (tests/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds one run may take before it is given up")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick run (CI runs it): the tiny model is built, the vLLM "
                             "engine is not started (a minute of loading); no figures")
    args = parser.parse_args(argv)

    import torch

    from server.engines.vllm.engine import VLLMEngine
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "tiny-vllm", hidden_size=256, heads=4, layers=2,
                                vocab_size=1000, max_position_embeddings=4096)
        if args.smoke:
            print("smoke run: skipped the vLLM engine and its runs", file=sys.stderr)
            print(json.dumps({"torch_threads": torch.get_num_threads(), "runs": []}))
            return
        engine = VLLMEngine(model_path=str(path), engine_args={
            "dtype": "float32", "max_model_len": 4096, "kv_cache_memory_bytes": 64 << 20})
        threads = torch.get_num_threads()
        print(f"torch threads: {threads} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})",
              file=sys.stderr)
        params = {"max_tokens": args.tokens, "temperature": 0.0, "ignore_eos": True}
        runs = []
        for i in range(args.runs):
            load = os.getloadavg()[0]
            started = time.monotonic()
            engine.add(i, "hello world", params)
            done = 0
            finished = False
            while not finished:
                if time.monotonic() - started > args.timeout:
                    engine.abort(i)
                    break
                for row in engine.step(time.monotonic()):
                    done += row[2]
                    finished = finished or row[3] is not None
                engine.notes.clear()
            seconds = time.monotonic() - started
            runs.append({"seconds": round(seconds, 2), "tokens": done, "load": round(load, 1),
                         "timed_out": not finished})
            print(f"run {i}: {done} tokens in {seconds:.2f} s at load {load:.1f}",
                  file=sys.stderr)
        engine.close()
    print(json.dumps({"torch_threads": threads, "runs": runs}))


if __name__ == "__main__":
    main()
