"""The media fetcher: an image URL of a request -> its bytes, or a 400 naming the part.

Theory of operation
-------------------

A request's image URL makes the server a client in the operator's network, so the
fetch is the request's, under the operator's policy (server.media.policy):

1. The URL is classified before anything else. A ``data:`` URL is decoded at once (no
   slot, no clock: its bytes are already in the request body). A refused scheme, a host
   off ``--allowed-media-domains`` or a refused address literal ends here, before any
   resolution.
2. Every other fetch runs under one ``trio.fail_after(fetch_timeout)`` that also covers
   its wait for one of ``max_fetches`` slots (a ``trio.CapacityLimiter``): a burst of
   image requests waits, and a fetch never outlives its time.
3. An http(s) URL's host is resolved once; every address is checked, and the socket
   connects to a checked address (server.media.connect), or to the URL's HTTP proxy
   (server.media.proxy: the environment's, read at start). HTTPS verifies the URL's host
   name with one default SSL context, built at the first https fetch.
4. One GET per connection (server.media.http1), its body bounded by ``max_bytes``. A
   redirect is a new URL, checked from step 1 (http and https only) against the same
   policy, at most ``max_redirects`` times; the connection is closed first.
5. The bytes must be an accepted image type, declared and sniffed alike
   (server.media.image). The result is a :class:`~server.media.image.FetchedImage`:
   bytes, media type, SHA-256. Decoding is the worker's.

The fetch runs in the caller's task: a cancelled request cancels its fetch, and the
connection is closed on the way out (``trio.aclose_forcefully``), whatever ended it.
Every failure is a :class:`~server.media.errors.MediaError` (400) naming the client's
part (``param``) and the reason. Nothing else escapes but cancellation and the server's
own faults: this server's proxy failing (:class:`MediaProxyFailed`, a 502, logged here),
or no file descriptor left for a socket.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin

import trio

from ..errors import printable
from .connect import open_checked_stream
from .errors import (MediaError, MediaFetchFailed, MediaProxyFailed, MediaRefused, MediaTimeout,
                     quote_url)
from .http1 import http_get
from .image import FetchedImage, checked_image
from .local import read_local_image
from .policy import (DataUrl, FileUrl, MediaPolicy, WebUrl, decode_data_url,
                     parse_media_url)
from .proxy import all_proxy_ignored

__all__ = ["MediaFetcher"]

log = logging.getLogger("server.media")

#: Seconds between two log lines about the proxy failing fetches.
PROXY_WARNING_PERIOD = 60.0


class MediaFetcher:
    """Fetches image URLs under one :class:`MediaPolicy`; one per server, shared by every
    request (its slots bound the fetches of them all).

    ``ssl_context`` verifies https servers (None: the system's default CAs). Raises
    ValueError if the policy's local directory is not a directory.
    """

    def __init__(self, policy: MediaPolicy, *, ssl_context: ssl.SSLContext | None = None):
        if policy.allowed_local_dir is not None and not os.path.isdir(policy.allowed_local_dir):
            raise ValueError(f"--allowed-local-media-path {policy.allowed_local_dir!r} is "
                             "not a directory")
        self.policy = policy
        if policy.proxies is not None:
            log.info("%s", policy.proxies.describe())
        ignored = all_proxy_ignored()
        if ignored is not None:
            log.warning("image URLs: %s is set and not read (HTTP_PROXY and HTTPS_PROXY "
                        "are, as vLLM reads them)", ignored)
        #: When the proxy's last failure was logged, and the failures since (unlogged).
        self._proxy_warned: float | None = None
        self._proxy_failures = 0
        #: The slots: one per fetch running (a fetch waits for one within its timeout).
        self.limiter = trio.CapacityLimiter(policy.max_fetches)
        self._ssl_context = ssl_context

    def statistics(self) -> trio.CapacityLimiterStatistics:
        """The slots: fetches running (``borrowed_tokens``) and waiting (``tasks_waiting``)."""
        return self.limiter.statistics()

    def _ssl(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    async def fetch_image(self, url: str, *, param: str | None = None) -> FetchedImage:
        """The image at ``url``; a :class:`MediaError` naming ``param`` (the client's
        part, e.g. ``messages[0].content[1].image_url.url``) if refused or failed."""
        try:
            source = parse_media_url(url, self.policy)
            if isinstance(source, DataUrl):
                return await _off_loop(len(source.payload), self._data_image, url, source)
            try:
                with trio.fail_after(self.policy.fetch_timeout):
                    async with self.limiter:
                        if isinstance(source, FileUrl):
                            return await read_local_image(source, self.policy)
                        return await self._fetch_web(source, url)
            except trio.TooSlowError:
                raise MediaTimeout(url, f"was not fetched within "
                                   f"{self.policy.fetch_timeout:g} s") from None
        except (MediaError, MediaProxyFailed) as exc:
            exc.param = None if param is None else printable(param)
            if isinstance(exc, MediaProxyFailed):
                self._proxy_failed(exc)
            raise

    def _proxy_failed(self, exc: MediaProxyFailed) -> None:
        """Log why the proxy failed: at once, then at most once a
        :data:`PROXY_WARNING_PERIOD` with the count since (a proxy that is down fails
        every fetch: one line each would flood the log)."""
        self._proxy_failures += 1
        now = time.monotonic()
        if self._proxy_warned is not None and now - self._proxy_warned < PROXY_WARNING_PERIOD:
            return
        log.warning("image URLs: %s (%d fetch(es) failed by the proxy since the last such "
                    "line; each a 502 media_proxy_failed)", exc.why, self._proxy_failures)
        self._proxy_warned, self._proxy_failures = now, 0

    def _data_image(self, url: str, source: DataUrl) -> FetchedImage:
        return checked_image(url, decode_data_url(source, self.policy), source.media_type)

    async def _fetch_web(self, web: WebUrl, url: str) -> FetchedImage:
        """Follow ``web``'s redirects to its image (``url``: the client's, for errors)."""
        routes = self.policy.proxies
        for _ in range(self.policy.max_redirects + 1):
            proxy = None if routes is None else routes.proxy_for(web.scheme, web.host)
            tls = web.scheme == "https" or (proxy is not None and proxy.tls)
            stream = await open_checked_stream(web, url, self.policy,
                                               self._ssl() if tls else None, proxy)
            try:
                answer = await http_get(stream, web, url, self.policy.max_bytes,
                                        proxy if web.scheme == "http" else None)
            finally:
                await trio.aclose_forcefully(stream)
            if answer.location is None:
                return await _off_loop(len(answer.body), checked_image, url, answer.body,
                                       answer.content_type)
            web = self._redirect(web, answer.location, url)
        raise MediaFetchFailed(url, f"redirects more than {self.policy.max_redirects} times")

    def _redirect(self, web: WebUrl, location: str, url: str) -> WebUrl:
        """The checked target of a redirect from ``web``; refused naming it otherwise."""
        try:
            target = urljoin(web.url, location)
        except ValueError:  # (e.g. "http://[::1": the remote server's string)
            raise MediaFetchFailed(url, f"redirects to '{quote_url(location)}', which is not "
                                   "a valid URL") from None
        scheme = target.split(":", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise MediaRefused(url, f"redirects to '{quote_url(target)}', which is not http "
                               "or https")
        try:
            source = parse_media_url(target, self.policy)
        except MediaError as exc:
            raise type(exc)(url, f"redirects to '{quote_url(target)}', which {exc.why}") from None
        assert isinstance(source, WebUrl)
        return source


#: Bytes past which decoding base64 and hashing run in a thread: 20 MiB take about 0.15 s
#: to decode and 0.015 s to hash, too long to hold the event loop.
OFF_LOOP_BYTES = 1 << 20


async def _off_loop(size: int, work: Callable[..., FetchedImage], *args: Any) -> FetchedImage:
    """``work(*args)``, in a worker thread when ``size`` bytes make it long."""
    if size <= OFF_LOOP_BYTES:
        return work(*args)
    return await trio.to_thread.run_sync(work, *args)
