"""Where the load goes: loopback-only URL checks, the server's address, connections to it and
a one-shot GET (for ``/v1/models`` and ``/health``)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import trio

from .http11 import HTTPResponseParser, ProtocolError, build_request

RECV_SIZE = 65536

# What simple_get raises when the server is not (yet) there or does not answer properly.
GET_ERRORS = (OSError, ProtocolError, trio.TooSlowError, trio.BrokenResourceError)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_loopback_url(url: str) -> tuple[str, int, str, str]:
    """Validate a base URL: ``http``, loopback host. Returns (host, port, path, host_header).

    Raises ValueError for anything else: this tool only loads servers on this machine.
    """
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, not {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    if not _is_loopback(host):
        raise ValueError(
            f"refusing to target {host!r}: only loopback hosts (127.0.0.1, ::1, localhost)"
        )
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"bad port in {url!r}: {exc}") from None
    host_header = f"[{host}]" if ":" in host else host
    if port != 80:
        host_header += f":{port}"
    return host, port, parts.path.rstrip("/"), host_header


def api_path(base_path: str, endpoint: str) -> str:
    """``/v1/<endpoint>`` under the base URL's path (which may already end in ``/v1``)."""
    base = base_path.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return f"{base}/{endpoint}"


class Target:
    """Where to connect (a numeric loopback address) and what to send."""

    def __init__(self, url: str) -> None:
        self.host, self.port, self.base_path, self.host_header = check_loopback_url(url)
        self.connect_host = self.host  # replaced by a numeric address by resolve()

    async def resolve(self) -> None:
        """Pick the first loopback address of the host that accepts a connection."""
        infos = await trio.socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        addrs = []
        for *_, sockaddr in infos:
            ip = ipaddress.ip_address(sockaddr[0])
            if not ip.is_loopback:
                raise ValueError(f"{self.host!r} resolves to non-loopback address {ip}")
            if sockaddr[0] not in addrs:
                addrs.append(sockaddr[0])
        last: Exception | None = None
        for addr in addrs:
            try:
                stream = await trio.open_tcp_stream(addr, self.port)
            except OSError as exc:
                last = exc
                continue
            await stream.aclose()
            self.connect_host = addr
            return
        raise ConnectionError(f"cannot connect to {self.host}:{self.port}: {last}")

    async def connect(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(self.connect_host, self.port)


def close_stream(stream) -> None:
    """Close a connection's socket at once (no checkpoint, no error)."""
    try:
        stream.socket.close()
    except Exception:  # pragma: no cover
        pass


async def simple_get(target: Target, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``path`` on a fresh connection; returns (status, body). Raises on I/O errors."""
    with trio.fail_after(timeout):
        stream = await target.connect()
        try:
            await stream.send_all(build_request("GET", path, target.host_header,
                                                headers=(("Connection", "close"),)))
            parser = HTTPResponseParser()
            body = []
            while not parser.done:
                data = await stream.receive_some(RECV_SIZE)
                if not data:
                    parser.feed_eof()
                    break
                body.append(parser.feed(data))
            return parser.head.status, b"".join(body)
        finally:
            close_stream(stream)
