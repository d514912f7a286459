"""One whole benchmark run: find the model, set up the CPU measurement, run the warmup and
the measured phase with the reactor and the progress line, and summarize."""

from __future__ import annotations

import json
import resource
import time

import trio

from .client import Context, Phase, run_phase
from .procstat import CpuMeter, read_stat, server_pid_from_port
from .report import log, make_plot, progress_task, summarize
from .stats import Stats
from .target import GET_ERRORS, Target, api_path, simple_get


async def discover_model(target: Target) -> tuple[str, str | None]:
    """The first model id of GET /v1/models, else "sim" (with the reason)."""
    try:
        status, body = await simple_get(target, api_path(target.base_path, "models"))
    except GET_ERRORS as exc:
        return "sim", f"GET /v1/models failed ({type(exc).__name__}: {exc})"
    if status != 200:
        return "sim", f"GET /v1/models returned {status}"
    try:
        return str(json.loads(body)["data"][0]["id"]), None
    except (ValueError, KeyError, IndexError, TypeError):
        return "sim", "GET /v1/models: no model id in the response"


def _cpu_meter(args, target: Target) -> CpuMeter | None:
    """The meter of the server's CPU time that ``--pid`` / ``--server-pids-from-port`` ask
    for, or None."""
    frontend = args.pid[0] if args.pid else None
    if frontend is None and args.server_pids_from_port:
        frontend = server_pid_from_port(target.port)
        if frontend is None:
            log(f"no process found listening on port {target.port}; CPU time not measured")
    if frontend is None:
        return None
    for pid in args.pid or [frontend]:
        if read_stat(pid) is None:
            log(f"no process {pid} (or /proc/{pid}/stat is unreadable); its CPU time "
                "will be missing")
    explicit = args.pid[1:] if args.pid and len(args.pid) > 1 else None
    return CpuMeter(frontend, explicit, auto_workers=explicit is None)


async def run_benchmark(args, *, progress: bool | None = None) -> dict:
    """Run the whole benchmark described by ``args`` (from :func:`parse_args`); returns the
    summary dict (see :func:`summarize`)."""
    target = Target(args.url)
    await target.resolve()
    model = args.model
    if model is None:
        model, note = await discover_model(target)
        if note:
            log(f"{note}; using model {model!r}")
    ctx = Context(args, target, model)
    meter = _cpu_meter(args, target)
    if progress is None:
        progress = not args.quiet
    state: dict = {}
    aborted = None
    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(ctx.reactor.run)
            if progress:
                outer.start_soon(progress_task, ctx, state)
            if args.warmup > 0:
                state.update(phase="warmup", total=None)
                warm = Phase(ctx, max_requests=args.max_requests, duration=args.warmup,
                             stats=Stats(False))
                await run_phase(ctx, warm)
                ctx.live_done = ctx.live_errors = 0
                log(f"warmup: {warm.stats.requests} requests, {warm.stats.errors} errors")
            stats = Stats(record_timeline=bool(args.plot))
            if args.duration is not None:
                phase = Phase(ctx, max_requests=args.max_requests, duration=args.duration,
                              stats=stats)
                state.update(phase="run", total=None)
            else:
                phase = Phase(ctx, max_requests=args.requests, duration=None, stats=stats)
                state.update(phase="run", total=args.requests)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            wakeups0, reads0 = ctx.reactor.wakeups, ctx.reactor.reads
            if meter is not None:
                meter.start()
            with trio.move_on_after(args.time_limit) as cs:
                await run_phase(ctx, phase)
            if cs.cancelled_caught:
                stats.t_end = time.perf_counter()
                aborted = f"time limit of {args.time_limit} s reached (--time-limit)"
            cpu = meter.stop() if meter is not None else None
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            outer.cancel_scope.cancel()
    finally:
        for client in ctx.clients:
            client.close()
    loadgen_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    summary = summarize(args, stats, cpu=cpu, loadgen_cpu_s=loadgen_cpu, model=model)
    summary["connections_opened"] = ctx.connections_opened
    summary["loadgen_wakeups"] = ctx.reactor.wakeups - wakeups0
    summary["loadgen_reads"] = ctx.reactor.reads - reads0
    if phase.stopped or aborted:
        summary["aborted"] = aborted or phase.stopped
    if args.plot:
        summary["plot"] = make_plot(args.plot, stats, summary)
    return summary
