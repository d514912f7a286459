"""Prefix routing on real vLLM engines (vLLM's CPU build will do): two conversations start
at once on two workers, then each sends its follow-up; prints each follow-up's real
``cached_tokens`` (vLLM's prefix cache hits), for each ``--routing`` policy given.

    python bench/prefix_routing_vllm.py                       # a tiny random model built here
    python bench/prefix_routing_vllm.py --model-path DIR --routing prefix,least-loaded

Slow to start (each policy loads two vLLM engines).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.loadgen_lib.spawn import SpawnedServer  # noqa: E402


def prompt(name: str, turns: int) -> str:
    """A conversation as plain text: its own long preamble, then the turns so far."""
    text = f"This is the conversation of {name}. " + f"{name} asks about caches. " * 40
    for t in range(turns):
        text += f"\nQuestion {t} from {name}: what is in block {t}?\nAnswer: "
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: a tiny random model")
    p.add_argument("--routing", default="prefix,least-loaded")
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args()
    model = args.model_path
    if model is None:
        from tests.tiny_model import build_tiny_model

        model = str(build_tiny_model(
            os.path.join(tempfile.mkdtemp(prefix="tiny-vllm-"), "tiny"),
            hidden_size=256, heads=4, layers=2, vocab_size=1000,
            max_position_embeddings=4096))
    for routing in args.routing.split(","):
        server = SpawnedServer(
            f"--engine vllm --model-path {model} --engine-workers 2 --routing {routing} "
            "--max-model-len 4096 --dtype float32 "
            "--engine-arg kv_cache_memory_bytes=67108864 --disable-log-requests",
            "server", None)
        try:
            deadline = time.monotonic() + args.startup_timeout
            while time.monotonic() < deadline:
                if server.proc.poll() is not None:
                    raise RuntimeError("the server exited:\n" + server.log_tail())
                try:
                    r = httpx.get(server.url + "/ready", timeout=5)
                    if r.status_code == 200 and r.json().get("status") == "ready":
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            else:
                raise RuntimeError("not ready in time:\n" + server.log_tail())
            url = server.url + "/v1/completions"

            def ask(body: str, client: httpx.Client, url: str = url, n: int = 8) -> dict:
                r = client.post(url, json={"model": "tiny", "prompt": body, "max_tokens": n,
                                           "temperature": 0, "ignore_eos": True}, timeout=300)
                r.raise_for_status()
                return r.json()["usage"]

            with httpx.Client() as client:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(2) as pool:  # both first turns at once (long answers)
                    firsts = list(pool.map(lambda n: ask(prompt(n, 1), httpx.Client(), n=400),
                                           ["Ann", "Bob"]))
                follow = {n: ask(prompt(n, 2), client) for n in ("Bob", "Ann")}
                metrics = client.get(server.url + "/metrics").text
            print(f"--routing {routing}")
            for n, u in zip(("Ann", "Bob"), firsts):
                print(f"  {n} turn 1: prompt {u['prompt_tokens']}, cached "
                      f"{(u.get('prompt_tokens_details') or {}).get('cached_tokens')}")
            for n, u in follow.items():
                print(f"  {n} turn 2: prompt {u['prompt_tokens']}, cached "
                      f"{(u.get('prompt_tokens_details') or {}).get('cached_tokens')}")
            for line in metrics.splitlines():
                if line.startswith("trio_llm:routed_requests_total"):
                    print("  " + line)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
