"""SIGTERM to exit of an idle server (``--shutdown-timeout 0``), and where the time goes.

Starts ``python -m server`` (the vllm engine on a tiny random model built here, or the sim
engine), waits until it is ready, sends SIGTERM, and polls /proc every 5 ms for the exit of
each process: the frontend, its worker(s) and what they started (vLLM's engine core).
Prints, per run, the seconds from SIGTERM to each process's exit::

    nice -n 10 python bench/shutdown_time.py --engine vllm --runs 3
    nice -n 10 python bench/shutdown_time.py --engine sim --runs 3
    nice -n 10 python bench/shutdown_time.py --runs 3 --server-arg=--engine-core=process

vLLM's own test (``test_abort_timeout_exits_quickly``) wants the frontend gone within 4 s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from bench.loadgen_lib import smoke  # noqa: E402
from tests.conftest import children_of, pid_exists  # noqa: E402

SHAPE = {"hidden_size": 256, "heads": 4, "layers": 2, "vocab_size": 1000,
         "max_position_embeddings": 1024}


def _command(engine: str, model_dir: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "server", "--port", "0", "--shutdown-timeout", "0"]
    if engine == "vllm":
        cmd += ["--engine", "vllm", "--model-path", str(model_dir), "--max-model-len", "1024",
                "--dtype", "float32", "--engine-arg", "kv_cache_memory_bytes=67108864"]
    return cmd


def one_run(cmd: list[str]) -> dict[str, float]:
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    found = threading.Event()
    url = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip()))
            m = re.search(r"serving on (http://\S+)", line)
            if m and not found.is_set():
                url.append(m.group(1))
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not found.wait(600):
            raise SystemExit("the server did not start:\n" + "\n".join(x for _, x in lines))
        while True:
            try:
                r = httpx.get(url[0] + "/ready", timeout=30)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        workers = children_of(proc.pid)
        pids = {"frontend": proc.pid}
        for i, w in enumerate(sorted(workers)):
            pids[f"worker{i}"] = w
            for j, c in enumerate(sorted(children_of(w))):
                pids[f"worker{i}.child{j}"] = c
        gone: dict[str, float] = {}
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while len(gone) < len(pids) and time.monotonic() - start < 60:
            for name, pid in pids.items():
                if name not in gone and (pid == proc.pid and proc.poll() is not None
                                         or pid != proc.pid and not pid_exists(pid)):
                    gone[name] = time.monotonic() - start
            time.sleep(0.005)
        reader.join(2)
        for t, line in lines:
            if t >= start:
                print(f"    {t - start:7.3f} s  {line[:150]}")
        return gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more argument for the server (repeatable)")
    args = smoke.parse_args(parser, engine="sim", runs=1)
    if args.smoke and args.engine == "sim":
        smoke.skipped("the vllm engine (--smoke --engine vllm runs it)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = None
        if args.engine == "vllm":
            from tests.tiny_model import build_tiny_model

            model_dir = build_tiny_model(os.path.join(tmp, "tiny"), **SHAPE)
        cmd = _command(args.engine, model_dir) + args.server_arg
        for run in range(args.runs):
            load = os.getloadavg()[0]
            gone = one_run(cmd)
            figures = "  ".join(f"{k} {v:.3f} s" for k, v in sorted(gone.items(),
                                                                    key=lambda kv: kv[1]))
            print(f"run {run + 1} (load average {load:.1f}): SIGTERM -> exit: {figures}",
                  flush=True)


if __name__ == "__main__":
    main()
