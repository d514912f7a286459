"""Prefix routing on real vLLM engines (vLLM's CPU build will do): conversations start two
at a time on two workers, then each sends its follow-up; prints each follow-up's real
``cached_tokens`` (vLLM's prefix cache hits), for each ``--routing`` policy given, with
prompts as text (routed by prediction) and as token ids (routed by the workers' KV events,
docs/routing.md).

    python bench/prefix_routing_vllm.py                       # a tiny random model built here
    python bench/prefix_routing_vllm.py --model-path DIR --routing prefix,least-loaded
    python bench/prefix_routing_vllm.py --api-servers 2 --conversations 8   # two frontends
    python bench/prefix_routing_vllm.py --engine sim --api-servers 2 --conversations 32
                                                # the same on sim workers with a prefix cache

With ``--api-servers 2`` every request is sent on a new connection, which the kernel gives
to either frontend: a follow-up often reaches the frontend that did not route its first
turn. Slow to start (each policy loads two vLLM engines).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.spawn import SpawnedServer  # noqa: E402


def prompt(name: str, turns: int) -> str:
    """A conversation as plain text: its own long preamble, then the turns so far."""
    text = f"This is the conversation of {name}. " + f"{name} asks about caches. " * 40
    for t in range(turns):
        text += f"\nQuestion {t} from {name}: what is in block {t}?\nAnswer: "
    return text


def prompt_ids(name: str, turns: int) -> list[int]:
    """A conversation as token ids (1 to 499: the tiny model's tokenizer has fewer than
    its 1000 ids): its own preamble, then the turns so far."""
    seed = sum(map(ord, name))
    ids = [(seed * 7 + i * 13) % 499 + 1 for i in range(860)]
    for t in range(turns):
        ids += [(seed + t * 31 + i) % 499 + 1 for i in range(43)]
    return ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="vllm", choices=("vllm", "sim"),
                   help="sim: sim workers with their prefix cache (blocks of 16 words)")
    p.add_argument("--model-path", default=None, help="default: a tiny random model")
    p.add_argument("--routing", default="prefix,least-loaded")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--api-servers", type=int, default=1)
    p.add_argument("--conversations", type=int, default=2, help="per kind of prompt (even)")
    p.add_argument("--prompts", default="text,ids", help="text, ids or both")
    args = smoke.parse_args(p, engine="sim", routing="prefix")
    if args.smoke and args.engine == "sim":
        smoke.skipped("the vllm engine (--smoke --engine vllm runs it)")
    model = args.model_path
    if args.engine == "sim":
        served = "sim"
        engine = ("--engine sim --sim-prefix-cache-tokens 1000000 --sim-ttft-ms 5 "
                  "--sim-itl-ms 2 --sim-prefill-us-per-token 0")
    elif model is None:
        from tests.tiny_model import build_tiny_model

        model = str(build_tiny_model(
            os.path.join(tempfile.mkdtemp(prefix="tiny-vllm-"), "tiny"),
            hidden_size=256, heads=4, layers=2, vocab_size=1000,
            max_position_embeddings=4096))
    if args.engine == "vllm":
        served = os.path.basename(os.path.normpath(model))
        engine = (f"--engine vllm --model-path {model} --max-model-len 4096 --dtype float32 "
                  "--engine-arg kv_cache_memory_bytes=67108864")
    for routing in args.routing.split(","):
        server = SpawnedServer(
            f"{engine} --engine-workers 2 --routing {routing} "
            f"--api-servers {args.api_servers} --disable-log-requests",
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

            def ask(body, url: str = url, n: int = 8) -> dict:
                with httpx.Client() as client:  # a new connection: either frontend's
                    r = client.post(url, json={"model": served, "prompt": body,
                                               "max_tokens": n, "temperature": 0,
                                               "ignore_eos": True}, timeout=300)
                r.raise_for_status()
                return r.json()["usage"]

            def cached(u: dict) -> int:
                return (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

            from concurrent.futures import ThreadPoolExecutor

            print(f"--routing {routing}, --api-servers {args.api_servers}")
            for kind in args.prompts.split(","):
                make = prompt if kind == "text" else prompt_ids
                names = [f"{kind}{i}" for i in range(args.conversations)]
                hits = []
                for pair in range(0, len(names), 2):
                    two = names[pair:pair + 2]
                    with ThreadPoolExecutor(2) as pool:  # both first turns at once
                        firsts = list(pool.map(lambda n, m=make: ask(m(n, 1), n=400), two))
                    for n, u in zip(two, firsts):
                        follow = ask(make(n, 2))
                        hits.append(cached(follow))
                        print(f"  {n}: turn 1 prompt {u['prompt_tokens']} cached {cached(u)};"
                              f" turn 2 prompt {follow['prompt_tokens']} cached "
                              f"{cached(follow)}")
                print(f"  {kind}: {sum(1 for h in hits if h)} of {len(hits)} follow-ups "
                      f"reused their first turn, {sum(hits)} tokens cached in all")
            metrics = httpx.get(server.url + "/metrics").text
            for line in metrics.splitlines():
                if line.startswith(("trio_llm:routed_requests_total", "trio_llm:routing_notices",
                                    "trio_llm:routing_decisions_total")):
                    print("  " + line)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
