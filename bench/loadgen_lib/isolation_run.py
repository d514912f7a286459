"""The Trio shell of ``bench/isolation.py``: background streams, the heavy request, the
``/health`` prober, the worker watch, and the run of the phases (the arithmetic is in
:mod:`.isolation`, sans-IO).

Everything here shares one process with the readers of the background streams, and a pause
of this process reads as a gap of every stream. So the heavy requests cost it as little as
possible: their bodies are built before the streams start (building the 3.8 MB token-ids
body took ~0.1 s: done between phases, it was charged to the phase before when it began
within a step of its end), each is sent with one ``send_all``, and its answer (up to tens of
MB) is only framed (the HTTP parser, no JSON decoding) while the phase runs. And the
collector is kept from pausing inside a window: what is alive is frozen
(:func:`gc.freeze`) before the streams start and again in the middle of each settle, so a
collection during a window scans only that phase's objects.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time

import trio

from .client import Client, Context, one_request, start_offsets
from .http11 import HTTPResponseParser, ProtocolError, build_request
from .isolation import (HeavyRequest, baseline_reference, gap_summary, heavy_request,
                        largest_gap, stream_points, window_gaps, windows_max_gaps,
                        worker_restarts)
from .openai_api import error_message
from .procstat import descendants
from .report import log
from .stats import Result, percentile
from .target import GET_ERRORS, RECV_SIZE, Target, close_stream, simple_get

_perf = time.perf_counter

#: A heavy phase's last seconds before its answer's last byte (then ``--tail``), reported
#: apart (``end_max_gap_ms``): a big answer is decoded and encoded there, and a long
#: phase's largest gap may lie anywhere else.
END_S = 5.0
#: ``--baseline auto``: this many times as long as the longest heavy phase (so that even
#: that phase's reference is a median, of three windows), and at least MIN_BASELINE_S.
BASELINE_SHARE = 3
MIN_BASELINE_S = 5.0


class _Rec:
    """One background request: its :class:`Result` (filled in live) and whether it ended."""

    __slots__ = ("res", "done")

    def __init__(self, res: Result) -> None:
        self.res = res
        self.done = False


class Background:
    """``streams`` clients sending long streaming completions back to back (the lib's
    :class:`Context`, its reactor reading them), every request kept for the gap arithmetic."""

    def __init__(self, target: Target, model: str, streams: int, max_tokens: int,
                 prompt_tokens: int, request_timeout: float) -> None:
        args = argparse.Namespace(
            endpoint="completions", api_key=None, prompt_tokens=prompt_tokens,
            max_tokens=max_tokens, include_usage=False, extra_body={"ignore_eos": True},
            concurrency=streams, max_errors=float("inf"), request_timeout=request_timeout)
        self.ctx = Context(args, target, model)
        self.recs: list[_Rec] = []

    async def run(self, ramp_up: float) -> None:
        """Run the clients until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.ctx.reactor.run)
            for client, delay in zip(self.ctx.clients,
                                     start_offsets(len(self.ctx.clients), ramp_up)):
                nursery.start_soon(self._client, client, delay)

    async def _client(self, client: Client, delay: float) -> None:
        await trio.sleep(delay)
        try:
            while True:
                mine: list[_Rec] = []

                def attempt(res: Result, mine=mine) -> None:
                    rec = _Rec(res)
                    mine.append(rec)
                    self.recs.append(rec)

                self.ctx.ticket += 1
                res = await one_request(self.ctx, client, self.ctx.ticket, on_attempt=attempt)
                for rec in mine:
                    rec.done = True
                if res.error is not None:
                    await trio.sleep(0.1)  # the server is in trouble: do not spin
        finally:
            client.close()

    def streaming(self) -> int:
        """Clients whose current request has delivered a content event."""
        return sum(1 for rec in self.recs if not rec.done and rec.res.tracker is not None
                   and rec.res.tracker.first is not None)

    def streams(self, now: float) -> list[list[float]]:
        """Every request's points (:func:`.isolation.stream_points`) as of ``now``."""
        out = []
        for rec in self.recs:
            res, t = rec.res, rec.res.tracker
            if t is None:
                continue
            end = None
            if not rec.done:
                end = now
            elif res.error is not None or t.error is not None or res.incomplete:
                end = res.end
            points = stream_points(t.first, list(t.gaps), end)
            if len(points) > 1:
                out.append(points)
        return out

    def window(self, a: float, b: float, now: float) -> dict:
        """What the background streams saw in ``[a, b]``: errors (of requests that ended
        in it), of which ``worker_died``, and the longest wait for a first event of a request
        started in it (not a gap: reported beside)."""
        errors = died = 0
        samples: list[str] = []
        ttft: float | None = None
        for rec in self.recs:
            res, t = rec.res, rec.res.tracker
            if rec.done and a <= res.end <= b:
                msg = res.error or (t.error if t is not None else None)
                if msg is not None:
                    errors += 1
                    code = t.error_code if t is not None else None
                    died += code == "worker_died"
                    if len(samples) < 3:
                        samples.append(f"{code or res.error_kind}: {msg}")
            if a <= res.start <= b:
                first = t.first if t is not None else None
                wait = first - res.start if first is not None else (
                    now - res.start if not rec.done else None)
                if wait is not None and (ttft is None or wait > ttft):
                    ttft = wait
        return {"stream_errors": errors, "worker_died_events": died,
                "stream_error_samples": samples,
                "new_stream_ttft_max_ms": None if ttft is None else round(ttft * 1000, 1)}


class HealthProbe:
    """``GET /health`` on a fresh connection every ``interval`` seconds: (start, latency,
    ok) of each. A window's probes are those in flight during it."""

    def __init__(self, target: Target, interval: float, timeout: float) -> None:
        self.target = target
        self.interval = interval
        self.timeout = timeout
        self.probes: list[tuple[float, float, bool]] = []

    async def run(self) -> None:
        while True:
            t0 = _perf()
            try:
                status, _ = await simple_get(self.target, "/health", timeout=self.timeout)
                ok = status == 200
            except GET_ERRORS:
                ok = False
            self.probes.append((t0, _perf() - t0, ok))
            await trio.sleep(self.interval)

    def window(self, a: float, b: float) -> dict:
        got = [(lat, ok) for t0, lat, ok in self.probes if t0 <= b and t0 + lat >= a]
        return {"health_probes": len(got),
                "health_max_ms": round(max(lat for lat, _ in got) * 1000, 1) if got else None,
                "health_failed": sum(not ok for _, ok in got)}


async def send_heavy(target: Target, heavy: HeavyRequest, req: bytes, timeout: float) -> dict:
    """Send one heavy request on a fresh connection and read its whole answer (bounded by
    ``timeout``). Never raises for what the server does: the outcome is in the dict."""
    out: dict = {"kind": heavy.kind, "status": 0, "request_bytes": len(heavy.body),
                 "response_bytes": 0, "error": None, "timed_out": False}
    head_keep, tail_keep = bytearray(), b""
    t0 = _perf()
    parser = HTTPResponseParser(method="POST")
    with trio.move_on_after(timeout) as cs:
        stream = None
        try:
            stream = await target.connect()
            async with trio.open_nursery() as nursery:

                async def sender() -> None:
                    try:
                        await stream.send_all(req)
                    except (trio.BrokenResourceError, OSError):
                        pass  # the server answered early (e.g. 413) and closed: read it

                nursery.start_soon(sender)
                while not parser.done:
                    data = await stream.receive_some(RECV_SIZE)
                    body = parser.feed(data) if data else parser.feed_eof()
                    if body:
                        out["response_bytes"] += len(body)
                        if len(head_keep) < 65536:
                            head_keep += body[: 65536 - len(head_keep)]
                        tail_keep = (tail_keep + body)[-4096:]
                    if not data:
                        break
                nursery.cancel_scope.cancel()
        except (ProtocolError, OSError, trio.BrokenResourceError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if stream is not None:
                close_stream(stream)
    out["duration_s"] = round(_perf() - t0, 3)
    out["status"] = parser.head.status if parser.head is not None else 0
    if cs.cancelled_caught:
        out["timed_out"] = True
        out["error"] = f"no complete answer within {timeout} s (--heavy-timeout)"
    elif out["status"] not in (0, 200) and out["error"] is None:
        out["error"] = error_message(bytes(head_keep))
    elif out["status"] == 200:
        m = re.search(rb'"completion_tokens":\s*(\d+)', tail_keep)
        if m:
            out["completion_tokens"] = int(m.group(1))
    return out


class WorkerWatch:
    """The server's descendant processes and ``worker_restarts`` from ``/metrics``."""

    def __init__(self, target: Target, server_pid: int) -> None:
        self.target = target
        self.server_pid = server_pid

    async def snapshot(self) -> dict:
        restarts = None
        try:
            status, body = await simple_get(self.target, "/metrics", timeout=30.0)
            if status == 200:
                restarts = worker_restarts(body)
        except GET_ERRORS:
            pass
        return {"pids": set(descendants(self.server_pid)), "restarts": restarts}

    @staticmethod
    def compare(before: dict, after: dict) -> dict:
        lost = sorted(before["pids"] - after["pids"])
        delta = None
        if before["restarts"] is not None and after["restarts"] is not None:
            delta = after["restarts"] - before["restarts"]
        return {"lost_pids": lost, "worker_restarts": delta,
                "restarted": bool(lost) or bool(delta)}


async def wait_status(target: Target, path: str, timeout: float) -> bool:
    """Wait until ``GET path`` answers 200, at most ``timeout`` s (whether it did)."""
    with trio.move_on_after(timeout):
        while True:
            try:
                status, _ = await simple_get(target, path, timeout=5.0)
                if status == 200:
                    return True
            except GET_ERRORS:
                pass
            await trio.sleep(0.2)
    return False


async def _all_streaming(bg: Background, n: int, timeout: float) -> bool:
    with trio.move_on_after(timeout):
        while bg.streaming() < n:
            await trio.sleep(0.1)
        return True
    return False


def _freeze() -> None:
    """Collect, then freeze what is alive (see the module docstring)."""
    gc.collect()
    gc.freeze()


async def _settle(args) -> None:
    """The pause between phases, this process's collection in its middle (far from both
    windows)."""
    await trio.sleep(args.settle / 2)
    _freeze()
    await trio.sleep(args.settle / 2)


async def _phase(args, target: Target, bg: Background, watch: WorkerWatch,
                 heavy: HeavyRequest, req: bytes) -> tuple[float, float, dict]:
    """One heavy phase: (window start, window end, what happened)."""
    kind = heavy.kind
    await _settle(args)
    before = await watch.snapshot()
    log(f"phase {kind}: {heavy.what} ({len(heavy.body):,} bytes)")
    a = _perf()
    result = await send_heavy(target, heavy, req, args.heavy_timeout)
    await trio.sleep(args.tail)
    b = _perf()
    info = await _recover(args, target, bg)
    after = await watch.snapshot()
    info = {"heavy": result, **watch.compare(before, after), **info}
    died = bg.window(a, b, b)["worker_died_events"]
    info["restarted"] = info["restarted"] or died > 0
    # (wall clock too: to line the phase up with a stack sampler's or strace's timestamps)
    log(f"phase {kind}: answer complete at {time.time() - (_perf() - b) - args.tail:.3f} "
        "(unix time)")
    log(f"phase {kind}: HTTP {result['status']} in {result['duration_s']} s"
        + (f" ({result['error']})" if result["error"] else "")
        + ("; a worker RESTARTED" if info["restarted"] else ""))
    return a, b, info


async def _recover(args, target: Target, bg: Background) -> dict:
    """After a phase: wait until ``/health`` answers 200 again and every background stream
    streams again (bounded), so that the next phase starts from the same state (and a
    worker's restart has shown in its pid and counter)."""
    t0 = _perf()
    healthy = await wait_status(target, "/health", args.ready_timeout)
    streaming = healthy and await _all_streaming(bg, args.streams, args.warmup_timeout)
    return {"recovered": streaming, "recovery_s": round(_perf() - t0, 2)}


async def _baseline(args, watch: WorkerWatch, seconds: float) -> tuple[float, float, dict]:
    await _settle(args)
    log(f"phase baseline: {seconds:.1f} s with no heavy request")
    before = await watch.snapshot()
    a = _perf()
    await trio.sleep(seconds)
    b = _perf()
    after = await watch.snapshot()
    return a, b, {"heavy": None, **watch.compare(before, after)}


async def run_phases(args, target: Target, model: str, server_pid: int) -> list[dict]:
    """Background streams, then the baseline phase and one phase per heavy kind (with
    ``--baseline auto``, the heavy phases first, then a baseline three times as long as
    the longest of them, not when one did not recover); returns one dict per phase, the
    baseline's first when it ran (see bench/isolation.py for the fields)."""
    heavies = []  # built now: see the module docstring
    for kind in args.kinds:
        heavy = heavy_request(kind, model, args.tokenize_chars)
        heavies.append((heavy, build_request(
            "POST", heavy.path, target.host_header, heavy.body,
            (("Content-Type", "application/json"), ("Connection", "close")))))
    _freeze()
    bg = Background(target, model, args.streams, args.max_tokens, args.prompt_tokens,
                    request_timeout=args.time_limit)
    probe = HealthProbe(target, args.health_interval, args.heavy_timeout)
    watch = WorkerWatch(target, server_pid)
    windows: list[tuple[str, float, float, dict]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bg.run, args.ramp_up)
        nursery.start_soon(probe.run)
        await _all_streaming(bg, args.streams, args.warmup_timeout)
        log(f"{bg.streaming()} of {args.streams} streams streaming; warmup {args.warmup} s")
        await trio.sleep(args.warmup)
        if args.baseline is not None:
            windows.append(("baseline", *await _baseline(args, watch, args.baseline)))
        recovered = True
        for heavy, req in heavies:
            a, b, info = await _phase(args, target, bg, watch, heavy, req)
            windows.append((heavy.kind, a, b, info))
            if not info["recovered"]:
                log(f"not recovered after {info['recovery_s']} s (/health, or the streams): "
                    "the remaining phases are skipped")
                recovered = False
                break
        if args.baseline is None and recovered:  # auto: three times the longest phase
            longest = max([b - a for _, a, b, _ in windows], default=0.0)
            seconds = max(BASELINE_SHARE * longest, MIN_BASELINE_S)
            windows.insert(0, ("baseline", *await _baseline(args, watch, seconds)))
        now = _perf()
        streams = bg.streams(now)
        nursery.cancel_scope.cancel()
    phases = []
    base = next(((a, b) for name, a, b, _ in windows if name == "baseline"), None)
    for name, a, b, info in windows:
        row = {"phase": name, "window_s": round(b - a, 3), **gap_summary(window_gaps(
            streams, a, b)), **bg.window(a, b, now), **probe.window(a, b), **info}
        where = largest_gap(streams, a, b)
        if where is not None:  # from, to: s after the phase's start
            row["max_gap_at_s"] = [round(t - a, 3) for t in where]
        if info["heavy"] is not None:  # the answer's arrival: where a big one is handled
            end_a = max(a, b - args.tail - END_S)
            end = gap_summary(window_gaps(streams, end_a, b))
            row["end_max_gap_ms"] = end["max_gap_ms"]
            where = largest_gap(streams, end_a, b)
            if where is not None:  # from, to: s after the answer's last byte
                row["end_gap_at_s"] = [round(t - (b - args.tail), 3) for t in where]
            # The same window's largest gap elsewhere in the phase: is the end worse?
            rest = windows_max_gaps(streams, a, end_a, END_S + args.tail)
            if rest:
                ordered = sorted(rest)
                row["other_windows"] = len(ordered)
                row["other_windows_max_gap_ms"] = {
                    q: round(percentile(ordered, q) * 1000, 1) for q in (50, 90, 100)}
        row["pids_lost"] = row.pop("lost_pids")
        ref = None
        if base is not None and name != "baseline":
            ref = baseline_reference(streams, *base, b - a)
        row["baseline_ref_ms"] = None if ref is None else round(ref[0] * 1000, 2)
        row["baseline_windows"] = None if ref is None else ref[1]
        row["added_gap_ms"] = (
            round(row["max_gap_ms"] - row["baseline_ref_ms"], 2)
            if row["max_gap_ms"] is not None and row["baseline_ref_ms"] is not None
            else 0.0 if name == "baseline" else None)
        phases.append(row)
    return phases


def to_json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), default=sorted)
