#!/usr/bin/env python3
"""Frontend CPU per token with the vllm engine, next to ``vllm serve``, on one model.

What it measures
----------------
The same vLLM engine on the same model behind two frontends, loaded by the same load
generator (bench/loadgen.py, closed loop, streaming completions, greedy with ``ignore_eos``
so every request makes exactly ``--max-tokens`` tokens), at each concurrency of
``--concurrency`` (default 1,4,16):

* ``ours``: ``python -m server --engine vllm`` at its defaults: one event per engine step,
  vLLM's own granularity (``--stream-interval-ms 0``);
* ``ours-20``: the same with ``--stream-interval-ms 20`` (the default before issue 15:
  tokens merged into an event at most every 20 ms);
* ``ours-process``: ours with ``--engine-core process``: vLLM's engine core in a process
  of its own beside the worker, as vLLM's server runs it (issue 28 item 2);
* ``vllm``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, what
  ``vllm serve`` runs) at its defaults;
* ``ours-sim``: our server on the sim engine (no vLLM: ``--smoke``'s, which proves the
  script's load and report without loading vLLM).

For each it reports the frontend's CPU per delivered token (``frontend_cpu_us_per_token``:
our frontend process; vLLM's API-server process, its engine-core process being the
"worker"), the engine side's, tokens/s and TTFT p50. Engine settings are the same for both
(``--engine``, JSON: ``--engine-arg`` pairs for ours, options for vLLM's server).

On a GPU (the device tool lends one to some sessions), with a real small model::

    python bench/vllm_frontend.py --model-path /models/qwen2.5-0.5b-instruct \\
        --engine '{"max_model_len": 4096}' --concurrency 1,4,16,64 --max-tokens 256

Without ``--model-path`` the tiny model of tests/tiny_model.py (hidden 256, 4 heads, 2
layers) is built in a temporary directory. Output: a table, then one JSON line.

Example::

    python bench/vllm_frontend.py                                 # tiny model, CPU
    python bench/vllm_frontend.py --model-path ~/models/qwen2.5-0.5b --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen_lib import smoke  # noqa: E402

#: Engine settings both servers get (vLLM's CPU build: float32, a fixed small KV cache).
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20}


def _server_cmd(kind: str, model: str, port: int, engine: dict) -> list[str]:
    if kind == "ours-sim":  # (--smoke's: our server and the same load, without vLLM)
        return [sys.executable, "-m", "server", "--engine", "sim", "--model", "m", "--port",
                str(port), "--disable-log-requests"]
    if kind == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "m",
               "--disable-uvicorn-access-log"]
        for key, value in engine.items():
            flag = key.replace("_", "-")
            if isinstance(value, bool):  # vLLM's boolean flags take no value
                cmd.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                cmd += [f"--{flag}", str(value)]
        return cmd
    cmd = [sys.executable, "-m", "server", "--engine", "vllm", "--model-path", model,
           "--model", "m", "--port", str(port), "--disable-log-requests"]
    for key, value in engine.items():
        cmd += ["--engine-arg", f"{key}={json.dumps(value) if isinstance(value, bool) else value}"]
    if kind == "ours-20":
        cmd += ["--stream-interval-ms", "20"]
    if kind == "ours-process":
        cmd += ["--engine-core", "process"]
    return cmd


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, kind: str, proc, timeout: float = 900) -> None:
    path = "/health" if kind == "vllm" else "/ready"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} exited with {proc.returncode}")
        try:
            r = httpx.get(url + path, timeout=2)
            if r.status_code == 200 and (kind == "vllm" or r.json().get("status") == "ready"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{kind} not up in {timeout} s")


def run_server(kind: str, model: str, args) -> list[dict]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    log = open(Path(tempfile.gettempdir()) / f"vllm_frontend_{kind}.log", "w")
    proc = subprocess.Popen(_server_cmd(kind, model, port, args.engine), stdout=log, stderr=log, env=env)
    rows = []
    try:
        _wait_up(url, kind, proc)
        for c in args.concurrency:
            n = max(args.min_requests, c * args.rounds)
            out = subprocess.run(
                [sys.executable, str(ROOT / "bench" / "loadgen.py"), "--url", url,
                 "--pid", str(proc.pid), "-c", str(c), "-n", str(n), "--model", "m",
                 "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
                 "--extra-body", json.dumps({"ignore_eos": True, "temperature": 0}),
                 "--warmup", "0", "--ramp-up", "0", "--quiet"],
                capture_output=True, text=True, check=False,
            )
            summary = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"server": kind, "concurrency": c, **{k: summary.get(k) for k in (
                "requests", "errors", "delivered_tokens_per_s", "tokens_per_event",
                "frontend_cpu_us_per_token", "worker_cpu_us_per_token", "ttft_p50_ms")}})
            print(_row(rows[-1]), flush=True)
    finally:
        stop_server(proc)
        log.close()
    return rows


def stop_server(proc) -> None:
    """Stop a server as Ctrl-C would (its graceful path), killing it after 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _row(r: dict) -> str:
    return (f"{r['server']:>7} c={r['concurrency']:<3} tok/s={r['delivered_tokens_per_s']!s:>8} "
            f"frontend_us/tok={r['frontend_cpu_us_per_token']!s:>7} "
            f"engine_us/tok={r['worker_cpu_us_per_token']!s:>7} "
            f"tok/event={r['tokens_per_event']!s:>5} ttft_p50_ms={r['ttft_p50_ms']!s:>7} "
            f"errors={r['errors']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="a local model directory (default: the tiny model)")
    p.add_argument("--concurrency", default="1,4,16",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=4, help="requests per client per level")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--servers", default="ours,ours-20,vllm")
    p.add_argument("--engine", type=json.loads, default=ENGINE,
                   help="engine arguments for both servers, as JSON (default: the CPU "
                   "settings above; on a GPU e.g. '{\"max_model_len\": 4096}')")
    args = smoke.parse_args(p, argv, servers="ours-sim", concurrency=[1], rounds=1,
                            min_requests=2, max_tokens=4, prompt_tokens=8)
    if args.smoke and "ours-sim" in args.servers:
        smoke.skipped("vLLM, ours-sim instead (--smoke --servers ours,vllm runs vLLM)")
    model = args.model_path
    if model is None:
        from tests.tiny_model import build_tiny_model

        model = str(build_tiny_model(
            Path(tempfile.mkdtemp()) / "tiny", hidden_size=256, heads=4, layers=2,
            vocab_size=1000, max_position_embeddings=ENGINE["max_model_len"],
        ))
    rows = []
    for kind in args.servers.split(","):
        rows += run_server(kind, model, args)
    print(json.dumps({"rows": rows, "max_tokens": args.max_tokens,
                      "prompt_tokens": args.prompt_tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
