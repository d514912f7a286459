"""What an HTTP/1.1 request head must satisfy before any app sees it. Sans-IO.

h11 parses leniently where RFC 9112 lets a server refuse, and some of that leniency is
what request smuggling through a proxy is made of. The server is often behind one
(TLS termination, rate limits), so it refuses, with a status, the shapes that a proxy and
this server could read differently:

* ``Content-Length`` and ``Transfer-Encoding`` together (RFC 9112 6.3: "ought to be
  handled as an error"; h11 reads the body as chunked and keeps the connection): 400.
* Obsolete line folding, a header line that starts with a space or tab (RFC 9112 5.2: a
  server must either refuse it or replace it; h11 unfolds it): 400. Checked on the raw
  head, see :func:`find_obs_fold`.
* ``Transfer-Encoding`` in an HTTP/1.0 request (RFC 9112 6.1: the framing "MUST" be
  treated as faulty; h11 would read the body as chunked): 400, as nginx answers.
* A version other than HTTP/1.0 and HTTP/1.1 on the request line, the HTTP/2 connection
  preface (``PRI * HTTP/2.0``) included: 505. This server speaks HTTP/1.1 only
  (docs/operations.md, "Security").
* ``Expect: 100-continue`` with a ``Content-Length`` over ``--max-body-bytes``: 413 at once,
  as nginx answers, instead of ``100 Continue`` (which hypercorn sends as soon as the head
  is in, before the app could refuse the size) and a body the server would not read.

An ``Upgrade`` header (``h2c``, ``websocket``) is ignored, as RFC 9110 7.8 allows: the
request is served as the HTTP/1.1 request it also is.

Every refusal is answered with an OpenAI-style JSON body and ``Connection: close``: after a
request whose framing is in doubt, nothing else on the connection can be trusted.
"""

from __future__ import annotations

import re

__all__ = ["Refusal", "check_request_head", "find_obs_fold", "head_end", "obs_fold"]

_VERSIONS = (b"1.0", b"1.1")
_BLANK_LINE = re.compile(rb"\n\r?\n")
_FOLDED_LINE = re.compile(rb"\n[ \t]")


class Refusal(Exception):
    """A request head that is refused before the app: ``status`` and a message for the
    client. Raised inside hypercorn's protocol and answered there."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def head_end(data: bytes | bytearray) -> int:
    """The index just past the blank line that ends a request head in ``data``, or -1.
    Line ends as h11 reads them (``\\r\\n``, or a bare ``\\n``)."""
    match = _BLANK_LINE.search(data)
    return -1 if match is None else match.end()


def find_obs_fold(head: bytes | bytearray) -> bool:
    """Whether a complete request head folds a header over two lines."""
    return _FOLDED_LINE.search(head, 0, max(len(head) - 2, 0)) is not None


def check_request_head(
    http_version: bytes, headers, *, expects_continue: bool = False, max_body: int | None = None
) -> Refusal | None:
    """The refusal for a parsed request head (h11's version and lower-cased headers), or
    None when it may be served. ``expects_continue``: the client waits for ``100 Continue``
    before it sends the body (h11's ``they_are_waiting_for_100_continue``); ``max_body``:
    the most body bytes the server reads (None: no limit here)."""
    if http_version not in _VERSIONS:
        version = http_version.decode("ascii", "replace")
        return Refusal(
            505,
            f"HTTP/{version} is not supported: this server speaks HTTP/1.1 (and 1.0).",
            "http_version_not_supported",
        )
    length: bytes | None = None
    chunked = False
    for name, value in headers:
        if name == b"content-length":
            length = value
        elif name == b"transfer-encoding":
            chunked = True
    if chunked and http_version == b"1.0":
        return Refusal(
            400,
            "An HTTP/1.0 request may not carry Transfer-Encoding (RFC 9112 section 6.1).",
            "ambiguous_framing",
        )
    if length is not None and chunked:
        return Refusal(
            400,
            "A request may not carry both Content-Length and Transfer-Encoding.",
            "ambiguous_framing",
        )
    if expects_continue and max_body is not None and length is not None and (
        int(length) > max_body  # (h11 lets only digits through)
    ):
        return Refusal(
            413, f"The request body is larger than {max_body} bytes.", "payload_too_large"
        )
    return None


def obs_fold() -> Refusal:
    """The refusal of a folded header line (a new exception each time: one raised again
    and again would keep every traceback it ever had)."""
    return Refusal(
        400, "Header lines may not be folded (obs-fold, RFC 9112 section 5.2).", "obs_fold"
    )
