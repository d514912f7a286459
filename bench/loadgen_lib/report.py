"""What the user sees: messages and the progress line on stderr, the summary (a flat JSON-able
dict, :func:`summarize`), the table printed from it and the optional plot.

Definitions:

* TTFT: from just before the request is sent (including connecting, for a new connection) to
  the receipt of the first event with non-empty text.
* gap: time between the receipts of consecutive content events (events with non-empty text)
  of one stream. Events that arrive in the same ``recv`` share a timestamp (gap 0).
* delivered tokens: ``usage.completion_tokens`` of the usage chunk; without one, the number of
  content events.
* errors: requests with an HTTP status other than 200, an ``error`` event (``event: error`` or
  ``data: {"error": ...}``), a connection or protocol error, or a timeout.
* incomplete streams: 200 responses that ended (cleanly or not) without ``data: [DONE]``.
  A stream cut off by the server counts as an error and as incomplete.
* percentiles: nearest rank over all requests (TTFT) or all gaps.
* measured requests: those started after the warmup (the first ``--requests`` of them, or
  those started in the ``--duration`` seconds after it); a request started in the warmup is
  not counted, even when it ends later.
* measured window (``duration_s``): from the end of the warmup until the last measured
  request ended. Every rate (tokens/s, requests/s, events/s) and CPU figure is over this
  window; the server's CPU time is read at both ends of it.
* steady-state tokens/s: tokens delivered (by any request, warmup ones included) from the end
  of the warmup until the run stopped starting requests, while every client was busy, over
  that time; each content event carries its stream's tokens divided by its content events.
  The delivered tokens/s above reads lower by about one request length over the window
  (the last measured requests end after new ones stopped starting); this one does not.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

import trio

from .stats import Stats, percentile, tokens_between

if TYPE_CHECKING:
    from .client import Context


def log(msg: str) -> None:
    print(f"loadgen: {msg}", file=sys.stderr, flush=True)


async def progress_task(ctx: Context, state: dict, *, stream=sys.stderr) -> None:
    """Show the progress of the run until cancelled: one line rewritten in place every 0.5 s
    on a terminal, else a new line every 5 s."""
    tty = stream.isatty()
    interval = 0.5 if tty else 5.0
    t0 = time.perf_counter()
    last_t, last_ev = t0, 0
    width = 0
    try:
        while True:
            await trio.sleep(interval)
            now = time.perf_counter()
            ev = ctx.live_events
            rate = (ev - last_ev) / (now - last_t) if now > last_t else 0.0
            last_t, last_ev = now, ev
            total = state.get("total")
            done = f"{ctx.live_done}/{total}" if total else f"{ctx.live_done}"
            line = (f"[{now - t0:7.1f}s] {state.get('phase', '')} done {done}  in-flight "
                    f"{ctx.inflight}  errors {ctx.live_errors}  content events/s {rate:,.0f}")
            if tty:
                stream.write("\r" + line.ljust(width))
                width = len(line)
            else:
                stream.write(line + "\n")
            stream.flush()
    finally:
        if tty and width:
            stream.write("\r" + " " * width + "\r")
            stream.flush()


def _ms(x):
    return None if x is None else round(x * 1000.0, 3)


def _r(x, nd=3):
    return None if x is None else round(x, nd)


def summarize(args, stats: Stats, *, cpu: dict | None, loadgen_cpu_s: float | None,
              model: str) -> dict:
    """The result as a flat, JSON-able dict."""
    duration = max(stats.t_end - stats.t_start, 1e-9)
    ttfts = sorted(stats.ttfts)
    gaps = sorted(stats.gaps)
    tokens = stats.tokens
    s: dict = {
        "endpoint": args.endpoint,
        "model": model,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "ramp_up_s": _r(args.ramp_up),
        "warmup_s": _r(args.warmup),
        "requests": stats.requests,
        "errors": stats.errors,
        "incomplete_streams": stats.incomplete,
        "duration_s": round(duration, 3),
        "delivered_tokens": tokens,
        "content_events": stats.content_events,
        "delivered_tokens_per_s": round(tokens / duration, 1),
        "offered_tokens_per_s": round(args.concurrency * 1000.0 / args.itl_ms, 1),
        "requests_per_s": round(stats.requests / duration, 2),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p90_ms": _ms(percentile(ttfts, 90)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "ttft_max_ms": _ms(ttfts[-1] if ttfts else None),
        "gap_p50_ms": _ms(percentile(gaps, 50)),
        "gap_p90_ms": _ms(percentile(gaps, 90)),
        "gap_p99_ms": _ms(percentile(gaps, 99)),
        "gap_max_ms": _ms(gaps[-1] if gaps else None),
        "gap_mean_ms": _ms(sum(gaps) / len(gaps) if gaps else None),
        "events_per_s": round(stats.content_events / duration, 1),
        "tokens_per_event": _r(tokens / stats.content_events if stats.content_events else None),
        "frontend_cpu_us_per_token": None,
        "worker_cpu_us_per_token": None,
        "frontend_cpu_percent": None,
        "worker_cpu_percent": None,
        "loadgen_cpu_percent": _r(None if loadgen_cpu_s is None
                                  else 100.0 * loadgen_cpu_s / duration, 1),
    }
    if getattr(args, "burst", False):
        ideal = args.max_tokens * args.itl_ms / 1000.0
        s["burst_ideal_s"] = _r(ideal)
        s["burst_wall_over_ideal"] = _r(duration / ideal)
    s["efficiency"] = _r(s["delivered_tokens_per_s"] / s["offered_tokens_per_s"]
                         if s["offered_tokens_per_s"] else None)
    steady = None
    if stats.streams is not None and stats.t_steady_end > stats.t_start:
        span = stats.t_steady_end - stats.t_start
        steady = tokens_between(stats.streams, stats.t_start, stats.t_steady_end) / span
    s["steady_tokens_per_s"] = _r(steady, 1)
    s["steady_efficiency"] = _r(steady / s["offered_tokens_per_s"]
                                if steady is not None and s["offered_tokens_per_s"] else None)
    if cpu is not None:
        for who, key in (("frontend", "frontend_cpu_s"), ("worker", "workers_cpu_s")):
            cpu_s = cpu[key]
            if cpu_s is not None:
                s[f"{who}_cpu_percent"] = round(100.0 * cpu_s / duration, 1)
                if tokens:
                    s[f"{who}_cpu_us_per_token"] = round(1e6 * cpu_s / tokens, 2)
                if stats.requests:
                    s[f"{who}_cpu_us_per_request"] = round(1e6 * cpu_s / stats.requests, 1)
        s["frontend_pid"] = cpu["frontend_pid"]
        s["frontend_cpu_s"] = _r(cpu["frontend_cpu_s"])
        s["workers"] = [
            dict(w, cpu_percent=round(100.0 * w["cpu_s"] / duration, 1)) for w in cpu["workers"]
        ]
        if cpu["lost_workers"]:
            s["lost_workers"] = cpu["lost_workers"]
    if stats.error_kinds:
        s["error_kinds"] = dict(stats.error_kinds)
        s["error_samples"] = stats.error_samples
    if stats.usage_missing and args.include_usage:
        s["usage_missing"] = stats.usage_missing
    s["http_statuses"] = {str(k): v for k, v in sorted(stats.statuses.items())}
    return s


def format_table(s: dict) -> str:
    def f(v, fmt="{:,.1f}"):
        return "-" if v is None else fmt.format(v)

    rows = [
        ("endpoint / model", f"{s['endpoint']} / {s['model']}"),
        ("concurrency", f"{s['concurrency']}  (prompt {s['prompt_tokens']} tokens, "
                        f"max_tokens {s['max_tokens']})"),
        ("ramp-up / warmup", f"{f(s.get('ramp_up_s'), '{:.3f}')} s / {f(s.get('warmup_s'), '{:.3f}')} s"
                             + (f"  ({s['warmup_requests']} warmup requests not counted)"
                                if s.get("warmup_requests") else "")),
        ("requests", f"{s['requests']}  (errors {s['errors']}, incomplete streams "
                     f"{s['incomplete_streams']})"),
        ("duration", f"{f(s['duration_s'], '{:.2f}')} s  "
                     f"({f(s['requests_per_s'], '{:.1f}')} req/s)"),
        *([("burst wall / ideal", f"{f(s['duration_s'], '{:.3f}')} s / "
                                   f"{f(s['burst_ideal_s'], '{:.3f}')} s  = "
                                   f"{f(s['burst_wall_over_ideal'], '{:.3f}')}x")]
          if s.get("burst_ideal_s") else []),
        ("delivered tokens/s", f"{f(s['delivered_tokens_per_s'])}  (offered "
                               f"{f(s['offered_tokens_per_s'])}, efficiency "
                               f"{f(s['efficiency'], '{:.3f}')})"),
        ("steady-state tokens/s", f"{f(s.get('steady_tokens_per_s'))}  (efficiency "
                                  f"{f(s.get('steady_efficiency'), '{:.3f}')}, while all "
                                  "clients were busy)"),
        ("content events/s", f"{f(s['events_per_s'])}  ({f(s['tokens_per_event'], '{:.3f}')} "
                             "tokens/event)"),
        ("TTFT ms  p50/p90/p99/max", " / ".join(f(s[k], "{:.1f}") for k in
                                                ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                                                 "ttft_max_ms"))),
        ("gap ms   p50/p90/p99/max", " / ".join(f(s[k], "{:.2f}") for k in
                                                ("gap_p50_ms", "gap_p90_ms", "gap_p99_ms",
                                                 "gap_max_ms"))),
        ("frontend CPU", f"{f(s['frontend_cpu_percent'])} %  "
                         f"({f(s['frontend_cpu_us_per_token'])} us/token, "
                         f"{f(s.get('frontend_cpu_us_per_request'))} us/request)"),
        ("worker CPU (all)", f"{f(s['worker_cpu_percent'])} %  "
                             f"({f(s['worker_cpu_us_per_token'])} us/token)"),
    ]
    for w in s.get("workers", []):
        rows.append((f"  worker {w['pid']} ({w['comm']})",
                     f"{w['cpu_s']:.2f} s  ({w['cpu_percent']:.1f} %)"))
    rows.append(("loadgen CPU", f"{f(s['loadgen_cpu_percent'])} %"))
    if s.get("error_kinds"):
        rows.append(("error kinds", json.dumps(s["error_kinds"])))
        for sample in s.get("error_samples", []):
            rows.append(("  e.g.", sample[:160]))
    if s.get("aborted"):
        rows.append(("ABORTED", s["aborted"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def make_plot(path: str, stats: Stats, summary: dict) -> str | None:
    """Latency and throughput over time, as a PNG. Returns None (with a message) if
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("--plot: matplotlib is not installed; no plot written "
             "(pip install matplotlib to get one)")
        return None
    tl = stats.timeline or []
    t0 = stats.t_start
    span = max(stats.t_end - t0, 1e-9)
    nbins = max(1, min(200, int(span / 0.25) + 1))
    width = span / nbins
    tok_bins = [0.0] * nbins
    for start, end, _ttft, _gap, tokens, _err in tl:
        # spread a request's tokens uniformly over its lifetime
        a, b = start - t0, max(end - t0, start - t0 + 1e-9)
        ia, ib = int(a / width), min(int(b / width), nbins - 1)
        per_s = tokens / (b - a)
        for i in range(max(ia, 0), ib + 1):
            lo, hi = max(a, i * width), min(b, (i + 1) * width)
            if hi > lo:
                tok_bins[i] += per_s * (hi - lo) / width
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    xs = [r[0] - t0 for r in tl if r[2] is not None]
    axes[0].scatter(xs, [r[2] * 1000 for r in tl if r[2] is not None], s=4)
    axes[0].set_ylabel("TTFT (ms)")
    xs = [r[0] - t0 for r in tl if r[3] is not None]
    axes[1].scatter(xs, [r[3] * 1000 for r in tl if r[3] is not None], s=4, color="tab:orange")
    axes[1].set_ylabel("mean gap per request (ms)")
    axes[2].plot([(i + 0.5) * width for i in range(nbins)], tok_bins)
    axes[2].axhline(summary["offered_tokens_per_s"], ls="--", color="gray", label="offered")
    axes[2].set_ylabel("delivered tokens/s")
    axes[2].set_ylim(bottom=0)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[2].set_xlabel("time since the end of the warmup (s); points at request start")
    axes[2].legend()
    fig.suptitle(f"{summary['endpoint']} c={summary['concurrency']} "
                 f"prompt={summary['prompt_tokens']} max_tokens={summary['max_tokens']}: "
                 f"{summary['delivered_tokens_per_s']:,.0f} tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log(f"plot written to {path}")
    return path
