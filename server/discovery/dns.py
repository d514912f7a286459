"""Ask a DNS server for a name's workers, over Trio's UDP (never blocking the event loop).

``getaddrinfo`` in a thread would hide the records' TTLs and cannot ask for SRV records,
so the frontend asks the server itself: dnslib builds and parses the packets, a UDP socket
carries them, and an answer too big for UDP (truncated) is asked again over TCP. Every
query is bounded (``timeout``); a server that does not answer, answers with an error
(SERVFAIL, NXDOMAIN) or with a packet that is not the answer raises :class:`ResolveError`,
and the caller keeps what it knew (:mod:`.watch`).
"""

from __future__ import annotations

import random
import struct

import trio
from dnslib import QTYPE, RCODE, DNSRecord

from ..worker_protocol.handshake import WorkerAddress
from .names import DnsName

__all__ = ["Resolved", "ResolveError", "resolve", "system_dns_server"]

#: Seconds one query waits for its answer (tried twice over UDP).
QUERY_TIMEOUT = 2.0
#: The largest answer read over UDP (EDNS is not asked for: 512 bytes come, else TC).
_UDP_MAX = 65535


class ResolveError(Exception):
    """The name could not be resolved now (the reason, for the log and /metrics)."""


class Resolved:
    """A name's workers and the shortest TTL of the records that named them."""

    def __init__(self, addresses: frozenset[WorkerAddress], ttl: int) -> None:
        self.addresses = addresses
        self.ttl = ttl


async def system_dns_server(path: str = "/etc/resolv.conf") -> tuple[str, int]:
    """The first ``nameserver`` of resolv.conf, port 53 (a pod's is the cluster's DNS)."""
    try:
        text = await trio.Path(path).read_text()
    except OSError as exc:
        raise ResolveError(f"no DNS server: {path}: {exc.strerror}") from None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            return parts[1], 53
    raise ResolveError(f"no DNS server: {path} names no nameserver")


async def _exchange(server: tuple[str, int], packet: bytes, timeout: float) -> bytes:
    family = trio.socket.AF_INET6 if ":" in server[0] else trio.socket.AF_INET
    with trio.socket.socket(family, trio.socket.SOCK_DGRAM) as sock:
        await sock.connect(server)
        for _ in range(2):
            await sock.send(packet)
            with trio.move_on_after(timeout / 2):
                while True:
                    data = await sock.recv(_UDP_MAX)
                    if data[:2] == packet[:2]:  # (the id: a stray or late packet is not it)
                        return data
    raise ResolveError(f"DNS server {server[0]}:{server[1]} did not answer")


async def _exchange_tcp(server: tuple[str, int], packet: bytes, timeout: float) -> bytes:
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(*server)
        async with stream:
            await stream.send_all(struct.pack("!H", len(packet)) + packet)
            data = b""
            while len(data) < 2 or len(data) < 2 + struct.unpack("!H", data[:2])[0]:
                chunk = await stream.receive_some(65537)
                if not chunk:
                    raise ResolveError("the DNS server closed the TCP connection")
                data += chunk
            return data[2:2 + struct.unpack("!H", data[:2])[0]]


async def query(server: tuple[str, int], name: str, qtype: str,
                timeout: float = QUERY_TIMEOUT) -> DNSRecord:
    """The answer to one question; raises ResolveError (no answer, an error code)."""
    request = DNSRecord.question(name, qtype)
    request.header.id = random.randrange(65536)
    packet = request.pack()
    try:
        data = await _exchange(server, packet, timeout)
        reply = DNSRecord.parse(data)
        if reply.header.tc:  # truncated: the whole answer over TCP
            reply = DNSRecord.parse(await _exchange_tcp(server, packet, timeout))
    except (OSError, trio.TooSlowError) as exc:
        raise ResolveError(f"DNS server {server[0]}:{server[1]}: {exc}") from None
    except ResolveError:
        raise
    except Exception as exc:  # dnslib's parse errors are of several kinds
        raise ResolveError(f"{name}: an answer that could not be parsed ({exc})") from None
    if reply.header.id != request.header.id or reply.q.qname != request.q.qname:
        raise ResolveError(f"{name}: an answer to another question")
    if reply.header.rcode != RCODE.NOERROR:
        raise ResolveError(f"{name} {qtype}: {RCODE[reply.header.rcode]}")
    return reply


def _addresses(reply: DNSRecord, name) -> tuple[list[str], list[int]]:
    """The A and AAAA addresses ``reply`` gives for ``name`` (its answer and additional
    sections), and their TTLs."""
    hosts, ttls = [], []
    for rr in (*reply.rr, *reply.ar):
        if rr.rname == name and rr.rtype in (QTYPE.A, QTYPE.AAAA):
            hosts.append(str(rr.rdata))
            ttls.append(rr.ttl)
    return hosts, ttls


async def _hosts(server: tuple[str, int], name: str, timeout: float
                 ) -> tuple[list[str], list[int]]:
    """Every A and AAAA address of ``name``, and the records' TTLs."""
    hosts, ttls = [], []
    for qtype in ("A", "AAAA"):
        reply = await query(server, name, qtype, timeout)
        more, more_ttls = _addresses(reply, reply.q.qname)
        hosts += more
        ttls += more_ttls
    return hosts, ttls


async def resolve(target: DnsName, server: tuple[str, int],
                  timeout: float = QUERY_TIMEOUT) -> Resolved:
    """``target``'s workers now. An empty answer is no worker; any failure (of any of
    the queries) raises ResolveError: a half answer is not taken for the whole."""
    if target.kind == "dns":
        hosts, ttls = await _hosts(server, target.name, timeout)
        found = frozenset(WorkerAddress(h, target.port, None, _bare(target.name)) for h in hosts)
        return Resolved(found, min(ttls, default=0))
    reply = await query(server, target.name, "SRV", timeout)
    addresses: set[WorkerAddress] = set()
    ttls = []
    for rr in reply.rr:
        if rr.rtype != QTYPE.SRV or rr.rname != reply.q.qname or str(rr.rdata.target) == ".":
            continue  # (target "." is RFC 2782's "no such service here")
        ttls.append(rr.ttl)
        hosts, more = _addresses(reply, rr.rdata.target)  # (additional records, if given)
        if not hosts:
            hosts, more = await _hosts(server, str(rr.rdata.target), timeout)
        ttls += more
        addresses.update(WorkerAddress(h, rr.rdata.port, None, _bare(str(rr.rdata.target)))
                         for h in hosts)
    return Resolved(frozenset(addresses), min(ttls, default=0))


def _bare(name: str) -> str:
    """A DNS name as a certificate names it: without the root's trailing dot."""
    return name.rstrip(".")
