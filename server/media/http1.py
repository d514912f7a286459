"""One HTTP/1.1 GET of an image over an open stream: h11 as a small sans-IO client.

The request is ``GET target`` with ``Accept: image/*`` and ``Connection: close``: one
request per connection, so nothing is pooled and a closed stream ends it. The answer is
read within the byte limit: a declared ``Content-Length`` over it is refused before any
body byte is read, and the body (chunked or not) is counted as it arrives and refused the
moment it passes the limit. A redirect's body is never read.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from urllib.parse import quote

import h11
import trio

from .errors import MediaFetchFailed, MediaTooLarge
from .policy import WebUrl

__all__ = ["REDIRECTS", "Answer", "http_get"]

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


async def http_get(stream: trio.abc.Stream, web: WebUrl, url: str, max_bytes: int) -> Answer:
    """GET ``web`` over ``stream``; ``url`` (the client's) is what errors name. A status
    other than 200 or a redirect is a failed fetch."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    # (a path or query the client wrote in Unicode goes as its UTF-8, percent-escaped)
    target = quote(web.target, safe=string.punctuation)
    request = h11.Request(method="GET", target=target, headers=[
        ("Host", web.host_header), ("Accept", "image/*"), ("Accept-Encoding", "identity"),
        ("User-Agent", "trio-llm-server"), ("Connection", "close")])
    try:
        await stream.send_all(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
        response = await _next(conn, stream)
        while isinstance(response, h11.InformationalResponse):
            response = await _next(conn, stream)
        if not isinstance(response, h11.Response):
            raise MediaFetchFailed(url, "was answered with no HTTP response")
        headers = {name.decode("ascii").lower(): value.decode("latin-1")
                   for name, value in response.headers}
        if response.status_code in REDIRECTS and "location" in headers:
            return Answer(response.status_code, location=headers["location"])
        if response.status_code != 200:
            raise MediaFetchFailed(url, f"was answered HTTP {response.status_code}")
        declared = headers.get("content-length")
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
                return Answer(200, content_type=headers.get("content-type"), body=bytes(body))
            else:
                raise MediaFetchFailed(url, "was answered with a body cut short")
    except h11.ProtocolError as exc:
        raise MediaFetchFailed(url, f"was answered with malformed HTTP ({exc})") from None
    except trio.BrokenResourceError:
        raise MediaFetchFailed(url, "was answered by a connection that broke") from None


async def _next(conn: h11.Connection, stream: trio.abc.Stream) -> object:
    """The next h11 event, receiving from ``stream`` as h11 needs."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(bytes(await stream.receive_some(RECEIVE_BYTES)))
