"""The command line: options, their checks, and :func:`main` (run, print the table and the
JSON line, exit status)."""

from __future__ import annotations

import argparse
import json
import resource

import trio

from .report import format_table, log
from . import smoke
from .runner import run_benchmark
from .spawn import SpawnedServer
from .target import check_loopback_url


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return v


def _non_negative_float(s: str) -> float:
    v = float(s)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError("must be a non-negative number")
    return v


def _seconds_or_auto(s: str):
    if s.strip().lower() == "auto":
        return "auto"
    try:
        return _non_negative_float(s)
    except ValueError:
        raise argparse.ArgumentTypeError("must be 'auto' or a number of seconds") from None


def _json_object(s: str) -> dict:
    try:
        v = json.loads(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one and the help text does not mention it."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen.py",
        description="Closed-loop streaming load generator for OpenAI-compatible servers on "
                    "this machine (loopback only). Prints a progress line (stderr), a summary "
                    "table and a final JSON line (stdout).",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument("--url", default="http://127.0.0.1:8000",
                   help="base URL of the server (loopback hosts only; '/v1' is added unless "
                        "the path already ends with it)")
    g.add_argument("--endpoint", choices=("completions", "chat", "responses"),
                   default="completions",
                   help="POST /v1/completions, /v1/chat/completions or /v1/responses")
    g.add_argument("--model", default=None,
                   help="model name (default: the first id of GET /v1/models, else 'sim')")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--spawn-server", metavar="ARGS", default=None,
                   help="start 'python -m server --host 127.0.0.1 --port FREE_PORT ARGS', wait "
                        "for GET /health to return 200, run the load against it (--url is "
                        "ignored), then stop it with SIGINT (SIGKILL after 10 s). Its CPU time "
                        "is measured (frontend = that process, workers = its descendants)")
    g.add_argument("--server-module", default="server",
                   help="module that --spawn-server runs with 'python -m'")
    g.add_argument("--server-log", default=None,
                   help="file for the spawned server's output (default: a temporary file)")
    g.add_argument("--health-timeout", type=_positive_float, default=60.0,
                   help="seconds to wait for the spawned server's GET /health to return 200")

    g = p.add_argument_group("load")
    g.add_argument("--concurrency", "-c", type=_positive_int, default=32,
                   help="number of clients, each sending requests back to back on its own "
                        "keep-alive connection")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--requests", "-n", type=_positive_int, default=None,
                   help="total measured requests (default 256 unless --duration is given)")
    m.add_argument("--duration", "-d", type=_positive_float, default=None,
                   help="seconds (after the warmup) during which new measured requests are "
                        "started; in-flight ones are then allowed to finish and no new one "
                        "starts")
    g.add_argument("--ramp-up", type=_seconds_or_auto, default="auto", metavar="S|auto",
                   help="spread the clients' first requests: client i (0-based) sends its "
                        "first one i * S / concurrency seconds after the start. With requests "
                        "of equal length a closed loop keeps the phase it starts with, so "
                        "clients started together stay in lockstep (bursts of 'concurrency' "
                        "arrivals every request time, and a TTFT made of that queue). 'auto' "
                        "(default): the nominal duration of one request, max_tokens * itl_ms "
                        "/ 1000 s, which spreads the arrivals evenly; 0: all at once. The "
                        "ramp-up is part of the warmup when there is one: use --warmup >= the "
                        "ramp-up for steady-state figures")
    g.add_argument("--burst", action="store_true",
                   help="one wave: every client sends one request at the same instant "
                        "(--ramp-up 0, --requests = --concurrency, no warmup); the table adds "
                        "the wave's wall time against the ideal, max_tokens * itl_ms: every "
                        "request served at once, one token per engine step")
    g.add_argument("--warmup", type=_non_negative_float, default=None,
                   help="seconds of load before the measured window, without a pause between "
                        "them: requests started in the warmup are not counted (not even when "
                        "they end in the window), the ones started after it are. Default: "
                        "the ramp-up with --duration (so that the window starts in the "
                        "steady state), 0 with --requests (the ramp-up is then measured)")
    g.add_argument("--prompt-tokens", type=_positive_int, default=128,
                   help="prompt length in whitespace-separated words (the sim engine counts "
                        "one token per word; the first word is unique per request)")
    g.add_argument("--max-tokens", type=_positive_int, default=128,
                   help="max_tokens of each request (output length)")
    g.add_argument("--include-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="send stream_options.include_usage; delivered tokens come from the "
                        "usage chunk (else one token per content event)")
    g.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="JSON object merged into every request body, e.g. "
                        "'{\"temperature\": 0}'")
    g.add_argument("--itl-ms", type=_positive_float, default=8.0,
                   help="the engine's inter-token latency (set it to the server's, e.g. "
                        "its --sim-itl-ms), only to compute offered_tokens_per_s = "
                        "concurrency * 1000 / itl_ms and the 'auto' ramp-up")

    g = p.add_argument_group("limits")
    g.add_argument("--request-timeout", type=_positive_float, default=120.0,
                   help="seconds a request may take in all before it counts as an error")
    g.add_argument("--time-limit", type=_positive_float, default=900.0,
                   help="hard limit on the measured run in seconds (counted from the end of "
                        "the warmup); in-flight requests are cancelled and the result is "
                        "marked aborted")
    g.add_argument("--max-requests", type=_positive_int, default=1_000_000,
                   help="upper bound on the requests started by a --duration run, and on "
                        "those of the warmup (which ends early when it is reached)")
    g.add_argument("--max-errors", type=_positive_int, default=1000,
                   help="stop starting requests after this many errors")

    g = p.add_argument_group("CPU measurement")
    g.add_argument("--pid", type=int, action="append", default=None,
                   help="repeatable; the first is the frontend, the others its workers. With a "
                        "single --pid its descendant processes are taken as the workers")
    g.add_argument("--server-pids-from-port", action="store_true",
                   help="find the frontend as the process listening on the URL's port "
                        "(/proc/net/tcp + /proc/*/fd) and its workers as its descendants")

    g = p.add_argument_group("output")
    g.add_argument("--json-out", default=None, metavar="FILE",
                   help="also write the JSON summary (indented) to FILE")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot TTFT, per-request mean gap and throughput over time "
                        "(needs matplotlib; skipped with a message if missing)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = smoke.parse_args(parser, argv, spawn_server="--engine-workers 1", concurrency=2,
                            requests=4, prompt_tokens=8, max_tokens=8)
    if args.burst:
        given = [opt for opt, value in (("--requests", args.requests), ("--duration", args.duration),
                                        ("--warmup", args.warmup)) if value is not None]
        if args.ramp_up != "auto":
            given.append("--ramp-up")
        if given:
            parser.error(f"--burst sets {', '.join(given)} itself")
        args.requests, args.ramp_up, args.warmup = args.concurrency, 0.0, 0.0
    if args.requests is None and args.duration is None:
        args.requests = 256
    if args.ramp_up == "auto":
        args.ramp_up = args.max_tokens * args.itl_ms / 1000.0
    if args.warmup is None:
        args.warmup = args.ramp_up if args.duration is not None else 0.0
    elif args.duration is not None and args.warmup < args.ramp_up:
        log(f"note: the ramp-up ({args.ramp_up:g} s) is longer than the warmup "
            f"({args.warmup:g} s): the clients are still starting when the measured window "
            "begins")
    if args.spawn_server is None:
        try:
            check_loopback_url(args.url)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and args.concurrency + 64 > soft:
            want = args.concurrency + 64
            if hard == resource.RLIM_INFINITY or want <= hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            else:
                parser.error(f"--concurrency {args.concurrency} needs more open files than "
                             f"the limit of {hard}")
    except (ValueError, OSError):  # pragma: no cover
        pass
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    try:
        if args.spawn_server is not None:
            server = SpawnedServer(args.spawn_server, args.server_module, args.server_log)
            args.url = server.url
            args.pid = [server.proc.pid]
            try:
                trio.run(server.wait_healthy, args.health_timeout)
            except RuntimeError as exc:
                log(f"spawned server failed: {exc}")
                tail = server.log_tail()
                if tail:
                    log("last lines of its output:\n" + tail)
                return 2
        try:
            summary = trio.run(run_benchmark, args)
        except (ValueError, ConnectionError, OSError) as exc:
            log(f"error: {exc}")
            return 2
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if server is not None:
            code = server.stop()
            log(f"server stopped (exit status {code})")
    print(format_table(summary))
    line = json.dumps(summary, separators=(",", ":"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    print(line, flush=True)
    return 0 if summary["errors"] == 0 and summary["incomplete_streams"] == 0 else 1
