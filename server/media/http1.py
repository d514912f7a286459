"""The HTTP/1.1 of an image fetch over an open stream: h11 as a small sans-IO client.

The request is ``GET target`` with ``Accept: image/*`` and ``Connection: close``: one
request per connection, so nothing is pooled and a closed stream ends it. The answer is
read within the byte limit: a declared ``Content-Length`` over it is refused before any
body byte is read, and the body (chunked or not) is counted as it arrives and refused the
moment it passes the limit. A redirect's body is never read.

Through an HTTP proxy (server.media.proxy), an http URL's GET goes to the proxy with its
target in absolute form (``GET http://host/path``). An https URL first asks the proxy for
a tunnel (``CONNECT host:443``, :func:`open_tunnel`); TLS and the GET then run inside it.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from urllib.parse import quote

import h11
import trio

from ..errors import printable
from .errors import MediaFetchFailed, MediaProxyFailed, MediaTooLarge
from .policy import WebUrl
from .proxy import Proxy

__all__ = ["REDIRECTS", "Answer", "http_get", "open_tunnel"]

#: Statuses that send the client elsewhere (``Location``).
REDIRECTS = frozenset({301, 302, 303, 307, 308})
#: The most bytes asked of the stream at once.
RECEIVE_BYTES = 64 * 1024
#: The longest response head accepted.
MAX_HEAD_BYTES = 16 * 1024


@dataclass(frozen=True)
class Answer:
    """A response: a redirect's ``location``, or a 200's ``content_type`` and ``body``."""

    status: int
    location: str | None = None
    content_type: str | None = None
    body: bytes = b""


async def http_get(stream: trio.abc.Stream, web: WebUrl, url: str, max_bytes: int,
                   proxy: Proxy | None = None) -> Answer:
    """GET ``web`` over ``stream``; ``url`` (the client's) is what errors name. A status
    other than 200 or a redirect is a failed fetch. ``proxy``: the stream is to this
    proxy, asked for an http URL."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    # (a path or query the client wrote in Unicode goes as its UTF-8, percent-escaped)
    target = quote(web.target, safe=string.punctuation)
    headers = [("Host", web.host_header), ("Accept", "image/*"),
               ("Accept-Encoding", "identity"), ("User-Agent", USER_AGENT),
               ("Connection", "close")]
    if proxy is not None:
        target = f"http://{web.host_header}{target}"
        headers += _proxy_headers(proxy)
    request = h11.Request(method="GET", target=target, headers=headers)
    try:
        await stream.send_all(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
        response = await _response(conn, stream, url, proxy)
        fields = {name.decode("ascii").lower(): value.decode("latin-1")
                  for name, value in response.headers}
        if response.status_code in REDIRECTS and "location" in fields:
            return Answer(response.status_code, location=fields["location"])
        if proxy is not None and response.status_code == 407:
            raise MediaProxyFailed(url, _refusal(proxy, "GET", response))
        if response.status_code != 200:
            through = "" if proxy is None else " (through this server's proxy)"
            raise MediaFetchFailed(url, f"was answered HTTP {response.status_code}{through}")
        declared = fields.get("content-length")
        if declared is not None and int(declared) > max_bytes:
            raise MediaTooLarge(url, f"declares {declared} bytes, more than the limit of "
                                f"{max_bytes}")
        body = bytearray()
        while True:
            event = await _next(conn, stream)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    raise MediaTooLarge(url, f"sent more than the limit of {max_bytes} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return Answer(200, content_type=fields.get("content-type"), body=bytes(body))
            else:
                raise MediaFetchFailed(url, "was answered with a body cut short")
    except h11.ProtocolError as exc:
        raise MediaFetchFailed(url, f"was answered with malformed HTTP ({exc})") from None
    except trio.BrokenResourceError:
        raise MediaFetchFailed(url, "was answered by a connection that broke") from None


async def open_tunnel(stream: trio.abc.Stream, web: WebUrl, url: str, proxy: Proxy) -> None:
    """Ask the proxy at the other end of ``stream`` for a tunnel to ``web``'s host and
    port (``CONNECT``). On return the stream is the tunnel. A refusal is a failed fetch
    (400) with the proxy's status: the client's URL is one the proxy will not or cannot
    reach. A 407, or an answer that breaks HTTP, is the proxy failing (502)."""
    host = f"[{web.host}]" if ":" in web.host else web.host
    authority = f"{host}:{web.port}"
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    request = h11.Request(method="CONNECT", target=authority, headers=[
        ("Host", authority), ("User-Agent", USER_AGENT), *_proxy_headers(proxy)])
    try:
        await stream.send_all(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
        response = await _response(conn, stream, url, proxy)
    except h11.ProtocolError as exc:
        raise MediaProxyFailed(url, f"the proxy {proxy} answered CONNECT with malformed "
                               f"HTTP ({exc})") from None
    except trio.BrokenResourceError:
        raise MediaProxyFailed(url, f"the connection to the proxy {proxy} broke") from None
    except MediaFetchFailed:  # (the stream ended first)
        raise MediaProxyFailed(url, f"the proxy {proxy} answered CONNECT with no HTTP "
                               "response") from None
    if response.status_code == 407:
        raise MediaProxyFailed(url, _refusal(proxy, f"CONNECT {authority}", response))
    if not 200 <= response.status_code < 300:
        reason = printable(response.reason.decode("latin-1"), 80)
        raise MediaFetchFailed(url, f"could not be fetched: this server's proxy refused "
                               f"CONNECT {authority}: HTTP {response.status_code} "
                               f"{reason}".rstrip())
    if conn.trailing_data[0]:  # (the origin speaks only after the TLS client hello)
        raise MediaProxyFailed(url, f"the proxy {proxy} sent bytes before the tunnel "
                               "was used")


#: The ``User-Agent`` of every request.
USER_AGENT = "trio-llm-server"


def _proxy_headers(proxy: Proxy) -> list[tuple[str, str]]:
    if proxy.authorization is None:
        return []
    return [("Proxy-Authorization", proxy.authorization)]


def _refusal(proxy: Proxy, asked: str, response: h11.Response) -> str:
    """Why the proxy did not do what was ``asked`` (``CONNECT host:443``), for the log:
    its status and reason, and for a 407 what the operator can do."""
    reason = printable(response.reason.decode("latin-1"), 80)
    why = f"the proxy {proxy} refused {asked}: HTTP {response.status_code} {reason}".rstrip()
    if response.status_code == 407:
        why += (f" (it wants credentials: user:password@ in {proxy.variable})"
                if proxy.authorization is None else
                f" (it refused the credentials in {proxy.variable})")
    return why


async def _response(conn: h11.Connection, stream: trio.abc.Stream, url: str,
                    proxy: Proxy | None = None) -> h11.Response:
    """The response head (past any 1xx); a failed fetch if the stream ends first."""
    event = await _next(conn, stream)
    while isinstance(event, h11.InformationalResponse):
        event = await _next(conn, stream)
    if not isinstance(event, h11.Response):
        who = "" if proxy is None else " (through this server's proxy)"
        raise MediaFetchFailed(url, f"was answered with no HTTP response{who}")
    return event


async def _next(conn: h11.Connection, stream: trio.abc.Stream) -> object:
    """The next h11 event, receiving from ``stream`` as h11 needs."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(bytes(await stream.receive_some(RECEIVE_BYTES)))
