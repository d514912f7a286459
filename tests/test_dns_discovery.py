"""Remote workers found by DNS (server.discovery): a real DNS server on loopback (dnslib's,
in a thread), real listening workers, records changed while streams run."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager

import httpx
import pytest
import trio
from dnslib import QTYPE, RCODE, RR, SRV, A, DNSError
from dnslib.server import BaseResolver, DNSHandler, DNSServer

import server as server_pkg
from server.config import EngineConfig
from server.discovery.names import DnsName, parse_worker_address
from server.discovery.dns import Resolved, ResolveError, resolve
from server.discovery.watch import DnsWatch
from server.worker_protocol.handshake import WorkerAddress
from tests.conftest import running_server
from tests.remote import SECRET, free_port, listening_worker, wait_until
from tests.sse_record import assert_whole, completion_payloads

LIMIT = 120  # (generous bounds that pass at once when all is well: 2 busy cores)
NAME = "workers.llm.test."


class Records(BaseResolver):
    """A zone the test edits: A records by name, SRV records by name ((port, target)
    each); ``fail`` answers SERVFAIL, ``silent`` nothing. TTL 0 unless ``ttl`` says:
    the frontend's least interval decides."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.a: dict[str, list[str]] = {}
        self.srv: dict[str, list[tuple[int, str]]] = {}
        self.fail = False
        self.silent = False
        self.ttl = 0
        self.queries = 0

    def set(self, name: str, *hosts: str) -> None:
        with self.lock:
            self.a[name] = list(hosts)

    def resolve(self, request, handler):
        reply = request.reply()
        name, qtype = str(request.q.qname), QTYPE[request.q.qtype]
        with self.lock:
            self.queries += 1
            if self.silent:  # (dnslib's handler sends nothing for a DNSError)
                raise DNSError("silent")
            if self.fail:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            ttl = self.ttl
            if qtype == "A":
                for host in self.a.get(name, ()):
                    reply.add_answer(RR(name, QTYPE.A, rdata=A(host), ttl=ttl))
            elif qtype == "SRV":
                for port, target in self.srv.get(name, ()):
                    reply.add_answer(RR(name, QTYPE.SRV, rdata=SRV(0, 0, port, target),
                                        ttl=ttl))
        return reply


@contextmanager
def dns_server():
    records = Records()
    dns = DNSServer(records, address="127.0.0.1", port=0)
    dns.start_thread()
    try:
        records.address = "127.0.0.1:%d" % dns.server.server_address[1]
        yield records
    finally:
        dns.stop()


def dns_config(name: str, records: Records, **kw) -> EngineConfig:
    kw = {"shutdown_grace": 0.3, "dns_min_interval": 0.05, "dns_max_interval": 0.2,
          "heartbeat_interval": 0.2, "restart_backoff": 0.05, "restart_backoff_max": 0.2,
          **kw}
    return EngineConfig(worker_addresses=(name,), worker_secret=SECRET.encode(),
                        dns_server=records.address, **kw)


def members(engine) -> set[str]:
    """The addresses of the workers that are up and routed to."""
    return {str(w.address) for w in engine.workers if w.routable}


def test_worker_addresses_that_name_dns_records_parse_and_print_back():
    assert parse_worker_address("dns:w.llm.svc:7100") == DnsName("dns", "w.llm.svc", 7100)
    assert str(parse_worker_address("srv:_w._tcp.llm")) == "srv:_w._tcp.llm"
    assert parse_worker_address("10.0.0.2:7100") == WorkerAddress("10.0.0.2", 7100, None)
    for bad in ("dns:w.llm.svc", "dns::7100", "dns:w:0", "srv:", "srv:a..b"):
        with pytest.raises(ValueError):
            parse_worker_address(bad)


async def test_records_that_change_under_64_streams_lose_none(tmp_path):
    """Workers are added, removed (drained, then what runs moves) and replaced at a new
    address while 64 streams run: every stream ends [DONE], at its full length, with no
    error event. The workers step every 20 ms, so that the streams (20 s at least) outlast
    the changes on two busy cores: at 2 ms, a worker could finish generating before it was
    removed (its client still reading), leaving nothing to move."""
    port = free_port()
    hosts = [f"127.0.0.{i}" for i in (2, 3, 4, 5)]
    with dns_server() as records, trio.fail_after(LIMIT):
        records.set(NAME, *hosts[:2])
        async with AsyncExitStack() as stack:
            workers = {h: await stack.enter_async_context(listening_worker(
                tmp_path, f"{h}:{port}", "--sim-itl-ms", "20", name=h)) for h in hosts}
            config = dns_config(f"dns:{NAME}:{port}", records, dns_drain_grace=0.3)
            async with running_server(config) as url:
                engine = url.app.engine
                await wait_until(lambda: members(engine) == {f"{h}:{port}" for h in hosts[:2]},
                                 LIMIT)
                body = {"model": "sim", "prompt": "hi", "max_tokens": 1000, "stream": True}
                started: list = []
                results: dict[int, list] = {}
                async with httpx.AsyncClient(timeout=LIMIT) as client:
                    async with trio.open_nursery() as nursery:
                        async def one(i):
                            results[i] = await completion_payloads(client, url, body, started)
                        for i in range(64):
                            nursery.start_soon(one, i)
                        await wait_until(lambda: len(started) == 64, LIMIT)
                        # added
                        records.set(NAME, *hosts[:3])
                        await wait_until(lambda: f"{hosts[2]}:{port}" in members(engine), LIMIT)
                        # removed: it drains for the grace, then its streams move
                        old = next(w for w in engine.workers if w.address.host == hosts[0])
                        assert old.outstanding
                        records.set(NAME, *hosts[1:3])
                        await wait_until(lambda: not old.outstanding, LIMIT)
                        moved = engine.statistics().migration
                        assert moved is not None and moved.migrations["removed"] > 0, moved
                        # replaced: its pod went, another came at a new address
                        records.set(NAME, hosts[2], hosts[3])
                        workers[hosts[1]].proc.send_signal(signal.SIGKILL)
                        await wait_until(lambda: members(engine) == {
                            f"{h}:{port}" for h in hosts[2:]}, LIMIT)
                stats = engine.statistics()
    assert len(results) == 64
    for events in results.values():
        assert_whole(events, 1000)
    assert stats.migration is not None and not stats.migration.failed
    assert [w.retired for w in stats.workers].count(False) == 2


@pytest.mark.parametrize("failure", ["servfail", "silent"])
async def test_a_resolver_failure_keeps_the_workers_and_is_counted_in_metrics(
        tmp_path, caplog, failure):
    """SERVFAIL, or no answer at all: the pool keeps its workers and serves; the failure is
    logged once and /metrics counts each; once the server answers again, the pool follows
    its records."""
    caplog.set_level(logging.INFO, logger="server.discovery")
    port = free_port()
    hosts = ["127.0.0.2", "127.0.0.3"]
    with dns_server() as records, trio.fail_after(LIMIT):
        records.set(NAME, *hosts)
        async with AsyncExitStack() as stack:
            for h in hosts:
                await stack.enter_async_context(listening_worker(tmp_path, f"{h}:{port}",
                                                                 name=h))
            async with running_server(dns_config(f"dns:{NAME}:{port}", records)) as url:
                engine = url.app.engine
                both = {f"{h}:{port}" for h in hosts}
                await wait_until(lambda: members(engine) == both, LIMIT)
                setattr(records, "fail" if failure == "servfail" else "silent", True)
                await wait_until(lambda: engine.statistics().discovery[0][1].failures >= 3,
                                 LIMIT)
                assert members(engine) == both
                async with httpx.AsyncClient(timeout=LIMIT) as client:
                    r = await client.post(url + "/v1/completions", json={
                        "model": "sim", "prompt": "hi", "max_tokens": 3})
                    assert r.status_code == 200
                    metrics = (await client.get(url + "/metrics")).text
                failed = [line for line in metrics.splitlines()
                          if line.startswith("trio_llm:dns_resolution_failures_total{")]
                assert failed and float(failed[0].split()[-1]) >= 3
                assert f'trio_llm:dns_addresses{{model_name="sim",name="dns:{NAME}:{port}"}} 2.0' \
                    in metrics
                records.set(NAME, hosts[1])
                records.fail = records.silent = False
                await wait_until(lambda: members(engine) == {f"{hosts[1]}:{port}"}, LIMIT)
                assert engine.statistics().discovery[0][1].last_error is None
    # (once per reason: the A query's, and the AAAA one's if the change came between them)
    said = [r.getMessage() for r in caplog.records if "cannot resolve" in r.getMessage()]
    assert said and len(set(said)) == len(said), said
    assert all("keeping its 2 known workers" in line for line in said), said


async def test_a_member_whose_connection_ends_has_its_name_resolved_again_before_the_ttl(
        tmp_path):
    """A pod rescheduled to a new address: its old connection ends, and the frontend asks
    DNS again at once rather than after the records' TTL (here longer than the test)."""
    port = free_port()
    hosts = ["127.0.0.2", "127.0.0.3"]
    with dns_server() as records, trio.fail_after(LIMIT):
        records.ttl = 3600
        records.set(NAME, hosts[0])
        async with AsyncExitStack() as stack:
            old, _ = [await stack.enter_async_context(listening_worker(
                tmp_path, f"{h}:{port}", name=h)) for h in hosts]
            config = dns_config(f"dns:{NAME}:{port}", records, dns_max_interval=3600)
            async with server_pkg.open_engine(config) as engine:
                assert members(engine) == {f"{hosts[0]}:{port}"}
                asked = records.queries
                records.set(NAME, hosts[1])
                old.proc.send_signal(signal.SIGKILL)
                await wait_until(lambda: members(engine) == {f"{hosts[1]}:{port}"}, LIMIT)
                assert records.queries > asked


async def test_the_prefix_index_forgets_a_worker_that_left_and_starts_empty_for_a_new_one(
        tmp_path):
    port = free_port()
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    prompt = "a long shared prefix " * 40  # (several blocks of 256 characters)
    params = server_pkg.SamplingParams(max_tokens=2)
    with dns_server() as records, trio.fail_after(LIMIT):
        records.set(NAME, *hosts[:2])
        async with AsyncExitStack() as stack:
            for h in hosts:
                await stack.enter_async_context(listening_worker(tmp_path, f"{h}:{port}",
                                                                 name=h))
            config = dns_config(f"dns:{NAME}:{port}", records)
            async with server_pkg.open_engine(config) as engine:
                await wait_until(lambda: len(members(engine)) == 2, LIMIT)
                async with engine.generate(prompt, params) as stream:
                    [choice] = stream.choice_states()
                    async for _ in stream:
                        pass
                index = choice.worker.index
                left = choice.worker
                assert len(engine.router.indexes[index]) > 0
                records.set(NAME, *(h for h in hosts[:2] if h != left.address.host))
                pool = engine.discovery
                await wait_until(lambda: index in pool._free, LIMIT)  # (its service ended)
                assert len(engine.router.indexes[index]) == 0
                records.set(NAME, *(h for h in hosts if h != left.address.host))
                await wait_until(lambda: engine.workers[index] is not left
                                 and engine.workers[index].routable, LIMIT)
                assert engine.workers[index].address.host == hosts[2]
                assert len(engine.router.indexes[index]) == 0


@asynccontextmanager
async def _draining_pool(tmp_path, hosts: list[str]):
    """A DNS server naming a listening worker at each of ``hosts`` (one port), and an engine
    that found them all, draining a vanished one for LIMIT: ``(records, engine)``."""
    port = free_port()
    with dns_server() as records:
        records.set(NAME, *hosts)
        async with AsyncExitStack() as stack:
            for h in hosts:
                await stack.enter_async_context(listening_worker(tmp_path, f"{h}:{port}",
                                                                 name=h))
            config = dns_config(f"dns:{NAME}:{port}", records, dns_drain_grace=LIMIT)
            async with server_pkg.open_engine(config) as engine:
                await wait_until(lambda: len(members(engine)) == len(hosts), LIMIT)
                yield records, engine


async def test_a_vanished_worker_finishes_its_streams_there_and_gets_no_new_ones(tmp_path):
    """Drained within the grace: its streams end on it, unmoved; new requests go to the
    others, even those whose prefix it holds; once it holds none it is removed."""
    hosts = ["127.0.0.2", "127.0.0.3"]
    prompt = "a long shared prefix " * 40  # (several blocks of 256 characters)
    params = server_pkg.SamplingParams(max_tokens=2500)
    with trio.fail_after(LIMIT):
        async with _draining_pool(tmp_path, hosts) as (records, engine):
            async with engine.generate(prompt, params) as stream:
                [choice] = stream.choice_states()
                leaving = choice.worker
                outs = [await stream.__anext__()]
                records.set(NAME, *(h for h in hosts if h != leaving.address.host))
                await wait_until(lambda: leaving.retired, LIMIT)
                assert leaving.outstanding == 1
                for _ in range(4):
                    async with engine.generate(prompt, server_pkg.SamplingParams(
                            max_tokens=2)) as other:
                        [new] = other.choice_states()
                        assert new.worker is not leaving
                        async for _ in other:
                            pass
                outs += [out async for out in stream]
            assert outs[-1].finish_reason == "length"
            assert outs[-1].completion_tokens == 2500
            assert choice.worker is leaving and choice.migrations == 0
            await wait_until(lambda: leaving.removed, LIMIT)
            assert engine.statistics().migration.migrations["removed"] == 0


async def test_a_worker_back_in_the_records_before_its_removal_is_kept_connection_and_all(
        tmp_path, caplog):
    """A record that flaps (a worker's address gone from one answer, back in the next)
    churns no connection: the worker drains meanwhile, then is routed to again on the same
    session, its stream never moved."""
    caplog.set_level(logging.INFO, logger="server.discovery")
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    with trio.fail_after(LIMIT):
        async with _draining_pool(tmp_path, hosts) as (records, engine):
            params = server_pkg.SamplingParams(max_tokens=2500)
            async with engine.generate("hi", params) as stream:
                [choice] = stream.choice_states()
                flapping = choice.worker
                outs = [await stream.__anext__()]
                records.set(NAME, *(h for h in hosts if h != flapping.address.host))
                await wait_until(lambda: flapping.retired, LIMIT)
                records.set(NAME, *hosts)
                await wait_until(lambda: flapping.routable, LIMIT)
                outs += [out async for out in stream]
            assert outs[-1].finish_reason == "length"
            assert outs[-1].completion_tokens == 2500
            assert choice.worker is flapping and choice.migrations == 0
            assert flapping in engine.workers and flapping.generation == 0
            assert not flapping.removed
    back = [r.getMessage() for r in caplog.records if "is back in discovery" in r.getMessage()]
    assert back == [f"worker {flapping.index} ({flapping.address}) is back in discovery: kept"]


async def test_srv_records_name_workers_at_their_own_ports(tmp_path):
    with dns_server() as records, trio.fail_after(LIMIT):
        async with AsyncExitStack() as stack:
            workers = [await stack.enter_async_context(listening_worker(
                tmp_path, f"127.0.0.1:{free_port()}", name=name)) for name in ("a", "b")]
            records.srv["_llm._tcp.test."] = [(w.address.port, f"{n}.test.")
                                              for w, n in zip(workers, "ab")]
            records.set("a.test.", "127.0.0.1")
            records.set("b.test.", "127.0.0.1")
            config = dns_config("srv:_llm._tcp.test.", records)
            async with server_pkg.open_engine(config) as engine:
                assert members(engine) == {str(w.address) for w in workers}
                async with engine.generate("hi", server_pkg.SamplingParams(max_tokens=3)) as s:
                    outs = [out async for out in s]
    assert outs[-1].finish_reason == "length"


@pytest.mark.parametrize("kind", ["dns", "srv"])
async def test_tls_checks_the_name_a_worker_was_found_by_not_its_address(tmp_path, kind):
    """A worker's certificate names its DNS name (a pod's address changes with each
    reschedule): found by that name, it is trusted; its address is not in the certificate."""
    from tests.remote import make_certificate

    cert, key = make_certificate(tmp_path, "w.llm.test")
    port = free_port()
    with dns_server() as records, trio.fail_after(LIMIT):
        records.set("w.llm.test.", "127.0.0.2")
        records.srv["_llm._tcp.test."] = [(port, "w.llm.test.")]
        name = "dns:w.llm.test.:%d" % port if kind == "dns" else "srv:_llm._tcp.test."
        async with listening_worker(tmp_path, f"127.0.0.2:{port}", "--tls-cert", str(cert),
                                    "--tls-key", str(key)):
            config = dns_config(name, records, worker_tls_ca=str(cert))
            async with server_pkg.open_engine(config) as engine:
                assert members(engine) == {f"127.0.0.2:{port}"}
                async with engine.generate("hi", server_pkg.SamplingParams(max_tokens=3)) as s:
                    outs = [out async for out in s]
    assert outs[-1].finish_reason == "length"


async def test_a_worker_found_by_two_names_is_one_member(tmp_path):
    """Two names (a short one and its full form, or a dns: and an srv: name) that answer
    the same address give one worker: one connection, one share of the routing."""
    with dns_server() as records, trio.fail_after(LIMIT):
        async with listening_worker(tmp_path, f"127.0.0.2:{free_port()}") as w:
            records.set("w.llm.test.", "127.0.0.2")
            records.set("pod-0.w.llm.test.", "127.0.0.2")
            records.srv["_llm._tcp.test."] = [(w.address.port, "pod-0.w.llm.test.")]
            config = dns_config(f"dns:w.llm.test.:{w.address.port}", records)
            config = dataclasses.replace(config, worker_addresses=(
                *config.worker_addresses, "srv:_llm._tcp.test."))
            async with server_pkg.open_engine(config) as engine:
                joined = [str(x.address) for x in engine.workers if not x.retired]
                assert joined == [str(w.address)]


def _flapping(calls: list):
    """A resolver (in memory) whose answer differs at every call."""
    async def resolver(target, server):
        calls.append(trio.current_time())
        host = "10.0.0.%d" % (len(calls) % 2 + 1)
        return Resolved(frozenset({WorkerAddress(host, 7100, None)}), 30)
    return resolver


async def test_a_flapping_record_changes_the_set_at_most_once_per_min_interval(
        autojump_clock):
    """However a record flaps and its workers fail (pokes), resolutions (and so changes
    to the pool) come at most once per min_interval."""
    calls: list = []
    changes: list = []
    watch = DnsWatch(DnsName("dns", "w.test", 7100), ("127.0.0.1", 53), min_interval=1.0,
                     max_interval=30.0, changed=lambda name, a: changes.append(a),
                     resolver=_flapping(calls))
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        with trio.move_on_after(20):
            while True:
                watch.poke()
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert len(calls) > 10 and len(changes) == len(calls)  # (poked: sooner than its TTL)
    assert all(b - a >= 1.0 for a, b in zip(calls, calls[1:]))


async def test_the_next_resolution_comes_after_the_ttl_held_within_bounds_and_backs_off(
        autojump_clock):
    """Unpoked, each resolution comes after the last answer's TTL, held between
    min_interval and max_interval; failures retry after min_interval, doubling up to
    max_interval, and an answer ends the doubling."""
    answers = [5, 0, 100, "fail", "fail", "fail", "fail", "fail", 5, "fail", 5]
    calls: list[float] = []

    async def resolver(target, server):
        calls.append(trio.current_time())
        answer = answers[len(calls) - 1] if len(calls) <= len(answers) else 5
        if answer == "fail":
            raise ResolveError("SERVFAIL")
        return Resolved(frozenset({WorkerAddress("10.0.0.1", 7100, None)}), answer)

    watch = DnsWatch(DnsName("dns", "w.test", 7100), ("127.0.0.1", 53), min_interval=1.0,
                     max_interval=10.0, changed=lambda name, a: None, resolver=resolver)
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        await wait_until(lambda: len(calls) > len(answers), LIMIT)
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 6) for a, b in zip(calls, calls[1:])][:len(answers)]
    assert gaps == [5, 1, 10, 1, 2, 4, 8, 10, 5, 1, 5]
    assert watch.stats.failures == 6


def test_the_command_line_takes_dns_names_and_refuses_their_options_without_one():
    from server.cli import build_parser, config_from_args

    def config(*argv):
        return config_from_args(build_parser().parse_args(list(argv))).engine

    engine = config("--worker-address", "dns:w.llm.svc:7100,10.0.0.9:7100",
                    "--dns-server", "10.96.0.10:53", "--dns-min-interval", "2")
    assert engine.worker_addresses == (DnsName("dns", "w.llm.svc", 7100),
                                       WorkerAddress("10.0.0.9", 7100, None))
    assert (engine.dns_server, engine.dns_min_interval) == ("10.96.0.10:53", 2.0)
    with pytest.raises(SystemExit, match="--dns-server is an option of workers found by DNS"):
        config("--dns-server", "10.96.0.10")
    with pytest.raises(SystemExit, match="dns:NAME:PORT"):
        config("--worker-address", "dns:w.llm.svc")


class _Udp512(DNSHandler):
    udplen = 512  # (a classic DNS server: a longer answer over UDP comes truncated)


async def test_an_answer_too_long_for_udp_is_asked_again_over_tcp():
    records = Records()
    records.set(NAME, *(f"10.1.0.{i}" for i in range(1, 61)))
    udp = DNSServer(records, address="127.0.0.1", port=0, handler=_Udp512)
    port = udp.server.server_address[1]
    tcp = DNSServer(records, address="127.0.0.1", port=port, tcp=True)
    udp.start_thread()
    tcp.start_thread()
    try:
        with trio.fail_after(LIMIT):
            found = await resolve(DnsName("dns", NAME, 7100), ("127.0.0.1", port))
    finally:
        udp.stop()
        tcp.stop()
    assert found.addresses == {WorkerAddress(f"10.1.0.{i}", 7100, None, NAME.rstrip("."))
                               for i in range(1, 61)}
