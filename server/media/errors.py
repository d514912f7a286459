"""Why an image URL was not fetched: each a 400 naming the client's part (``param``).

A URL in a request is the client's choice, so every failure to fetch it is the client's
fault, even a remote server's 500: the request is refused before any engine work. The
``code`` tells a refusal by policy from a failed fetch, a size and a time limit apart.
Messages quote the URL clipped and escaped (server.errors.printable), never a traceback.

One failure is the operator's: this server's own HTTP proxy failing
(:class:`MediaProxyFailed`, a 502). Its message names neither the proxy nor why; the
fetcher logs both.
"""

from __future__ import annotations

from ..errors import ClientError, ServerError, printable

__all__ = [
    "MediaError",
    "MediaFetchFailed",
    "MediaProxyFailed",
    "MediaRefused",
    "MediaTimeout",
    "MediaTooLarge",
    "quote_url",
]

#: How much of a URL a message quotes (a data: URL may be megabytes long).
URL_CHARS = 120


def quote_url(url: str) -> str:
    """``url`` for a message: clipped, with control characters escaped."""
    return printable(url, URL_CHARS)


class MediaError(ClientError):
    """An image URL that was not fetched; ``param`` names the client's part."""

    code = "media_refused"

    def __init__(self, url: str, why: str, *, param: str | None = None):
        # (``why`` may quote what a remote server sent: escaped as the URL is)
        why = printable(why, 512)
        super().__init__(f"image URL '{quote_url(url)}' {why}", param=param)
        #: The reason alone, for logs and tests.
        self.why = why


class MediaRefused(MediaError):
    """The policy refuses the URL: its scheme, host, address, path or content."""

    code = "media_refused"


class MediaFetchFailed(MediaError):
    """The URL was allowed but not fetched: no connection, a bad answer, a 404."""

    code = "media_fetch_failed"


class MediaTooLarge(MediaError):
    """The image is larger than the policy's byte limit (declared or counted)."""

    code = "media_too_large"


class MediaTimeout(MediaError):
    """The fetch (with its wait for a slot) ran past the policy's time limit."""

    code = "media_timeout"


class MediaProxyFailed(ServerError):
    """This server's HTTP proxy failed a fetch: it does not resolve or answer, its TLS
    failed, it wants other credentials (407), or it broke HTTP. The operator's fault, so
    a 502 that alerting on 5xx sees. The client is not told the proxy's address; ``why``
    names it, for the log."""

    status = 502
    type = "server_error"
    code = "media_proxy_failed"

    def __init__(self, url: str, why: str, *, param: str | None = None):
        super().__init__(f"image URL '{quote_url(url)}' could not be fetched: this "
                         "server's HTTP proxy failed (its log says why)", param=param)
        #: Why, naming the proxy (never its credentials): for the log and tests.
        self.why = printable(why, 512)
