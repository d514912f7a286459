"""Hostile image URLs: whatever a client writes, the fetcher answers a 400 naming the part.

A URL is the client's string, so nothing in it may escape as another exception (a 500
with a stack trace in the log): not a NUL byte in a file path, an empty or over-long
host label, a lone surrogate, a port out of range. No test here reaches the network: a
resolver installed for each test answers every name "not found", so a fetch that gets
as far as a look-up fails at once.
"""

from __future__ import annotations

import socket
import string

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.errors import error_body
from server.media import MediaError, MediaFetcher, MediaPolicy

PARAM = "input[0].content[2].image_url"


class NoNames(trio.abc.HostnameResolver):
    """A resolver that knows no name (literal addresses never reach it)."""

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def getnameinfo(self, sockaddr, flags):
        raise NotImplementedError


async def outcome(fetcher: MediaFetcher, url: object) -> str:
    """The error code fetching ``url`` gives; anything but a MediaError fails the test."""
    trio.socket.set_custom_hostname_resolver(NoNames())
    with trio.fail_after(30):
        try:
            await fetcher.fetch_image(url, param=PARAM)  # type: ignore[arg-type]
        except MediaError as exc:
            body = error_body(exc)["error"]
            assert exc.status == 400 and body["param"] == PARAM
            assert "Traceback" not in body["message"]
            return body["code"]
    raise AssertionError(f"{url!r} was fetched")


@pytest.mark.parametrize("url, code", [
    ("file://{dir}/a%00b.png", "media_refused"),            # (os.open: embedded null byte)
    ("file://{dir}/%00", "media_refused"),
    ("file://{dir}/a\ud800.png", "media_refused"),         # (not encodable as a file name)
    ("file://{dir}/a\udcff.png", "media_fetch_failed"),    # (a byte 0xff: no such file)
    ("file://[x/a.png", "media_refused"),                   # (urlsplit: Invalid IPv6 URL)
    ("http://a..b/x.png", "media_refused"),                # (an empty label: IDNA refuses it)
    ("http://" + "a" * 64 + ".example/x.png", "media_refused"),  # (a label over 63)
    ("http://\u3002/x.png", "media_refused"),
    ("http://[::1/x.png", "media_refused"),
    ("http://a:99999/x.png", "media_refused"),
    ("http://a:-1/x.png", "media_refused"),
    ("http://[fe80::1%25eth0]/x.png", "media_refused"),
    ("http://%31%32%37.0.0.1/x.png", "media_refused"),
    ("http://exa mple/x.png", "media_refused"),
    ("http://a\r\nHost: b/x.png", "media_refused"),
    ("data:image/png;base64,\ud800", "media_refused"),
    ("data:image/png;base64", "media_refused"),
    ("http://no-such-host.example/x.png", "media_fetch_failed"),
], ids=lambda value: ascii(value)[:40])
async def test_hostile_urls_are_a_400_naming_the_part(tmp_path, url, code):
    fetcher = MediaFetcher(MediaPolicy(allowed_local_dir=str(tmp_path)))
    assert await outcome(fetcher, url.replace("{dir}", str(tmp_path))) == code


_schemes = st.sampled_from(["http://", "https://", "file://", "file:///", "data:", "HTTP://",
                            "ftp://", ""])
_pieces = st.sampled_from([
    "image/png", ";base64,", "//", "/", ":", "@", "[", "]", "%", "%00", "%2e%2e", "..", ".",
    "localhost", "127.0.0.1", "::1", "\x00", "\r\n", " ", "\ud800", "\u3002", "\u0130",
    "a" * 70, "#", "?", "\\", "0x7f.1", "xn--", "=", "iVBORw0KGgo", ":0", ":65536",
])
_urls = st.tuples(_schemes, *[st.one_of(_pieces, st.text(string.printable, max_size=8))] * 6
                  ).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(url=_urls)
def test_any_url_is_fetched_or_a_400(tmp_path_factory, url):
    """Nothing on loopback listens to these URLs, and the switch for it is off, so each is
    refused or fails; never with another exception."""
    allowed = tmp_path_factory.getbasetemp()
    fetcher_policy = MediaPolicy(allowed_local_dir=str(allowed), fetch_timeout=5)

    async def main() -> str:
        return await outcome(MediaFetcher(fetcher_policy), url)

    assert trio.run(main).startswith("media_")
