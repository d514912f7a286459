"""The worker addresses that name a DNS record rather than one worker.

``dns:NAME:PORT`` is every A and AAAA address of NAME, each at PORT (a Kubernetes headless
Service names its ready pods so). ``srv:NAME`` is every target of NAME's SRV records, at
the port each record gives (``srv:_worker._tcp.llm.default.svc.cluster.local``). Other
text is one worker (:func:`~server.worker_protocol.handshake.parse_address`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..worker_protocol.handshake import WorkerAddress, parse_address

__all__ = ["DnsName", "parse_dns_server", "parse_worker_address"]


@dataclass(frozen=True)
class DnsName:
    """A name to resolve to workers: ``kind`` is ``dns`` (A and AAAA records, each at
    ``port``) or ``srv`` (SRV records, their own ports; ``port`` is None)."""

    kind: str
    name: str
    port: int | None = None

    def __str__(self) -> str:  # (what parse_worker_address reads back: a frontend's argv)
        return f"dns:{self.name}:{self.port}" if self.kind == "dns" else f"srv:{self.name}"


def _check_name(text: str, name: str) -> str:
    labels = name.rstrip(".").split(".")
    if not name or len(name) > 253 or any(not 0 < len(label) < 64 for label in labels):
        raise ValueError(f"{text!r}: {name!r} is not a DNS name")
    return name


def parse_worker_address(text: str) -> WorkerAddress | DnsName:
    """One ``--worker-address``: a :class:`DnsName` for ``dns:NAME:PORT`` or ``srv:NAME``,
    else one worker's address; raises ValueError naming the forms.

    >>> parse_worker_address("dns:workers.llm.svc:7100")
    DnsName(kind='dns', name='workers.llm.svc', port=7100)
    >>> str(parse_worker_address("srv:_w._tcp.example"))
    'srv:_w._tcp.example'
    """
    if text.startswith("dns:"):
        name, sep, port = text[4:].rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not dns:NAME:PORT")
        return DnsName("dns", _check_name(text, name), int(port))
    if text.startswith("srv:"):
        return DnsName("srv", _check_name(text, text[4:]))
    try:
        return parse_address(text)
    except ValueError as exc:
        raise ValueError(f"{exc} (or dns:NAME:PORT, srv:NAME)") from None


def parse_dns_server(text: str) -> tuple[str, int]:
    """``--dns-server``: ``HOST``, ``HOST:PORT`` or ``[IPV6]:PORT`` (an IP address; port
    53 by default)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else "53" if not rest else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, "53"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST, HOST:PORT or [IPV6]:PORT")
    return host, int(port)
