"""Resolve an image URL's host, check every address, and connect only to a checked one.

Why this way: checking a name and then letting a library resolve it again to connect
leaves a gap (DNS rebinding: the second answer is 127.0.0.1). Here the name is resolved
once, with ``trio.socket.getaddrinfo`` (in a thread: the event loop never blocks), every
address is checked (one refused address refuses the URL: an answer that mixes public and
private addresses is an attack), and the socket connects to those very addresses. TLS
runs over that socket, verifying the URL's host name.

Through an HTTP proxy (server.media.proxy) the host is resolved and every address checked
all the same, so a proxy cannot be used to reach, by name, what a direct fetch may not.
The socket then goes to the proxy instead, whose addresses are not checked (the operator
named it). The proxy resolves the host again: a name whose answer changes between the
two look-ups is the proxy's to guard, as no client can pin a proxy's connection.

The addresses are tried as RFC 8305 ("happy eyeballs") says: the next one starts when the
one before has failed or has not answered within :data:`ATTEMPT_DELAY`, beside it; the
first to connect wins and the others are cancelled. So an address that drops packets (a
firewall, an IPv6 route that goes nowhere) costs a quarter of a second, not the fetch's
whole time limit.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl

import trio

from .errors import MediaFetchFailed, MediaProxyFailed, MediaRefused
from .http1 import open_tunnel
from .policy import MediaPolicy, WebUrl, address_refusal
from .proxy import Proxy

__all__ = ["ATTEMPT_DELAY", "connect_first", "open_checked_stream", "resolve_checked"]

Target = tuple[int, int, int, tuple]

#: Seconds an address gets to answer before the next is tried beside it (RFC 8305's
#: connection attempt delay; trio.open_tcp_stream's default too).
ATTEMPT_DELAY = 0.25


async def resolve_checked(web: WebUrl, url: str, policy: MediaPolicy) -> list[Target]:
    """(family, type, proto, sockaddr) of every address ``web``'s host resolves to, each
    checked against the policy; ``url`` (the client's) is what errors name."""
    try:
        infos = await trio.socket.getaddrinfo(web.host, web.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MediaFetchFailed(url, f"names host '{web.host}', which does not resolve "
                               f"({exc.strerror})") from None
    targets: list[Target] = []
    for family, type_, proto, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        why = address_refusal(address, policy)
        if why is not None:
            raise MediaRefused(url, f"resolves to {why}")
        target = (family, type_, proto, sockaddr)
        if target not in targets:
            targets.append(target)
    if not targets:
        raise MediaFetchFailed(url, f"names host '{web.host}', which has no IP address")
    return targets


async def connect_first(targets: list[Target], delay: float = ATTEMPT_DELAY
                        ) -> tuple[trio.socket.SocketType | None, OSError | None]:
    """A socket connected to the first of ``targets`` to answer, each started when the one
    before failed or after ``delay`` seconds (see the module docstring); else None and
    the last attempt's error. Every other socket is closed, whatever ends the call."""
    won: trio.socket.SocketType | None = None
    errors: list[OSError] = []

    async def attempt(target: Target, failed: trio.Event,
                      nursery: trio.Nursery) -> None:
        nonlocal won
        family, type_, proto, sockaddr = target
        sock = None
        try:  # (a family or protocol this host cannot open fails this attempt only)
            sock = trio.socket.socket(family, type_, proto)
            await sock.connect(sockaddr)
        except OSError as exc:
            if sock is not None:
                sock.close()
            errors.append(exc)
            failed.set()
            return
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        if won is None:
            won = sock
            nursery.cancel_scope.cancel()  # (the other attempts, and the starting of more)
        else:
            sock.close()

    try:
        async with trio.open_nursery() as nursery:
            for target in targets:
                failed = trio.Event()
                nursery.start_soon(attempt, target, failed, nursery)
                with trio.move_on_after(delay):
                    await failed.wait()
    except BaseException:
        if won is not None:  # (cancelled from outside as it connected)
            won.close()
        raise
    return won, (errors[-1] if won is None and errors else None)


async def open_checked_stream(web: WebUrl, url: str, policy: MediaPolicy,
                              ssl_context: ssl.SSLContext | None,
                              proxy: Proxy | None = None) -> trio.abc.Stream:
    """A stream to ``web``'s host, over TLS when ``web`` is https. Direct, it is
    connected to a checked address (the first that answers). Through ``proxy``, the
    host's addresses are checked all the same (a proxy must not reach what a direct
    fetch may not), and the stream is to the proxy: an https URL's goes through a
    tunnel, TLS inside it. ``ssl_context``: given when TLS is needed (https, a TLS proxy)."""
    targets = await resolve_checked(web, url, policy)
    if proxy is None:
        stream: trio.abc.Stream = await _connect(targets, url, web.host_header)
    else:
        stream = await _open_proxy(proxy, url, ssl_context)
    if web.scheme != "https":
        return stream
    assert ssl_context is not None
    try:
        if proxy is not None:
            await open_tunnel(stream, web, url, proxy)
        return await _tls(stream, ssl_context, web.host, url, web.host_header)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def _tls(stream: trio.abc.Stream, ssl_context: ssl.SSLContext, host: str, url: str,
               where: str) -> trio.SSLStream:
    """``stream`` with TLS to ``host`` (its certificate checked); a failed fetch naming
    ``where`` if the handshake fails. The caller closes ``stream`` on an error."""
    tls = trio.SSLStream(stream, ssl_context, server_hostname=host, https_compatible=True)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__ or exc
        raise MediaFetchFailed(url, f"could not be fetched: TLS with {where} failed "
                               f"({cause})") from None
    return tls


async def _connect(targets: list[Target], url: str, where: str) -> trio.SocketStream:
    """A stream to the first of ``targets`` that answers; a failed fetch naming
    ``where`` if none does."""
    sock, error = await connect_first(targets)
    if sock is None:
        why = error.strerror if error is not None and error.strerror else str(error)
        raise MediaFetchFailed(url, f"could not be fetched: no connection to {where} ({why})")
    return trio.SocketStream(sock)


async def _open_proxy(proxy: Proxy, url: str,
                      ssl_context: ssl.SSLContext | None) -> trio.abc.Stream:
    """A stream to ``proxy`` (TLS for an https:// proxy), whose addresses are not checked:
    the operator named it."""
    try:
        infos = await trio.socket.getaddrinfo(proxy.host, proxy.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MediaProxyFailed(url, f"the proxy {proxy} does not resolve "
                               f"({exc.strerror})") from None
    targets: list[Target] = [(family, type_, proto, sockaddr)
                             for family, type_, proto, _, sockaddr in infos
                             if family in (socket.AF_INET, socket.AF_INET6)]
    if not targets:
        raise MediaProxyFailed(url, f"the proxy {proxy} resolves to no IPv4 or IPv6 address")
    try:
        stream = await _connect(targets, url, f"the proxy {proxy}")
    except MediaFetchFailed as exc:
        raise MediaProxyFailed(url, _unprefixed(exc)) from None
    if not proxy.tls:
        return stream
    assert ssl_context is not None
    try:
        return await _tls(stream, ssl_context, proxy.host, url, f"the proxy {proxy}")
    except MediaFetchFailed as exc:
        await trio.aclose_forcefully(stream)
        raise MediaProxyFailed(url, _unprefixed(exc)) from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


def _unprefixed(failed: MediaFetchFailed) -> str:
    """A failed fetch's reason as the log's line about the proxy says it."""
    return failed.why.removeprefix("could not be fetched: ")
