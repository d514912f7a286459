"""One whole benchmark run: find the model, set up the CPU measurement, run the clients (the
warmup, then the measured window, without a pause between them) with the reactor and the
progress line, and summarize."""

from __future__ import annotations

import json
import resource

import trio

from .client import Context, Schedule, run_clients
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


class _Window:
    """What is measured over the measured window: the server's CPU time, this process's CPU
    time and the reactor's counters, read when the window starts and when it ends."""

    def __init__(self, ctx: Context, meter: CpuMeter | None, state: dict, args) -> None:
        self.ctx = ctx
        self.meter = meter
        self.state = state
        self.args = args
        self.cpu: dict | None = None
        # --time-limit bounds the measured run: its deadline is set when the window starts
        self.time_limit = trio.CancelScope()
        self.loadgen_cpu_s = 0.0
        self.wakeups = self.reads = 0

    def start(self, schedule: Schedule) -> None:
        ctx = self.ctx
        self.time_limit.deadline = trio.current_time() + self.args.time_limit
        if self.meter is not None:
            self.meter.start()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self._wakeups0, self._reads0 = ctx.reactor.wakeups, ctx.reactor.reads
        if schedule.warmup > 0:
            warm = schedule.warm_stats
            log(f"warmup: {schedule.warm_issued} requests started, {warm.requests} done, "
                f"{warm.errors} errors")
            if warm.error_samples:  # (the measured window's are in the summary)
                log(f"warmup: first error: {warm.error_samples[0]}")
        ctx.live_done = ctx.live_errors = 0
        self.state.update(phase="run",
                          total=self.args.requests if self.args.duration is None else None)

    def end(self, schedule: Schedule) -> None:
        ctx = self.ctx
        if self.meter is not None:
            self.cpu = self.meter.stop()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        ru0 = self._ru0
        self.loadgen_cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        self.wakeups = ctx.reactor.wakeups - self._wakeups0
        self.reads = ctx.reactor.reads - self._reads0
        self.state.update(phase="finishing")


async def run_benchmark(args, *, progress: bool | None = None,
                        meter: CpuMeter | None = None) -> dict:
    """Run the whole benchmark described by ``args`` (from :func:`parse_args`); returns the
    summary dict (see :func:`summarize`). The server's CPU time is read by ``meter`` if given
    (bench/against.py's), else as ``--pid`` / ``--server-pids-from-port`` say.

    One continuous run: the clients start over ``args.ramp_up`` seconds and send requests
    back to back; those started in the first ``args.warmup`` seconds are the warmup, then
    ``args.requests`` requests (or those started in ``args.duration`` seconds) are measured,
    and the clients stop. See :class:`Schedule`.
    """
    target = Target(args.url)
    await target.resolve()
    model = args.model
    if model is None:
        model, note = await discover_model(target)
        if note:
            log(f"{note}; using model {model!r}")
    ctx = Context(args, target, model)
    if meter is None:
        meter = _cpu_meter(args, target)
    if progress is None:
        progress = not args.quiet
    state: dict = {"phase": "warmup" if args.warmup > 0 else "run", "total": None}
    window = _Window(ctx, meter, state, args)
    streams: list = []  # every stream's event times, for the steady-state rate
    stats = Stats(record_timeline=bool(args.plot), streams=streams)
    schedule = Schedule(
        ctx, warmup=args.warmup, duration=args.duration,
        requests=args.requests if args.duration is None else args.max_requests,
        warmup_cap=args.max_requests, stats=stats, warm_stats=Stats(False, streams),
        on_start=window.start, on_end=window.end)
    aborted = None
    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(ctx.reactor.run)
            if progress:
                outer.start_soon(progress_task, ctx, state)
            with window.time_limit as cs:
                await run_clients(ctx, schedule, args.ramp_up)
            if cs.cancelled_caught and not schedule.finished:
                schedule.finish(now=True)
                aborted = f"time limit of {args.time_limit} s reached (--time-limit)"
            outer.cancel_scope.cancel()
    finally:
        for client in ctx.clients:
            client.close()
    summary = summarize(args, stats, cpu=window.cpu, loadgen_cpu_s=window.loadgen_cpu_s,
                        model=model)
    summary["warmup_requests"] = schedule.warm_issued
    if schedule.warm_stats.errors:
        summary["warmup_errors"] = schedule.warm_stats.errors
        summary["warmup_error_samples"] = schedule.warm_stats.error_samples
    summary["connections_opened"] = ctx.connections_opened
    summary["loadgen_wakeups"] = window.wakeups
    summary["loadgen_reads"] = window.reads
    if schedule.stopped or aborted:
        summary["aborted"] = aborted or schedule.stopped
    if args.plot:
        summary["plot"] = make_plot(args.plot, stats, summary)
    return summary
