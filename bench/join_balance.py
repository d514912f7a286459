"""How fast a worker that joins by DNS gets its share of the load, and how fast one that
leaves stops getting any (issue 45 item 4). Prints the figures; nothing is asserted.

A DNS server on loopback (dnslib's, in a thread) names ``--workers`` listening sim workers
(``127.0.0.2``, ``127.0.0.3``, ... at one port); one frontend finds them through
``--worker-address dns:NAME:PORT``, with the options a user would run (the defaults of
``--dns-min-interval``, ``--dns-max-interval``, ``--dns-drain-grace``, ``--routing``; only
``--dns-server`` points at the bench's server). The records have a TTL of ``--ttl`` seconds
(5: CoreDNS's default for a Kubernetes Service). ``--streams`` clients keep one streamed
completion each in flight, back to back (closed loop). One more worker is started (not in
the records) before the load.

After ``--warmup`` seconds the new worker's address is added to the records; after
``--phase`` seconds more (longer, until it got a request) the first worker's is dropped;
``--phase`` seconds later (longer, until it is drained) the clients stop sending and the
last streams finish. Three sources: each worker's own count of requests running and
waiting, polled every ``--poll`` seconds (a PING over a connection of the bench's own: the
worker's truth); the frontend's ``/metrics``, polled alike (requests routed to each
worker, and its DNS answers); and the frontend's JSON log (when a worker joined, left and
was removed, to the millisecond; which worker index is which address).

Figures, in seconds from each record change. For the added worker: when it joined the
frontend's pool, its first routed request, when its in-flight count first came within 10 %
of its fair share (``streams / workers``), and the most it held (an overshoot shows here).
For the dropped one: when it left the pool, its last routed request, the requests routed
to it once the frontend's answer was in (must be 0), when it held nothing more, and when
the frontend removed it. Then, per second after each change, each worker's mean in-flight
count and the requests routed to it, and the largest gap between two samples (a starved
run says so there). Every stream must end with ``[DONE]`` and no error event: the counts
are printed. The last line is the whole result as JSON.

    python bench/join_balance.py                       # 3 workers + 1, 48 streams, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx
import trio
from dnslib import QTYPE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.loadgen_lib import smoke  # noqa: E402
from bench.loadgen_lib.spawn import REPO_ROOT, SpawnedServer, _child_setup, free_port  # noqa: E402
from server import EngineConfig, open_engine  # noqa: E402
from server.cli import build_parser  # noqa: E402
from server.worker_protocol.handshake import SECRET_ENV, parse_address  # noqa: E402

NAME = "workers.join-balance.test."
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()
_perf = time.perf_counter


# -- the DNS server ------------------------------------------------------------------------


class Records(BaseResolver):
    """The A records of :data:`NAME`, which the bench changes while it runs."""

    def __init__(self, ttl: int) -> None:
        self.ttl = ttl
        self.lock = threading.Lock()
        self.hosts: list[str] = []

    def set(self, *hosts: str) -> None:
        with self.lock:
            self.hosts = list(hosts)

    def resolve(self, request, handler):
        reply = request.reply()
        if str(request.q.qname) == NAME and QTYPE[request.q.qtype] == "A":
            with self.lock:
                for host in self.hosts:
                    reply.add_answer(RR(NAME, QTYPE.A, rdata=A(host), ttl=self.ttl))
        return reply


@contextmanager
def dns_server(records: Records):
    """Serve ``records`` on a free UDP port of 127.0.0.1; yields ``HOST:PORT``."""
    quiet = DNSLogger("-recv,-send,-request,-reply,-truncated,-data")  # (errors only)
    dns = DNSServer(records, address="127.0.0.1", port=0, logger=quiet)
    dns.start_thread()
    try:
        yield "127.0.0.1:%d" % dns.server.server_address[1]
    finally:
        dns.stop()


# -- the workers and what they hold --------------------------------------------------------


def start_worker(address: str, args, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.workers", "--listen", address,
           "--sim-itl-ms", str(args.itl_ms), "--sim-ttft-ms", str(args.ttft_ms)]
    with open(log, "wb") as err:
        return subprocess.Popen(cmd, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: _child_setup(None))


async def wait_listening(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    with trio.fail_after(120):
        for proc, log in zip(procs, logs):
            while "listening on" not in read_text(log):
                if proc.poll() is not None:
                    raise RuntimeError(f"worker exited: {read_text(log)}")
                await trio.sleep(0.05)


class Samples:
    """What the pollers saw: ``held``, (time, {address: running + waiting}) from the
    workers; ``routed``, (time, {worker index: requests routed}, DNS changes) from the
    frontend."""

    def __init__(self) -> None:
        self.held: list[tuple[float, dict[str, int]]] = []
        self.routed: list[tuple[float, dict[int, float], float]] = []


async def poll_workers(addresses: list[str], samples: Samples, period: float) -> None:
    """Ping every worker each ``period`` over a connection of our own (until cancelled)."""
    async with AsyncExitStack() as stack:
        engines = {}
        for address in addresses:
            config = EngineConfig(worker_addresses=(parse_address(address),),
                                  worker_secret=os.environ[SECRET_ENV].encode(),
                                  routing="least-loaded", shutdown_grace=0.3)
            engines[address] = await stack.enter_async_context(open_engine(config))
        while True:
            t = _perf()
            counts = {}
            for address, engine in engines.items():
                (running, waiting), = await engine.ping_all()
                counts[address] = running + waiting
            samples.held.append((t, counts))
            await trio.sleep_until(trio.current_time() + period - (_perf() - t))


ROUTED = re.compile(r'^trio_llm:routed_requests_total\{[^}]*worker="(\d+)"[^}]*\} (\S+)$', re.M)
CHANGES = re.compile(r"^trio_llm:dns_changes_total\{[^}]*\} (\S+)$", re.M)


async def poll_metrics(client: httpx.AsyncClient, url: str, samples: Samples,
                       period: float) -> None:
    while True:
        t = _perf()
        text = (await client.get(url + "/metrics")).text
        routed = {int(m.group(1)): float(m.group(2)) for m in ROUTED.finditer(text)}
        changes = sum(float(m.group(1)) for m in CHANGES.finditer(text))
        samples.routed.append((t, routed, changes))
        await trio.sleep_until(trio.current_time() + period - (_perf() - t))


def worker_indexes(log_text: str) -> dict[str, int]:
    """``{address: index}`` from the frontend's "worker N (ADDRESS) joins the pool" lines."""
    return {m.group(2): int(m.group(1))
            for m in re.finditer(r"worker (\d+) \((\S+)\) joins the pool", log_text)}


# -- the load ------------------------------------------------------------------------------


class Load:
    """The closed-loop clients' tallies."""

    def __init__(self) -> None:
        self.sending = True
        self.sent = self.done = self.error_events = self.http_errors = 0


async def client_loop(load: Load, client: httpx.AsyncClient, url: str, k: int, args) -> None:
    rng = random.Random(args.seed * 1000 + k)
    while load.sending:
        prompt = f"client {k} request {load.sent}: " + " ".join(
            rng.choice(WORDS) for _ in range(args.prompt_words))
        body = {"model": "sim", "prompt": prompt, "max_tokens": args.max_tokens,
                "stream": True}
        load.sent += 1
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                load.http_errors += 1
                await r.aread()
                continue
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    load.done += 1
                elif line.startswith("data: ") and '"error"' in line:
                    load.error_events += 1


# -- the figures (plain functions of the samples) ------------------------------------------


def first_time(samples, since: float, predicate) -> float | None:
    """Seconds from ``since`` to the first sample at or after it that ``predicate`` takes."""
    for t, *values in samples:
        if t >= since and predicate(*values):
            return t - since
    return None


def last_increase(samples, since: float, index: int) -> float:
    """Seconds from ``since`` to the last sample at which worker ``index``'s routed count
    rose (0.0 if it never rose after ``since``)."""
    last, before = 0.0, None
    for t, routed, _ in samples:
        value = routed.get(index, 0.0)
        if t >= since and before is not None and value > before:
            last = t - since
        before = value
    return last


def emptied_for_good(held, since: float, address: str) -> float | None:
    """Seconds from ``since`` to the sample from which ``address`` held nothing, to the
    end (None if it still held something at the last sample)."""
    empty = None
    for t, counts in held:
        if t >= since:
            empty = (empty if empty is not None else t) if counts.get(address, 0) == 0 else None
    return None if empty is None else empty - since


def within(value: float, fair: float, tolerance: float = 0.1) -> bool:
    return abs(value - fair) <= tolerance * fair


def per_second(held, routed, since: float, seconds: int, addresses: list[str],
               indexes: dict[str, int]) -> list[dict]:
    """For each whole second after ``since``: each worker's mean held count, and the
    requests routed to it in that second (the routed counts' rise across it)."""
    rows = []
    for s in range(seconds):
        start, end = since + s, since + s + 1
        in_second = [counts for t, counts in held if start <= t < end]
        row: dict = {"second": s, "held": {}, "routed": {}}
        for address in addresses:
            values = [c.get(address, 0) for c in in_second]
            row["held"][address] = sum(values) / len(values) if values else None
            i = indexes.get(address)
            at = [r.get(i, 0.0) for t, r, _ in routed if start <= t < end]
            before = [r.get(i, 0.0) for t, r, _ in routed if t < start]
            row["routed"][address] = (at[-1] - (before[-1] if before else 0.0)
                                      if at and i is not None else None)
        rows.append(row)
    return rows


def log_events(text: str, offset: float) -> list[tuple[float, str]]:
    """The frontend's JSON log lines as (time, message), times on this process's
    ``perf_counter`` (``offset``: ``time.time()`` less it)."""
    events = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
            wall = datetime.strptime(record["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
        except (ValueError, KeyError, TypeError):
            continue  # (not a log record: a line of a library's own)
        events.append((wall.replace(tzinfo=timezone.utc).timestamp() - offset,
                       record.get("message", "")))
    return events


def event_time(events: list[tuple[float, str]], since: float, pattern: str) -> float | None:
    """Seconds from ``since`` to the first event at or after it whose message has
    ``pattern`` (plain text)."""
    return first_time(events, since, lambda message: pattern in message)


def largest_gap(samples, start: float, end: float) -> float | None:
    """The longest time between two consecutive samples from ``start`` to ``end``."""
    times = [t for t, *_ in samples if start <= t <= end]
    return max((b - a for a, b in zip(times, times[1:])), default=None)


def analyse(samples: Samples, events: list[tuple[float, str]], args, addresses: list[str],
            indexes: dict[str, int], added_at: float, dropped_at: float) -> dict:
    """The figures of the join (``added_at``: the last address added to the records) and
    of the drop (``dropped_at``: the first one taken out)."""
    new, dropped = addresses[-1], addresses[0]
    fair = args.streams / len(addresses)
    join = {
        "resolved_s": event_time(events, added_at, f"({new}) joins the pool"),
        "first_request_s": first_time(samples.routed, added_at, lambda routed, _: routed.get(
            indexes.get(new, -1), 0) > 0),
        "fair_share": fair,
        "within_10pct_s": first_time(samples.held, added_at,
                                     lambda counts: within(counts.get(new, 0), fair)),
        "peak": max((c.get(new, 0) for t, c in samples.held if added_at <= t < dropped_at),
                    default=None),
        "largest_gaps_s": [largest_gap(samples.held, added_at, dropped_at),
                           largest_gap(samples.routed, added_at, dropped_at)],
        "seconds": per_second(samples.held, samples.routed, added_at, int(args.phase),
                              addresses, indexes),
    }
    # (the frontend's DNS answer and the routed counts of one /metrics text: the requests
    # routed to the dropped worker once its answer was in)
    before = max([c for t, _, c in samples.routed if t < dropped_at], default=0.0)
    answered = [r.get(indexes.get(dropped, -1), 0.0)
                for t, r, c in samples.routed if t >= dropped_at and c > before]
    drop = {
        "resolved_s": event_time(events, dropped_at, f"({dropped}) left discovery"),
        "last_request_s": last_increase(samples.routed, dropped_at, indexes.get(dropped, -1)),
        "routed_after_answer": int(answered[-1] - answered[0]) if answered else None,
        "emptied_s": emptied_for_good(samples.held, dropped_at, dropped),
        "removed_s": event_time(events, dropped_at, f"({dropped}) removed from the pool"),
        "fair_share": args.streams / (len(addresses) - 1),
        "largest_gaps_s": [largest_gap(samples.held, dropped_at, float("inf")),
                           largest_gap(samples.routed, dropped_at, float("inf"))],
        "seconds": per_second(samples.held, samples.routed, dropped_at, int(args.phase),
                              addresses, indexes),
    }
    return {"addresses": addresses, "added": new, "dropped": dropped, "join": join,
            "drop": drop}


# -- the run -------------------------------------------------------------------------------


async def wait_for(predicate, at_least: float, at_most: float) -> None:
    """Sleep ``at_least`` seconds, then on until ``predicate()`` (``at_most`` in all)."""
    start = trio.current_time()
    await trio.sleep(at_least)
    with trio.move_on_at(start + at_most):
        while not predicate():
            await trio.sleep(0.05)


def read_text(path) -> str:
    """A small local file (a log, /proc/loadavg), read at once."""
    return Path(path).read_text(errors="replace")


def frontend_args(args, dns: str, port: int) -> str:
    return (f"--worker-address dns:{NAME}:{port} --dns-server {dns} "
            f"--dns-min-interval {args.dns_min_interval} "
            f"--dns-max-interval {args.dns_max_interval} "
            f"--dns-drain-grace {args.dns_drain_grace} --routing {args.routing} "
            f"--routing-balance {args.routing_balance} --disable-log-requests "
            "--log-level info --log-format json")


async def run(args) -> dict:
    """The whole run (see the module docstring); the figures, as :func:`analyse` gives
    them, with the load's tallies and the settings."""
    os.environ[SECRET_ENV] = secrets.token_hex(16)  # (the workers' and the frontend's)
    port = free_port()
    addresses = [f"127.0.0.{i}:{port}" for i in range(2, args.workers + 3)]
    hosts = [a.rsplit(":", 1)[0] for a in addresses]
    records = Records(args.ttl)
    records.set(*hosts[:-1])
    samples, load = Samples(), Load()
    offset = time.time() - _perf()  # (the frontend's log has wall-clock times)
    with tempfile.TemporaryDirectory(prefix="join-balance-") as tmp:
        logs = [Path(tmp, f"worker-{i}.log") for i in range(len(addresses))]
        procs = [start_worker(a, args, log) for a, log in zip(addresses, logs)]
        server = None
        try:
            with dns_server(records) as dns:
                await wait_listening(procs, logs)
                server = SpawnedServer(frontend_args(args, dns, port), "server",
                                       str(Path(tmp, "frontend.log")))
                await server.wait_healthy(120)
                limits = httpx.Limits(max_connections=args.streams + 4)
                async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                    alive = re.compile(r"^trio_llm:workers_alive\{[^}]*\} (\S+)$", re.M)
                    with trio.fail_after(120):
                        while True:
                            text = (await client.get(server.url + "/metrics")).text
                            if sum(float(v) for v in alive.findall(text)) >= args.workers:
                                break
                            await trio.sleep(0.1)
                    loadavg = read_text("/proc/loadavg").split()[0]
                    async with trio.open_nursery() as pollers:
                        pollers.start_soon(poll_workers, addresses, samples, args.poll)
                        pollers.start_soon(poll_metrics, client, server.url, samples,
                                           args.poll)
                        async with trio.open_nursery() as clients:
                            for k in range(args.streams):
                                clients.start_soon(client_loop, load, client, server.url,
                                                   k, args)
                            await trio.sleep(args.warmup)
                            records.set(*hosts)
                            added_at = _perf()

                            def joined() -> bool:  # (a request routed to the added worker)
                                i = worker_indexes(read_text(server.log_path)).get(
                                    addresses[-1])
                                return i is not None and any(
                                    t >= added_at and r.get(i, 0) > 0
                                    for t, r, _ in samples.routed)

                            await wait_for(joined, args.phase, args.phase + 120)
                            records.set(*hosts[1:])
                            dropped_at = _perf()

                            def left() -> bool:  # (drained, and out of the frontend's pool)
                                return emptied(samples, dropped_at, addresses[0]) and (
                                    f"({addresses[0]}) removed from the pool"
                                    in read_text(server.log_path))

                            await wait_for(left, args.phase, args.phase + 120)
                            load.sending = False
                        pollers.cancel_scope.cancel()
                log_text = read_text(server.log_path)
        except BaseException:
            if server is not None:
                print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            if server is not None:
                server.stop()
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    result = analyse(samples, log_events(log_text, offset), args, addresses,
                     worker_indexes(log_text), added_at, dropped_at)
    result["load"] = {"sent": load.sent, "done": load.done, "error_events": load.error_events,
                      "http_errors": load.http_errors}
    result["loadavg"] = float(loadavg)
    result["indexes"] = worker_indexes(log_text)
    return result


def emptied(samples: Samples, since: float, address: str) -> bool:
    """Whether a worker's own count was 0 at a sample since ``since``."""
    return any(t >= since and counts.get(address, 0) == 0 for t, counts in samples.held)


# -- the report ----------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def print_rows(rows: list[dict], addresses: list[str], marks: dict[str, str]) -> None:
    print("    second  " + "".join(f"{a.rsplit(':', 1)[0] + marks.get(a, ''):>14}"
                                   for a in addresses))
    for row in rows:
        cells = []
        for a in addresses:
            held, routed = row["held"][a], row["routed"][a]
            cells.append("-" if held is None else
                         f"{held:.1f} ({'-' if routed is None else int(routed)})")
        print(f"    {row['second']:>2}-{row['second'] + 1:<4} " + "".join(
            f"{c:>14}" for c in cells))


def print_gaps(gaps: list[float | None]) -> None:
    held, routed = (seconds(g) for g in gaps)
    print(f"  (largest time between two samples: {held} of the workers' counts, {routed} "
          "of /metrics)")


def report(args, result: dict, addresses: list[str]) -> None:
    heartbeat = EngineConfig().heartbeat_interval
    duration = (args.ttft_ms + args.itl_ms * args.max_tokens) / 1000
    print(f"{args.workers} listening sim workers found by DNS, 1 more added, then 1 dropped; "
          f"{args.streams} closed-loop streams of {args.max_tokens} tokens (sim ITL "
          f"{args.itl_ms} ms, TTFT {args.ttft_ms} ms: about {duration:.1f} s a stream), "
          f"prompts of {args.prompt_words} words")
    print(f"frontend: --routing {args.routing} --routing-balance {args.routing_balance} "
          f"--dns-min-interval {args.dns_min_interval} --dns-max-interval "
          f"{args.dns_max_interval} --dns-drain-grace {args.dns_drain_grace}, heartbeat "
          f"{heartbeat} s; the records' TTL {args.ttl} s; polled every {args.poll} s; load "
          f"average {result['loadavg']} at the start")
    indexes = result["indexes"]
    join, drop = result["join"], result["drop"]
    added, dropped = result["added"], result["dropped"]
    print(f"added {added} (worker {indexes.get(added)}) to the records; from then:")
    print(f"  it joins the frontend's pool (its log):       {seconds(join['resolved_s'])}")
    print(f"  first request routed to it (/metrics):        {seconds(join['first_request_s'])}")
    gap = ("" if join["within_10pct_s"] is None or join["first_request_s"] is None else
           f" ({(join['within_10pct_s'] - join['first_request_s']) / heartbeat:.1f} "
           "heartbeats after its first request)")
    print(f"  in flight there within 10 % of its fair share ({join['fair_share']:.1f}, the "
          f"worker's count): {seconds(join['within_10pct_s'])}{gap}")
    if join["peak"] is not None:
        print(f"  most in flight there before the drop: {join['peak']} "
              f"({join['peak'] / join['fair_share']:.2f} x its fair share)")
    print_gaps(join["largest_gaps_s"])
    print("  per worker, each second: mean requests in flight (requests routed to it)")
    print_rows(join["seconds"], addresses, {added: "+"})
    print(f"dropped {dropped} (worker {indexes.get(dropped)}) from the records; from then:")
    print(f"  it leaves the frontend's pool (its log):      {seconds(drop['resolved_s'])}")
    print(f"  last request routed to it (/metrics):         {seconds(drop['last_request_s'])}")
    print(f"  requests routed to it after the answer:       {drop['routed_after_answer']}")
    print(f"  it held no request (the worker's count):      {seconds(drop['emptied_s'])}")
    print(f"  removed from the pool, drained (its log):     {seconds(drop['removed_s'])}")
    print_gaps(drop["largest_gaps_s"])
    print(f"  per worker, each second (fair share now {drop['fair_share']:.1f})")
    print_rows(drop["seconds"], addresses, {added: "+", dropped: "-"})
    load = result["load"]
    print(f"streams: {load['sent']} sent, {load['done']} ended with [DONE], "
          f"{load['error_events']} error events, {load['http_errors']} HTTP errors")
    print(json.dumps(result))


def main() -> None:
    defaults = build_parser()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3, help="in the records at the start")
    p.add_argument("--streams", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--prompt-words", type=int, default=20)
    p.add_argument("--itl-ms", type=float, default=100.0,
                   help="(slow, so that a busy machine keeps up: what counts is the "
                   "streams' length)")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--ttl", type=int, default=5, help="the records' TTL (seconds)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before the join")
    p.add_argument("--phase", type=float, default=15.0,
                   help="seconds after each change (more while its event has not come)")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--seed", type=int, default=1)
    for option in ("dns_min_interval", "dns_max_interval", "dns_drain_grace",
                   "routing_balance"):
        p.add_argument("--" + option.replace("_", "-"), type=type(defaults.get_default(option)),
                       default=defaults.get_default(option), help="the frontend's")
    p.add_argument("--routing", default=defaults.get_default("routing"), help="the frontend's")
    args = smoke.parse_args(p, workers=2, streams=6, max_tokens=5, itl_ms=10.0, ttl=0,
                            warmup=1.0, phase=2.0, poll=0.05, dns_min_interval=0.2)
    if not 1 <= args.workers <= 200:
        p.error("--workers: 1 to 200 (loopback addresses 127.0.0.2 and up)")
    result = trio.run(run, args)
    report(args, result, result["addresses"])


if __name__ == "__main__":
    main()
