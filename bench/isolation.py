#!/usr/bin/env python3
"""Does one heavy request hold up everybody else? (issue 23)

Starts the server on a free loopback port (``--engine sim|transformers|vllm``; the last two
on the tiny model of tests/tiny_model.py unless ``--model-path``), runs ``--streams``
background streams (streaming completions, ``ignore_eos``, back to back on keep-alive
connections, the load generator's client and reader: bench/loadgen_lib), and records every
content event's arrival. Then, phase by phase:

* one phase per heavy kind (``--kinds``): one heavy request is sent and its whole answer read,
  whatever its status (at most ``--heavy-timeout`` s), then ``--tail`` s more:

  - ``schema``: chat, ``response_format`` json_schema of 2,000 string properties (~60 KB);
  - ``tokenize``: ``POST /tokenize`` of a 3.5 MB one-word prompt (``--tokenize-mb``);
  - ``token-ids``: completions with a prompt of 1.9M token ids (a 3.8 MB body);
  - ``logprobs``: completions, n=16 x 900 tokens, ``logprobs`` 20, not streamed (~19 MB);
  - ``schema-deep``, ``schema-enum`` (not in the default set): a schema nested 300 deep,
    one with a 100,000-value enum;
  - ``token-strs`` (not in the default set): the ``tokenize`` kind with
    ``return_token_strs`` (its answer carries every token's string too: ~24 MB).

* ``baseline``: no heavy request, three times as long as the longest heavy phase (at least
  5 s), after them (``--baseline auto``, the default; not when a phase did not recover);
  or ``--baseline S`` seconds before them.

Per phase it prints the largest gap between consecutive events of one background stream that
overlaps the phase's window, and its p99 (see bench/loadgen_lib/isolation.py for the
arithmetic); the baseline's largest gap *in a window as long as the phase* (the median over
the baseline's whole windows of that length; a longer window holds larger gaps, so a
long phase against a short baseline would show gap that no heavy request added) and the gap
added to it; the heavy request's status and
duration, the worst ``GET /health`` latency (probed every ``--health-interval`` s on fresh
connections), errors in the background streams (``worker_died`` counted apart), the longest
wait for a first event of a background request started in the window (beside, not a gap),
and whether a worker restarted (a descendant process of the server gone, or
``trio_llm:worker_restarts_total`` grown). The target (issue 23): each heavy kind adds at
most ``--target-ms`` (100) ms to the largest gap, no worker restarts and the background
streams see no error; the verdict is printed per kind. Under the table, per heavy phase: the
largest gap in the answer's last 5 s and ``--tail`` and where it lies, against the largest
gap of each earlier window of that length in the phase (is the end worse than the rest?).

Examples::

    python bench/isolation.py                                   # sim, 64 streams, 4 kinds
    python bench/isolation.py --engine transformers --kinds schema,logprobs
    python bench/isolation.py --streams 8 --kinds tokenize --baseline 2
    taskset -c 0 python bench/isolation.py --pin-server 1       # server on its own core

Bounded: every wait has a limit, the whole run ``--time-limit``. Loopback only. The server
(and its workers) are stopped on any exit, also when this process is killed (the server
gets SIGTERM when its parent dies). Output: progress on stderr, a table, then one JSON line.
Exit status: 0 every kind met the target, 1 one did not (or the run was cut short), 2 setup
error.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.isolation import DEFAULT_KINDS, HEAVY_KINDS, TOKENIZE_CHARS  # noqa: E402
from bench.loadgen_lib.isolation_run import run_phases, to_json, wait_status  # noqa: E402
from bench.loadgen_lib.report import log  # noqa: E402
from bench.loadgen_lib.runner import discover_model  # noqa: E402
from bench.loadgen_lib.spawn import SpawnedServer  # noqa: E402
from bench.loadgen_lib.target import Target  # noqa: E402

#: The tiny model's size: as bench/vllm_frontend.py's, with room for 900-token answers. Its
#: tokens are whole ASCII (see tests/tiny_model.py): with byte tokens, the detokenizer holds
#: text back until a character is whole, and those waits (up to ~15 steps) were most of the
#: largest gaps.
TINY = {"hidden_size": 256, "heads": 4, "layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 2048, "ascii_only": True}


def _kinds(text: str) -> list[str]:
    kinds = list(HEAVY_KINDS) if text == "all" else [k for k in text.split(",") if k]
    bad = [k for k in kinds if k not in HEAVY_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown kind(s) {', '.join(bad) or '(none)'}; known: {', '.join(HEAVY_KINDS)}, all")
    return kinds


def _baseline(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"not 'auto' or a number of seconds above 0: {text!r}")
    return seconds


def _cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset takes it: ``0``, ``0,2``, ``1-3``."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r}") from None
    return frozenset(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=("sim", "transformers", "vllm"), default="sim")
    p.add_argument("--model-path", help="transformers, vllm: a local model (default: the tiny "
                   "model of tests/tiny_model.py, built in a temporary directory)")
    p.add_argument("--server-args", default="", help="more arguments for python -m server")
    p.add_argument("--streams", type=int, default=64, help="background streams")
    p.add_argument("--kinds", type=_kinds, default=list(DEFAULT_KINDS),
                   help=f"heavy kinds, comma-separated, or 'all' ({', '.join(HEAVY_KINDS)})")
    p.add_argument("--tokenize-mb", type=float, default=TOKENIZE_CHARS / 1e6,
                   help="the tokenize kind's one-word prompt, in MB (millions of characters)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens of each background request (default: 2048 with sim, "
                   "1024 otherwise); streams run back to back, so any length works")
    p.add_argument("--prompt-tokens", type=int, default=16, help="background prompt words")
    p.add_argument("--ramp-up", type=float, default=1.0, help="s over which streams start")
    p.add_argument("--warmup", type=float, default=2.0,
                   help="s of streaming before the first phase (once every stream streams)")
    p.add_argument("--warmup-timeout", type=float, default=300.0,
                   help="most s to wait for every stream's first event")
    p.add_argument("--baseline", type=_baseline, default=None, metavar="auto|S",
                   help="the baseline phase: 'auto' (after the heavy phases, three times as "
                        "long as the longest) or S seconds (before them) [default: auto]")
    p.add_argument("--settle", type=float, default=2.0, help="s of pause between phases")
    p.add_argument("--tail", type=float, default=0.5,
                   help="s a heavy phase's window runs on after the answer")
    p.add_argument("--heavy-timeout", type=float, default=600.0,
                   help="most s to wait for a heavy request's answer (the logprobs one takes "
                   "minutes with the transformers engine on a CPU)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="most s to wait, after a phase, for /health to answer 200 again")
    p.add_argument("--health-interval", type=float, default=0.02, help="s between /health probes")
    p.add_argument("--startup-timeout", type=float, default=None,
                   help="most s for the server to become ready (default: 120; vllm 1800)")
    p.add_argument("--time-limit", type=float, default=7200.0, help="most s for the whole run")
    p.add_argument("--target-ms", type=float, default=100.0, help="most added gap allowed")
    p.add_argument("--pin-server", type=_cpus, help="CPUs for the server and its workers")
    p.add_argument("--server-log", help="the server's output (default: a temporary file)")
    return p


def server_args(args, model_path: str | None) -> str:
    """The server's command line for ``--engine`` (then ``--server-args``). With the tiny
    model, vllm gets the CPU settings of bench/vllm_frontend.py (float32, a 1 GiB KV cache);
    with ``--model-path`` only what ``--server-args`` adds."""
    extra = ["--engine", args.engine, "--disable-log-requests"]
    room = args.streams + 32  # the streams and the heavy request's 16 sequences run together
    if args.engine == "transformers":
        extra += ["--model-path", model_path, "--max-batch", str(room)]
    elif args.engine == "vllm":
        extra += ["--model-path", model_path, "--max-batch", str(room)]
        if args.model_path is None:  # the tiny model on vLLM's CPU build
            extra += ["--max-model-len", "2048", "--dtype", "float32",
                      "--engine-arg", f"kv_cache_memory_bytes={1 << 30}"]
    return shlex.join(extra) + " " + args.server_args


def verdict(row: dict, target_ms: float) -> str:
    """``pass``, or ``FAIL (reasons)``: at most ``target_ms`` added, no worker restart, no
    error in the background streams, an answer in time."""
    why = []
    added = row["added_gap_ms"]
    if added is None:
        why.append("no gaps measured" if row["max_gap_ms"] is None
                   else "no baseline (the run stopped early)")
    elif added > target_ms:
        why.append(f"+{added:.0f} ms")
    if row["restarted"]:
        why.append("worker restarted")
    if row["stream_errors"]:
        why.append(f"{row['stream_errors']} stream errors")
    if row["health_failed"]:
        why.append(f"/health failed {row['health_failed']}x")
    if row.get("recovered") is False:
        why.append("not recovered")
    heavy = row["heavy"]
    if heavy and heavy["timed_out"]:
        why.append("no answer")
    elif heavy and heavy["status"] >= 500:
        why.append(f"HTTP {heavy['status']}")
    return "FAIL (" + ", ".join(why) + ")" if why else "pass"


def format_table(phases: list[dict], target_ms: float) -> str:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    head = (f"{'phase':<12} {'heavy':>6} {'heavy s':>8} {'max gap':>8} {'p99 gap':>8} "
            f"{'baseline':>8} {'added':>8} {'/health':>8} {'restart':>7} {'errors':>6} "
            f"{'new TTFT':>8}  verdict")
    lines = [head, f"{'':<12} {'status':>6} {'':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} "
             f"{'max ms':>8} {'':>7} {'':>6} {'max ms':>8}", "-" * len(head)]
    for r in phases:
        h = r["heavy"]
        status = "-" if h is None else ("t/o" if h["timed_out"] else str(h["status"]))
        lines.append(
            f"{r['phase']:<12} {status:>6} {f(h and h['duration_s'], '{:.2f}'):>8} "
            f"{f(r['max_gap_ms']):>8} {f(r['p99_gap_ms']):>8} {f(r['baseline_ref_ms']):>8} "
            f"{f(r['added_gap_ms'], '{:+.1f}'):>8} "
            f"{f(r['health_max_ms']):>8} {'YES' if r['restarted'] else 'no':>7} "
            f"{r['stream_errors']:>6} {f(r['new_stream_ttft_max_ms']):>8}  "
            f"{'' if h is None else verdict(r, target_ms)}")
    lines.append("  baseline: per heavy phase, the median of the largest gaps of the baseline's "
                 "windows as long as that phase (one: the whole baseline, when shorter)")
    for r in phases:
        where = r.get("max_gap_at_s")
        if where is not None:
            lines.append(f"  {r['phase']}: its largest gap from {where[0]:.2f} to {where[1]:.2f} s "
                         "after the phase's start")
    for r in phases:
        if r.get("end_max_gap_ms") is not None:
            where = r.get("end_gap_at_s")
            at = "" if where is None else f" (from {where[0]:+.2f} to {where[1]:+.2f} s)"
            lines.append(f"  {r['phase']}: largest gap in the answer's last 5 s and the tail: "
                         f"{r['end_max_gap_ms']:.1f} ms{at}")
            other = r.get("other_windows_max_gap_ms")
            if other:
                lines.append(f"  {r['phase']}: the same in the phase's {r['other_windows']} "
                             f"earlier windows of that length: median {other[50]:.1f}, "
                             f"p90 {other[90]:.1f}, max {other[100]:.1f} ms")
    for r in phases:
        h = r["heavy"]
        if h is not None and h["error"]:
            lines.append(f"  {r['phase']}: {h['error'][:160]}")
        for sample in r["stream_error_samples"]:
            lines.append(f"  {r['phase']} background: {sample[:160]}")
    return "\n".join(lines)


async def _run(args, server: SpawnedServer) -> dict | None:
    """Wait for the server, run the phases; None when SIGTERM/SIGHUP or the time limit
    cut the run short."""
    result = None
    async with trio.open_nursery() as nursery:

        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
                async for sig in signals:
                    log(f"signal {sig}: stopping")
                    nursery.cancel_scope.cancel()

        nursery.start_soon(on_signals)
        with trio.move_on_after(args.time_limit):
            startup = args.startup_timeout or (1800.0 if args.engine == "vllm" else 120.0)
            await server.wait_healthy(startup)
            target = Target(server.url)
            if not await wait_status(target, "/ready", startup):
                raise RuntimeError(f"server not ready after {startup} s")
            model, why = await discover_model(target)
            if why:
                raise RuntimeError(why)
            phases = await run_phases(args, target, model, server.proc.pid)
            result = {"engine": args.engine, "streams": args.streams,
                      "max_tokens": args.max_tokens, "target_ms": args.target_ms,
                      "server_log": server.log_path, "phases": phases}
        nursery.cancel_scope.cancel()
    return result


def main(argv=None) -> int:
    args = smoke.parse_args(build_parser(), argv, streams=4, tokenize_mb=0.05, max_tokens=64,
                            ramp_up=0.2, warmup=0.5, baseline=0.5, settle=0.2, tail=0.1)
    args.tokenize_chars = round(args.tokenize_mb * 1e6)
    if args.max_tokens is None:
        args.max_tokens = 2048 if args.engine == "sim" else 1024
    tmp = None
    model_path = args.model_path
    server = None
    try:
        if args.engine != "sim" and model_path is None:
            from tests.tiny_model import build_tiny_model

            tmp = tempfile.mkdtemp(prefix="isolation-")
            model_path = str(build_tiny_model(Path(tmp) / "tiny", **TINY))
        server = SpawnedServer(server_args(args, model_path), "server", args.server_log,
                               cpus=args.pin_server)
        try:
            result = trio.run(_run, args, server)
        except RuntimeError as exc:
            log(f"error: {exc}")
            tail = server.log_tail()
            if tail:
                log("last lines of the server's output:\n" + tail)
            return 2
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if server is not None:
            log(f"server stopped (exit status {server.stop()})")
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if result is None:
        log("cut short (signal or --time-limit): no figures")
        return 1
    for row in result["phases"]:
        row["verdict"] = None if row["heavy"] is None else verdict(row, args.target_ms)
    print(format_table(result["phases"], args.target_ms))
    print(to_json(result), flush=True)
    ok = all(r["verdict"] == "pass" for r in result["phases"] if r["verdict"] is not None)
    ran = [r["phase"] for r in result["phases"] if r["phase"] != "baseline"]
    return 0 if (ok or args.smoke) and ran == args.kinds else 1


if __name__ == "__main__":
    sys.exit(main())
