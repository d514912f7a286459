#!/usr/bin/env python3
"""Ours against a peer server (vLLM's, say): the same load generator on each, in one sitting,
and the ratio of their frontend CPU per token.

What it measures
----------------
Two servers on this machine: ours (``python -m server`` with ``--ours`` ARGS, by default
the sim engine at 8 ms per step) and a peer started from ``--peer``, a command line in which
``{port}`` is replaced by a free port. Each is started, then waited for (``GET /health``
200, or ``GET /v1/models`` 200 where ``/health`` is a 404; ``--ready-timeout`` bounds it);
both stay up for the whole sitting. Then ``--rounds`` rounds: in each, the same closed-loop
streaming load (bench/loadgen.py's client, run in this process: ``--concurrency``,
``--max-tokens``, ``--prompt-tokens``, ``--duration`` or ``--requests``, ``--endpoint``;
``--loadgen`` passes any other loadgen option) runs against one server, then the other,
the order swapped every round (ours first in odd rounds) so that a drift of the machine
does not fall on one side.

The frontend CPU of each run is loadgen's (``/proc``, over its measured window) per delivered
token. Ours: the process started and the frontends of a ``--api-servers`` supervisor; its
engine workers are not counted. The peer (``--peer-frontend-pids``): ``listening`` (the
default) counts the command's process and every process that holds the listening socket
(vLLM's API server, or API servers) but those matching ``--peer-workers`` (an engine
process forked after the socket was bound holds it too); ``tree`` counts its whole process tree less the
processes whose command line matches ``--peer-workers`` (vLLM titles its engine processes
``VLLM::EngineCore`` and ``VLLM::Worker``). Whatever is not frontend is reported as engine
CPU. The idle server's CPU during the other's run is shown too (both share the machine).

The ratio is ours / peer frontend CPU per token, per round (both runs of a round are next
to each other in time), and its median over the rounds is the figure; the range is shown.
Knobs of the peer's own (vLLM's ``--stream-interval``, ...) go into its command line.

Example (options whose value starts with a dash take it after ``=``)::

    python bench/against.py --peer "python -m server --port {port} --stream-interval-ms 20"
    python bench/against.py --rounds 3 --concurrency 128 --max-tokens 256 --duration 20 \\
        --ours="--engine vllm --model-path /models/qwen --model m" \\
        --peer "python -m vllm.entrypoints.openai.api_server --model /models/qwen \\
                --served-model-name m --port {port}" \\
        --loadgen="--extra-body '{\\"ignore_eos\\": true}'"

Output: a line per run (and for a run with errors, loadgen's first ones, its warm-up's
included), a table per round, a line with the ratio of each round and their
range, then as the last line ``ratio: X.XX``. Exit status: 0, 1 when requests failed (the
ratio is still printed) or no ratio could be computed (``ratio: n/a``), 2 when a server did
not start or an option is wrong, 130 when interrupted; the servers are stopped in every case.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen_lib import cli, smoke  # noqa: E402
from loadgen_lib.procstat import (CLK_TCK, CpuMeter, descendants,  # noqa: E402
                                  pids_listening_on, read_stat)
from loadgen_lib.runner import run_benchmark  # noqa: E402
from loadgen_lib.spawn import REPO_ROOT, _child_setup, free_port  # noqa: E402
from loadgen_lib.target import GET_ERRORS, Target, simple_get  # noqa: E402

OURS = "--engine sim --sim-itl-ms 8 --engine-workers 1 --disable-log-requests"
#: --smoke's peer: our own server, as ours (so the ratio is about 1).
SMOKE_PEER = f"{shlex.quote(sys.executable)} -m server --host 127.0.0.1 --port {{port}} {OURS}"


def say(msg: str) -> None:
    print(f"against: {msg}", file=sys.stderr, flush=True)


class NotReady(Exception):
    """A server that did not start, exited, or did not answer in time."""


class Server:
    """One server's processes: started in a session of their own (Ctrl-C on the terminal
    reaches only this script, which stops them in order), output to a log file (removed
    when the server exits with status 0)."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name, self.port = name, free_port()
        self.cmd = [part.replace("{port}", str(self.port)) for part in cmd]
        self.log_path = Path(f"/tmp/against-{name}-{os.getpid()}.log")
        self.seen: dict[int, str | None] = {}  # its processes seen, for stop(): start times
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(self.cmd, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True,
                                             preexec_fn=lambda: _child_setup(None))
            except OSError as exc:
                self.log_path.unlink()
                raise NotReady(f"{name} could not start: {exc}") from None
        say(f"{name} (pid {self.proc.pid}): {shlex.join(self.cmd)}  (log {self.log_path})")

    def tree(self) -> list[int]:
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        self.seen.update((pid, _start_time(pid)) for pid in pids if pid not in self.seen)
        return pids

    def cpu_ticks(self) -> int:
        return sum(st[1] for st in map(read_stat, self.tree()) if st is not None)

    async def wait_ready(self, timeout: float) -> None:
        target, last = Target(f"http://127.0.0.1:{self.port}"), "no answer"
        with trio.move_on_after(timeout):
            while self.proc.poll() is None:
                try:
                    status, _ = await simple_get(target, "/health")
                    if status == 404:
                        status, _ = await simple_get(target, "/v1/models")
                    if status == 200:
                        self.tree()
                        return
                    last = f"status {status}"
                except GET_ERRORS as exc:
                    last = f"{type(exc).__name__}: {exc}"
                await trio.sleep(0.2)
            raise NotReady(self.failure(f"exited with status {self.proc.returncode} "
                                        "before it was ready"))
        raise NotReady(self.failure(f"not ready after {timeout:g} s ({last})"))

    def failure(self, what: str) -> str:
        tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
        return f"{self.name} {what}; the last lines of its output:\n" + "\n".join(tail)

    def stop(self, grace: float) -> None:
        """SIGTERM to the process started, up to ``grace`` s for it to exit (stopping its
        own), then SIGKILL to whatever is left of its tree and its process group."""
        if self.proc.poll() is None:
            self.tree()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                say(f"{self.name} still running {grace:g} s after SIGTERM: SIGKILL")
        left = [pid for pid, start in self.seen.items() if _start_time(pid) == start]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # (gone since we looked)
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            code: int | str = self.proc.wait(10)
        except subprocess.TimeoutExpired:  # (SIGKILLed, yet not reaped: stuck in the kernel)
            code = "unknown: not reaped 10 s after SIGKILL"
        if code == 0:
            self.log_path.unlink(missing_ok=True)
        killed = f", killed {' '.join(map(str, left))}" if left else ""
        seen = f"; processes {' '.join(map(str, sorted(self.seen)))}" if self.seen else ""
        say(f"{self.name} stopped (exit status {code}{killed}{seen})"
            + ("" if code == 0 else f"; its log: {self.log_path}"))


def _start_time(pid: int) -> str | None:
    """When a live process started (/proc/PID/stat's field 22), None for one gone or a
    zombie: with the pid, it names the process (a pid can be taken again)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else fields[19].decode()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def peer_meter(server: Server, args) -> CpuMeter:
    """The peer's CPU meter: which of its processes are frontend, as --peer-frontend-pids
    says (the process started always is)."""
    workers = re.compile(args.peer_workers)
    if args.peer_frontend_pids == "listening":
        # (an engine process forked after the listener was bound holds it too: not counted)
        listening = {pid for pid in pids_listening_on(server.port)
                     if not workers.search(_cmdline(pid))}
        return CpuMeter(server.proc.pid, None, True, is_frontend=listening.__contains__)
    return CpuMeter(server.proc.pid, None, True,
                    is_frontend=lambda pid: not workers.search(_cmdline(pid)))


async def sitting(args, load: list[str], servers: dict[str, Server]) -> tuple[list[dict], str]:
    """Start both servers and run the rounds (:func:`run_rounds`) until done, a server fails
    or SIGINT or SIGTERM comes; returns the rows and what stopped it ("" when done)."""
    rows: list[dict] = []
    stopped = ""

    async def on_signal(scope: trio.CancelScope) -> None:
        nonlocal stopped
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                stopped = f"interrupted ({signal.Signals(signum).name})"
                scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signal, nursery.cancel_scope)
        try:
            await run_rounds(args, load, servers, rows)
        except NotReady as exc:
            stopped = str(exc)
        nursery.cancel_scope.cancel()
    return rows, stopped


async def run_rounds(args, load: list[str], servers: dict[str, Server], rows: list) -> None:
    """Start both servers (the peer first: it may load a model for minutes), then run the
    rounds, adding one row per run to ``rows``."""
    for name, cmd in (("peer", shlex.split(args.peer)),
                      ("ours", [sys.executable, "-m", "server", "--host", "127.0.0.1",
                                "--port", "{port}", *shlex.split(args.ours)])):
        servers[name] = Server(name, cmd)
        await servers[name].wait_ready(args.ready_timeout)
    for r in range(1, args.rounds + 1):
        for name in ("ours", "peer") if r % 2 else ("peer", "ours"):
            server, other = servers[name], servers["peer" if name == "ours" else "ours"]
            lg = cli.parse_args(["--url", f"http://127.0.0.1:{server.port}", *load])
            lg.pid = [server.proc.pid]
            idle0, t0 = other.cpu_ticks(), time.monotonic()
            meter = peer_meter(server, args) if name == "peer" else None
            try:
                s = await run_benchmark(lg, progress=False, meter=meter)
            except (ValueError, ConnectionError, OSError) as exc:
                raise NotReady(server.failure(f"failed in round {r}: {exc}")) from None
            idle = 100.0 * (other.cpu_ticks() - idle0) / CLK_TCK / (time.monotonic() - t0)
            server.tree()
            rows.append({"round": r, "server": name, "idle_other_cpu_percent": round(idle, 1),
                         "events_per_token": round(s["content_events"] / s["delivered_tokens"], 3)
                         if s["delivered_tokens"] else None, **s})
            say(f"round {r} {name}: {s['requests']} requests, {s['errors']} errors, "
                f"frontend {s['frontend_cpu_us_per_token']} us/token")
            for why in _failures(s):
                say(f"round {r} {name}: {why}")


def _failures(summary: dict) -> list[str]:
    """Why a run's figures are not to be trusted, in a line each: loadgen stopped it
    (``--max-errors``: a warm-up that failed throughout ends the run before it measures
    anything), and the first errors of its warm-up and of its measured window."""
    lines = [f"loadgen {summary['aborted']}"] if summary.get("aborted") else []
    for key, what in (("warmup_error_samples", "warm-up"), ("error_samples", "measured")):
        lines += [f"{what} error: {sample}"
                  for sample in list(dict.fromkeys(summary.get(key, [])))[:2]]
    return lines


COLUMNS = (("server", "server", "{}"), ("tokens/s", "delivered_tokens_per_s", "{:,.0f}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"),
           ("frontend CPU %", "frontend_cpu_percent", "{:.1f}"),
           ("frontend us/token", "frontend_cpu_us_per_token", "{:.1f}"),
           ("engine us/token", "worker_cpu_us_per_token", "{:.1f}"),
           ("events/token", "events_per_token", "{:.3f}"),
           ("other server idle CPU %", "idle_other_cpu_percent", "{:.1f}"),
           ("errors", "errors", "{}"))


def report(rows: list[dict]) -> tuple[float | None, int]:
    """Print a table per round and the ratios; returns the median ratio and the exit status."""
    ratios = []
    for r in sorted({row["round"] for row in rows}):
        pair = {row["server"]: row for row in rows if row["round"] == r}
        print(f"\nround {r}\n| " + " | ".join(c[0] for c in COLUMNS) + " |\n"
              + "|---" * len(COLUMNS) + "|")
        for row in (pair["ours"], pair["peer"]):
            print("| " + " | ".join("-" if row[key] is None else fmt.format(row[key])
                                    for _, key, fmt in COLUMNS) + " |")
        ours, peer = (pair[k]["frontend_cpu_us_per_token"] for k in ("ours", "peer"))
        if ours is not None and peer:
            ratios.append(ours / peer)
    failed = any(row["errors"] or row["incomplete_streams"] or _failures(row) for row in rows)
    if not ratios:
        print("\nno ratio: a run of each round delivered no token or its CPU could not be read"
              + (" (its errors are above)" if failed else ""))
        return None, 1
    print(f"\nours / peer frontend CPU per token, per round: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; range {min(ratios):.2f}-{max(ratios):.2f}; "
          f"the figure is their median")
    return statistics.median(ratios), 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", default=OURS,
                   help="our server's arguments (python -m server), as --ours='--engine ...'")
    p.add_argument("--peer", help="the peer's command line, with {port} where its port goes")
    p.add_argument("--peer-frontend-pids", choices=("listening", "tree"), default="listening",
                   help="the peer's frontend: its command's process and those holding the "
                   "listening socket (default), or its whole tree; either but --peer-workers")
    p.add_argument("--peer-workers", default="EngineCore|Worker", metavar="REGEX",
                   help="the command lines of the peer's engine side (not its frontend)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    how_long = p.add_mutually_exclusive_group()
    how_long.add_argument("--duration", type=float, help="seconds per run (default 20)")
    how_long.add_argument("--requests", type=int, help="requests per run")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="chat")
    p.add_argument("--loadgen", default="", metavar="ARGS",
                   help="more bench/loadgen.py options, as --loadgen='--itl-ms 20 ...'")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--stop-grace", type=float, default=30.0,
                   help="seconds a server has after SIGTERM before SIGKILL")
    # (1,024 tokens a run: enough CPU ticks of 10 ms for a ratio on a fast machine too)
    args = smoke.parse_args(p, argv, rounds=2, concurrency=8, max_tokens=32, prompt_tokens=8,
                            requests=32, ready_timeout=120.0, peer=SMOKE_PEER)
    if args.smoke and args.peer == SMOKE_PEER:
        smoke.skipped("a peer server: our own is the peer (the ratio is about 1)")
    if not args.peer or "{port}" not in args.peer:
        p.error("--peer must be the peer's command line with {port} where its port goes, e.g. "
                "--peer 'vllm serve MODEL --port {port}'")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    load = ["--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
            "--prompt-tokens", str(args.prompt_tokens), "--endpoint", args.endpoint,
            *(["--requests", str(args.requests)] if args.duration is None and args.requests
              else ["--duration", str(args.duration or 20.0)]), *shlex.split(args.loadgen)]
    cli.parse_args(["--url", "http://127.0.0.1:1", *load])  # (a wrong option: exit 2 now)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"commit {commit}", flush=True)
    servers: dict[str, Server] = {}
    try:
        rows, stopped = trio.run(sitting, args, load, servers)
        if stopped:
            say(stopped)
    finally:
        for server in reversed(servers.values()):
            try:
                server.stop(args.stop_grace)
            except Exception as exc:  # (the next one is stopped all the same)
                say(f"{server.name}: stopping failed: {exc!r}")
    if stopped:
        return 130 if stopped.startswith("interrupted") else 2
    ratio, code = report(rows)
    print(f"ratio: {'n/a' if ratio is None else f'{ratio:.2f}'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
