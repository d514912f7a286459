#!/usr/bin/env python3
"""The transformers engine on a GPU: a correctness check, then tokens/s and TTFT by concurrency.

Run on a machine with CUDA, from the repository root, after installing a CUDA build of torch
(docs/transformers.md, "GPU")::

    python bench/gpu_transformers.py --model-path /models/Qwen2.5-0.5B-Instruct
    python bench/gpu_transformers.py --random 350m      # no model at hand: a random one

Steps, all in one run (a few minutes for a 0.5B model on one GPU):

1. ``torch.cuda`` is checked, and the device named.
2. **Greedy equality**, in this process, without workers: eight prompts of different lengths
   join the engine's batch at different steps; each completion is compared token for token
   with ``model.generate`` alone. In bfloat16, batched and unbatched kernels round
   differently and greedy paths may part after some tokens: the report gives how many are
   identical and where the others diverge, rather than failing.
3. **Throughput** with real worker processes (bench/transformers_bench.py), at
   ``--concurrency`` (default ``1,4,16,64``).

``--random SIZE`` (``tiny``, ``60m``, ``350m``) builds a random Llama-like model of about
that many parameters with the test tokenizer (tests/tiny_model.py) into a temporary
directory: the speed is a real model's of that shape; the text is gibberish.

Output: progress on stderr; the last line of stdout is one JSON object.
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
sys.path.insert(0, str(ROOT / "bench"))

from bench.loadgen_lib import smoke  # noqa: E402

SHAPES = {  # hidden, layers, heads (kv heads: half), intermediate = 2 * hidden
    "tiny": (64, 4, 4),  # 0.2M parameters
    "60m": (768, 12, 12),
    "350m": (1536, 16, 16),
}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def build_random(size: str, path: Path) -> Path:
    from tests.tiny_model import build_tiny_model

    hidden, layers, heads = SHAPES[size]
    return build_tiny_model(
        path, hidden_size=hidden, layers=layers, max_position_embeddings=4096,
        init_scale=0.02 if size != "tiny" else 0.25, heads=heads,
    )


def check_greedy(model_path: str, device: str, dtype: str | None, max_tokens: int) -> dict:
    import torch

    from server.engines.transformers.engine import TransformersEngine
    from tests.tiny_model import WORDS

    engine = TransformersEngine(model_path=model_path, device=device, dtype=dtype, max_batch=16)
    n = len(WORDS)
    prompts = [" ".join(WORDS[(i * 7 + j) % n] for j in range(3 + 9 * i)) for i in range(8)]
    refs = []
    for p in prompts:
        ids = engine.encode(p)
        with torch.inference_mode():
            out = engine.model.generate(
                torch.tensor([ids], device=engine.model.device),
                max_new_tokens=max_tokens, do_sample=False,
            )
        refs.append(engine.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))
    texts: dict[int, str] = {}
    for i, p in enumerate(prompts):  # one joins every other step
        engine.add(i, p, {"max_tokens": max_tokens, "temperature": 0})
        for _ in range(2):
            for rid, text, _, _, _ in engine.step(0.0):
                texts[rid] = texts.get(rid, "") + text
    while engine.next_deadline() is not None:
        for rid, text, _, _, _ in engine.step(0.0):
            texts[rid] = texts.get(rid, "") + text
    same = [texts[i] == refs[i] for i in range(len(prompts))]
    diverge = [
        next((k for k, (a, b) in enumerate(zip(texts[i], refs[i])) if a != b), None)
        for i in range(len(prompts)) if not same[i]
    ]
    result = {"identical": sum(same), "of": len(prompts), "diverge_at_char": diverge,
              "dtype": engine.info["dtype"]}
    del engine
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--random", choices=sorted(SHAPES), help="build a random model of this size")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: auto (the checkpoint's dtype)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=64)
    args = smoke.parse_args(p, argv, random="tiny", device="cpu", concurrency="1",
                            max_tokens=4, prompt_tokens=8, max_batch=4)
    if args.smoke and args.device == "cpu":
        smoke.skipped("the GPU: on the CPU (--smoke --device cuda runs on one)")
    if not args.model_path and not args.random:
        p.error("give --model-path DIR or --random SIZE")

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log(f"torch {torch.__version__} sees no GPU (torch.version.cuda={torch.version.cuda})")
        return 2
    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    log(f"torch {torch.__version__}, device {device_name}")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or str(
            build_random(args.random, Path(tmp) / f"random-{args.random}")
        )
        t0 = time.perf_counter()
        greedy = check_greedy(model_path, args.device, args.dtype, 4 if args.smoke else 32)
        log(f"greedy equality: {greedy} ({time.perf_counter() - t0:.1f} s)")

        import trio

        import transformers_bench as tb

        bargs = tb.parse_args([
            "--device", args.device, "--concurrency", args.concurrency,
            "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
            "--max-batch", str(args.max_batch), "--rounds", "2",
        ] + (["--dtype", args.dtype] if args.dtype else []))
        log(tb.HEADER)
        report = trio.run(tb.bench, bargs, model_path)
    report.update(bench="transformers-gpu", gpu=device_name, torch=torch.__version__,
                  greedy=greedy, random=args.random)
    print(tb.HEADER)
    for level in report["levels"]:
        print(tb._row(level))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
