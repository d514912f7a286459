#!/usr/bin/env python3
"""``--engine vllm`` next to ``vllm serve`` on one GPU: a real architecture and size, random
weights, the same engine arguments and the same streaming load.

Run on a machine with one GPU and vLLM's CUDA build, from the repository root, offline::

    python bench/gpu_vllm.py --shape qwen2.5-0.5b      # Qwen2.5-0.5B's config, random weights
    python bench/gpu_vllm.py --shape llama-3.2-1b      # Llama-3.2-1B's
    python bench/gpu_vllm.py --model-path /models/X    # a real checkpoint instead
    python bench/gpu_vllm.py --tiny                    # CPU, vLLM's CPU build: proves the script
    python bench/gpu_vllm.py --smoke                   # seconds: --tiny, our server on the sim
                                                       # (ours-sim), no vLLM: what CI runs

Steps (a few minutes on one GPU; ``--tiny`` takes about ten on two busy cores, most of it
the two servers' startup):

1. The model: the config of the named model (layers, widths, heads, vocabulary, rope) with
   random weights in bfloat16, and a tokenizer trained here as the tests train theirs
   (tests/tiny_model.py), padded with added tokens to the model's vocabulary so that every
   id a random model emits decodes. The text is gibberish; the work per token is the real
   model's. ``--tiny``: the test model (hidden 256, 2 layers, vocabulary 1000) in float32.
2. Each server in turn (``--servers``), with the same engine arguments (``--engine``, JSON):
   ours (``python -m server --engine vllm``, every argument as ``--engine-arg``) with vLLM's
   engine core in the worker process (``ours``, the default) and in a process of its own
   (``ours-process``: ``--engine-core process``, as vLLM's server runs it), then vLLM's
   (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs: its console
   script is not used).
3. At each concurrency (``--concurrency``, default 1,64,256) the same closed-loop streaming
   load (bench/loadgen.py: completions of ``--prompt-tokens`` random-word prompts, greedy,
   ``ignore_eos``, exactly ``--max-tokens`` tokens each), while ``nvidia-smi`` samples the
   GPU's utilisation every 100 ms.

Printed per server and concurrency: delivered tokens/s, TTFT p50/p90/p99, inter-token
latency p50/p90/p99 (the client's gaps between content events: one token each for both
servers, at their defaults), GPU utilisation (mean and p50 of the samples; none without
``nvidia-smi``), the frontend's CPU per token; then per concurrency and per ``ours*``
server the ratio ours/vLLM of
tokens/s and of ITL p50 (the target: tokens/s >= 1.0 and ITL p50 <= 1.0 at 64 and 256). The
last line of stdout is one JSON object. Server logs: $TMPDIR/gpu_vllm_<server>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.loadgen_lib import smoke  # noqa: E402
from vllm_frontend import _free_port, _server_cmd, _wait_up, stop_server  # noqa: E402

#: The configs of the real models (their config.json's sizes), for random weights.
SHAPES = {
    "qwen2.5-0.5b": {
        "arch": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "arch": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "head_dim": 64,
    },
}

#: Engine arguments for both servers on a GPU: everything whose default differs between
#: vLLM's LLMEngine and its OpenAI server is set.
GPU_ENGINE = {
    "dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 256,
    "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.85,
    "enable_prefix_caching": True, "seed": 0,
}
#: With --tiny, on vLLM's CPU build: float32, a fixed small KV cache.
CPU_ENGINE = {
    "dtype": "float32", "max_model_len": 512, "max_num_seqs": 256,
    "max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 256 << 20,
    "enable_prefix_caching": True, "seed": 0,
}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def build_shaped(shape: str, path: Path) -> Path:
    """The named model's config with random bfloat16 weights, and a local tokenizer padded
    to its vocabulary."""
    import torch
    from transformers import (
        AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    )

    from tests.tiny_model import build_tiny_model

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    build_tiny_model(path, hidden_size=64, layers=1, heads=4, vocab_size=1000)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([f"<r{i}>" for i in range(spec["vocab_size"] - len(tokenizer))])
    tokenizer.save_pretrained(path)
    eos = tokenizer.eos_token_id
    config_class, model_class = ((Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2"
                                 else (LlamaConfig, LlamaForCausalLM))
    config = config_class(**spec, bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
                          initializer_range=0.02, torch_dtype="bfloat16")
    for old in path.glob("*.safetensors*"):
        old.unlink()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    log(f"built {shape}: {n / 1e9:.2f}B parameters, vocabulary {config.vocab_size}, at {path}")
    return path


def build_tiny(path: Path) -> Path:
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(path, hidden_size=256, heads=4, layers=2, vocab_size=1000,
                            max_position_embeddings=CPU_ENGINE["max_model_len"])


class GPUSampler:
    """``nvidia-smi``'s GPU utilisation every 100 ms, from start() to stop() (nothing where
    there is no nvidia-smi)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples = []
        if shutil.which("nvidia-smi") is None:
            return
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
             "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append(float(line.split(",")[0]))
            except ValueError:
                pass

    def stop(self) -> dict:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            assert self._thread is not None
            self._thread.join(5)
            self._proc = None
        s = sorted(self.samples)
        if not s:
            return {"gpu_util_mean": None, "gpu_util_p50": None, "gpu_samples": 0}
        return {"gpu_util_mean": round(sum(s) / len(s), 1), "gpu_util_p50": s[len(s) // 2],
                "gpu_samples": len(s)}


_KEYS = ("requests", "errors", "delivered_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms",
         "ttft_p99_ms", "gap_p50_ms", "gap_p90_ms", "gap_p99_ms", "tokens_per_event",
         "frontend_cpu_us_per_token")


def run_server(kind: str, model: str, args) -> list[dict]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1")
    path = Path(tempfile.gettempdir()) / f"gpu_vllm_{kind}.log"
    sampler = GPUSampler()
    rows = []
    with open(path, "w") as server_log:
        proc = subprocess.Popen(_server_cmd(kind, model, port, args.engine),
                                stdout=server_log, stderr=server_log, env=env)
        try:
            started = time.monotonic()
            _wait_up(url, kind, proc, timeout=args.startup_timeout)
            log(f"{kind}: up in {time.monotonic() - started:.0f} s")
            for c in args.concurrency:
                n = max(args.min_requests, c * args.rounds)
                sampler.start()
                out = subprocess.run(
                    [sys.executable, str(ROOT / "bench" / "loadgen.py"), "--url", url,
                     "--pid", str(proc.pid), "-c", str(c), "-n", str(n), "--model", "m",
                     "--max-tokens", str(args.max_tokens),
                     "--prompt-tokens", str(args.prompt_tokens),
                     "--extra-body", json.dumps({"ignore_eos": True, "temperature": 0}),
                     "--warmup", "0", "--ramp-up", "0", "--quiet"],
                    capture_output=True, text=True, check=False,
                )
                gpu = sampler.stop()
                lines = out.stdout.strip().splitlines()
                if out.returncode != 0 or not lines:
                    raise SystemExit(f"loadgen failed against {kind}: {out.stderr[-2000:]}")
                summary = json.loads(lines[-1])
                rows.append({"server": kind, "concurrency": c,
                             **{k: summary.get(k) for k in _KEYS}, **gpu})
                print(_row(rows[-1]), flush=True)
        finally:
            stop_server(proc)
    return rows


def _row(r: dict) -> str:
    return (f"{r['server']:>12} c={r['concurrency']:<4} tok/s={r['delivered_tokens_per_s']!s:>9} "
            f"ttft p50/p90/p99 ms={r['ttft_p50_ms']}/{r['ttft_p90_ms']}/{r['ttft_p99_ms']} "
            f"itl p50/p90/p99 ms={r['gap_p50_ms']}/{r['gap_p90_ms']}/{r['gap_p99_ms']} "
            f"gpu%={r['gpu_util_mean']} frontend_us/tok={r['frontend_cpu_us_per_token']} "
            f"errors={r['errors']}")


def _ratio(ours: dict, theirs: dict, key: str) -> float | None:
    a, b = ours.get(key), theirs.get(key)
    return round(a / b, 3) if a and b else None


def ratios(rows: list[dict]) -> list[dict]:
    """Per concurrency and each of our servers (``ours``, ``ours-process``): ours over
    vLLM's tokens/s, and ITL p50 (both servers measured)."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    out = []
    for (server, c), ours in sorted(by.items(), key=lambda kv: kv[0][1]):
        theirs = by.get(("vllm", c))
        if not server.startswith("ours") or theirs is None:
            continue
        out.append({"server": server, "concurrency": c,
                    "tokens_per_s_ratio": _ratio(ours, theirs, "delivered_tokens_per_s"),
                    "itl_p50_ratio": _ratio(ours, theirs, "gap_p50_ms"),
                    "ttft_p50_ratio": _ratio(ours, theirs, "ttft_p50_ms")})
    return out


def _device() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "no GPU"
    except (OSError, subprocess.TimeoutExpired):
        return "no GPU (nvidia-smi not found)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()  # (one of them, or --smoke: --tiny)
    which.add_argument("--shape", choices=sorted(SHAPES),
                       help="random weights in this model's config")
    which.add_argument("--model-path", help="a local model directory")
    which.add_argument("--tiny", action="store_true",
                       help="the tests' tiny model on CPU, a short load: proves the script")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--servers", default="ours,ours-process,vllm")
    p.add_argument("--engine", type=json.loads,
                   help="engine arguments for both servers, as JSON (default: GPU_ENGINE, or "
                   "CPU_ENGINE with --tiny)")
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--keep", help="build the model into this directory and keep it")
    args = smoke.parse_args(p, argv, tiny=True, servers="ours-sim", concurrency=[1],
                            min_requests=2, max_tokens=4, prompt_tokens=8)
    if not (args.shape or args.model_path or args.tiny):
        p.error("one of the arguments --shape --model-path --tiny is required")
    if args.smoke and "ours-sim" in args.servers:
        smoke.skipped("the GPU and vLLM, ours-sim instead (--smoke --servers ours,vllm runs "
                      "vLLM on the tiny model)")
    if args.engine is None:
        args.engine = CPU_ENGINE if args.tiny else GPU_ENGINE
    args.concurrency = args.concurrency or [1, 64, 256]
    if args.max_tokens is None:
        args.max_tokens = 32 if args.tiny else 256
    if args.tiny:
        args.prompt_tokens = min(args.prompt_tokens, 32)
        args.rounds = 1
    device = _device()
    log(f"device: {device}")
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.keep) if args.keep else Path(tmp) / "model"
        if args.model_path:
            model = args.model_path
        elif args.tiny:
            model = str(build_tiny(where))
        elif (where / "config.json").is_file():
            model = str(where)  # built before, with --keep
        else:
            model = str(build_shaped(args.shape, where))
        rows = []
        for kind in args.servers.split(","):
            rows += run_server(kind, model, args)
    summary = ratios(rows)
    for r in summary:
        print(f"c={r['concurrency']:<4} {r['server']}/vllm tokens/s={r['tokens_per_s_ratio']} "
              f"itl_p50={r['itl_p50_ratio']} ttft_p50={r['ttft_p50_ratio']}")
    print(json.dumps({"device": device, "model": args.shape or args.model_path or "tiny",
                      "engine": args.engine, "max_tokens": args.max_tokens,
                      "prompt_tokens": args.prompt_tokens, "rows": rows, "ratios": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
