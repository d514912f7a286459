"""Image URLs fetched safely (server.media): the policy, on real sockets.

A tiny trio HTTP server on loopback, started by each test that needs one, serves fixed
bytes per path (a real PNG made here with zlib and struct). Loopback is refused by
default, so the tests that fetch from it allow it explicitly, as an operator would with
--allow-private-media-addresses. Real time throughout, each fetch under a generous
``trio.fail_after``; the short fetch timeouts are the policy's own.
"""

from __future__ import annotations

import base64
import functools
import gc
import hashlib
import ipaddress
import os
import socket
import ssl
import struct
import warnings
import zlib
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import pytest
import trio

from server.cli import build_parser, config_from_args
from server.errors import error_body
from server.media import (FetchedImage, MediaError, MediaFetcher, MediaFetchFailed,
                          MediaPolicy, MediaRefused, MediaTimeout, MediaTooLarge,
                          policy_from_config)
from server.media.connect import connect_first
from server.media.policy import address_refusal
from tests.remote import make_certificate

#: The bound on any one fetch of a test: far past every policy timeout used here.
GENEROUS = 30
PARAM = "messages[0].content[1].image_url.url"
#: The loopback server's names, listed, and the switch that lets them reach loopback (the
#: switch needs the list: server.media.policy).
LOOPBACK = {"allowed_domains": frozenset({"localhost", "127.0.0.1"}),
            "allow_private_addresses": True}
OPEN = MediaPolicy(**LOOPBACK)


def make_png(width: int = 3, height: int = 2) -> bytes:
    """A real (red) RGB PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


PNG = make_png()
JPEG_MAGIC = b"\xff\xd8\xff\xe0" + bytes(64)
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"/>'

Handler = Callable[[trio.SocketStream], Awaitable[None]]


def answer(body: bytes, content_type: str | None = "image/png", status: int = 200,
           extra: str = "") -> Handler:
    """A handler that answers ``body`` whole, with its Content-Length."""
    async def handle(stream: trio.SocketStream) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}"
        if content_type is not None:
            head += f"Content-Type: {content_type}\r\n"
        await stream.send_all(head.encode() + b"\r\n" + body)
    return handle


def redirect(location: str) -> Handler:
    return answer(b"", None, 302, f"Location: {location}\r\n")


async def read_head(stream: trio.abc.Stream) -> bytes | None:
    """A request's head (what arrived with it too); None if the client hung up first."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = await stream.receive_some(4096)
        if not data:
            return None
        head += data
    return head


class LoopbackServer:
    """HTTP on 127.0.0.1: a handler per path; records each request's path."""

    def __init__(self) -> None:
        self.routes: dict[str, Handler] = {}
        self.paths: list[str] = []
        self.port = 0

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            head = await read_head(stream)
            if head is None:
                return
            path = head.split(b" ", 2)[1].decode()
            self.paths.append(path)
            await self.routes.get(path, answer(b"no", "text/plain", 404))(stream)
        except trio.BrokenResourceError:
            pass


@pytest.fixture
async def web(nursery):
    server = LoopbackServer()
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    server.port = listeners[0].socket.getsockname()[1]
    return server


async def fetch(policy: MediaPolicy, url: str) -> FetchedImage:
    with trio.fail_after(GENEROUS):
        return await MediaFetcher(policy).fetch_image(url, param=PARAM)


async def refused(policy: MediaPolicy, url: str, kind: type[MediaError] = MediaRefused) -> str:
    """The message of the error fetching ``url`` raises (of ``kind``, naming the part)."""
    with pytest.raises(MediaError) as info:
        await fetch(policy, url)
    assert type(info.value) is kind, info.value.message
    body = error_body(info.value)["error"]
    assert body["param"] == PARAM and body["code"] == kind.code
    assert info.value.status == 400 and "Traceback" not in body["message"]
    return body["message"]


# -- addresses ---------------------------------------------------------------------------

async def test_the_default_policy_refuses_loopback_after_resolution(web):
    web.routes["/a.png"] = answer(PNG)
    message = await refused(MediaPolicy(), web.url("/a.png"))
    assert "resolves to a loopback address 127.0.0.1" in message
    assert f"localhost:{web.port}/a.png" in message
    assert web.paths == []  # (never connected)


@pytest.mark.parametrize("host, why", [
    ("10.0.0.5", "is a private address 10.0.0.5"),
    ("169.254.169.254", "is a cloud metadata address 169.254.169.254"),
    ("[::ffff:127.0.0.1]", "is a loopback address ::ffff:7f00:1 (127.0.0.1 inside IPv6)"),
    ("[::ffff:10.1.2.3]", "is a private address ::ffff:a01:203 (10.1.2.3 inside IPv6)"),
    ("100.64.1.1", "is a shared (CGNAT) address 100.64.1.1"),
    ("[fd00:ec2::254]", "is a cloud metadata address fd00:ec2::254"),
    ("[fc00::1]", "is a private address fc00::1"),
    ("[::1]", "is a loopback address ::1"),
    ("0.0.0.0", "is an unspecified address 0.0.0.0"),
    ("224.0.0.1", "is a multicast address 224.0.0.1"),
])
async def test_refused_address_literals(host, why):
    message = await refused(MediaPolicy(), f"http://{host}/latest/meta-data")
    assert message.endswith(why)


@pytest.mark.parametrize("address, allowed", [
    ("127.0.0.1", True), ("10.0.0.5", True), ("::ffff:192.168.1.1", True), ("fc00::1", True),
    ("169.254.169.254", False), ("fd00:ec2::254", False), ("0.0.0.0", False),
    ("255.255.255.255", False), ("ff02::1", False),
])
def test_the_switch_allows_private_addresses_but_never_metadata(address, allowed):
    ip = ipaddress.ip_address(address)
    assert address_refusal(ip, MediaPolicy()) is not None
    assert (address_refusal(ip, OPEN) is None) is allowed


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_allowed(address):
    assert address_refusal(ipaddress.ip_address(address), MediaPolicy()) is None


@pytest.mark.parametrize("address", ["::10.0.0.1", "2002:a00:1::", "64:ff9b::a00:1"])
def test_ipv4_inside_ipv6_is_judged_as_ipv4(address):
    assert "10.0.0.1 inside IPv6" in address_refusal(ipaddress.ip_address(address),
                                                     MediaPolicy())


async def test_loopback_is_fetched_with_the_switch(web):
    web.routes["/a.png"] = answer(PNG, "image/png; charset=binary")
    for host in ("localhost", "127.0.0.1"):
        image = await fetch(OPEN, web.url("/a.png", host))
        assert image == FetchedImage(PNG, "image/png", hashlib.sha256(PNG).hexdigest())
    assert web.paths == ["/a.png", "/a.png"]


# -- resolution --------------------------------------------------------------------------

class Answers(trio.abc.HostnameResolver):
    """A resolver for test names: each look-up of a name gives its next answer (the last
    one again once they run out), and is recorded."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = {name.encode(): list(given) for name, given in answers.items()}
        self.looked_up: list[bytes] = []

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        self.looked_up.append(host)
        given = self.answers[host]
        addresses = given.pop(0) if len(given) > 1 else given[0]
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port, 0, 0)) if ":" in a
                else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in addresses]

    async def getnameinfo(self, sockaddr, flags):
        raise NotImplementedError


async def test_every_resolved_address_is_checked(web):
    web.routes["/a.png"] = answer(PNG)
    resolver = Answers({"mixed.test": [["127.0.0.1", "169.254.169.254"]]})
    trio.socket.set_custom_hostname_resolver(resolver)
    policy = MediaPolicy(allowed_domains=frozenset({"mixed.test"}), allow_private_addresses=True)
    message = await refused(policy, web.url("/a.png", "mixed.test"))
    assert message.endswith("resolves to a cloud metadata address 169.254.169.254")
    assert web.paths == []  # (not even to the first address, which passes)


async def test_a_name_is_resolved_once_and_its_checked_address_connected_to(web):
    web.routes["/a.png"] = answer(PNG)
    # (a rebinding name: a second look-up would give the metadata address)
    resolver = Answers({"rebind.test": [["127.0.0.1"], ["169.254.169.254"]]})
    trio.socket.set_custom_hostname_resolver(resolver)
    policy = MediaPolicy(allowed_domains=frozenset({"rebind.test"}),
                         allow_private_addresses=True)
    assert (await fetch(policy, web.url("/a.png", "rebind.test"))).data == PNG
    assert resolver.looked_up == [b"rebind.test"] and web.paths == ["/a.png"]


async def test_an_address_that_does_not_answer_costs_a_moment_not_the_fetch(web):
    """The name's first address drops the connection attempt (a listener whose queue is
    full: the kernel drops the SYN, as a firewall does), the second answers: the fetch
    tries the second beside the first after a moment (RFC 8305), well within its time
    limit, and gets the image."""
    web.routes["/a.png"] = answer(PNG)
    hole = socket.socket()
    hole.bind(("127.0.0.2", web.port))
    hole.listen(0)
    queued = socket.create_connection(("127.0.0.2", web.port))  # (fills its queue)
    try:
        resolver = Answers({"two.test": [["127.0.0.2", "127.0.0.1"]]})
        trio.socket.set_custom_hostname_resolver(resolver)
        policy = MediaPolicy(allowed_domains=frozenset({"two.test"}),
                             allow_private_addresses=True, fetch_timeout=60.0)
        with trio.fail_after(30):  # (a hang guard, half the fetch's own limit)
            assert (await fetch(policy, web.url("/a.png", "two.test"))).data == PNG
        assert web.paths == ["/a.png"]
    finally:
        queued.close()
        hole.close()


async def test_an_address_this_host_cannot_open_a_socket_for_is_one_failed_attempt(web):
    """An address whose socket cannot be made here (a family or protocol the kernel
    refuses: an IPv6 answer on a host without IPv6) fails its attempt only; the next
    address connects, and with no other its error is the one reported."""
    unopenable = (socket.AF_INET, socket.SOCK_STREAM, 253, ("127.0.0.1", web.port))
    working = (socket.AF_INET, socket.SOCK_STREAM, 6, ("127.0.0.1", web.port))
    with trio.fail_after(GENEROUS):
        sock, error = await connect_first([unopenable, working])
    assert sock is not None and error is None
    assert sock.getpeername() == ("127.0.0.1", web.port)
    sock.close()
    with trio.fail_after(GENEROUS):
        sock, error = await connect_first([unopenable])
    assert sock is None and isinstance(error, OSError) and error.errno is not None


# -- https -------------------------------------------------------------------------------

async def test_https_verifies_the_url_host(web, nursery, tmp_path):
    cert_path, key_path = make_certificate(tmp_path, "localhost")  # (the openssl command)
    cert = cert_path.read_bytes()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert_path, key_path)
    names: list[str | None] = []
    server_context.sni_callback = lambda sock, name, context: names.append(name)

    async def tls(stream: trio.SocketStream) -> None:
        wrapped = trio.SSLStream(stream, server_context, server_side=True)
        try:
            await web.handle(wrapped)
        except trio.BrokenResourceError:
            pass  # (a client that refused the certificate)
        finally:
            await trio.aclose_forcefully(wrapped)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, tls, 0,
                                                      host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    web.routes["/a.png"] = answer(PNG)
    fetcher = MediaFetcher(OPEN, ssl_context=ssl.create_default_context(cadata=cert.decode()))
    with trio.fail_after(GENEROUS):
        image = await fetcher.fetch_image(f"https://localhost:{port}/a.png")
        assert image.data == PNG and names == ["localhost"]
        # (the certificate is for localhost, not 127.0.0.1: refused, nothing asked)
        with pytest.raises(MediaFetchFailed, match="TLS with 127.0.0.1:.* failed"):
            await fetcher.fetch_image(f"https://127.0.0.1:{port}/a.png")
    assert web.paths == ["/a.png"]


# -- redirects ---------------------------------------------------------------------------

async def test_a_redirect_is_followed_and_each_target_checked(web):
    web.routes["/hop"] = redirect("/a.png")
    web.routes["/a.png"] = answer(PNG)
    assert (await fetch(OPEN, web.url("/hop"))).data == PNG
    web.routes["/meta"] = redirect("http://169.254.169.254/latest/meta-data/")
    # (even listed, with the switch: metadata addresses are refused always)
    listed = MediaPolicy(allowed_domains=frozenset({"localhost", "169.254.169.254"}),
                         allow_private_addresses=True)
    message = await refused(listed, web.url("/meta"))
    assert "redirects to 'http://169.254.169.254/latest/meta-data/', which is a cloud " \
           "metadata address" in message
    assert web.paths == ["/hop", "/a.png", "/meta"]


async def test_a_redirect_off_the_allowed_domains_is_refused(web):
    policy = MediaPolicy(allowed_domains=frozenset({"localhost"}), allow_private_addresses=True)
    web.routes["/hop"] = redirect(web.url("/a.png", "127.0.0.1"))
    web.routes["/a.png"] = answer(PNG)
    message = await refused(policy, web.url("/hop"))
    assert "which names host '127.0.0.1', which is not in --allowed-media-domains" in message
    assert web.paths == ["/hop"]


async def test_a_redirect_to_another_scheme_is_refused(web):
    web.routes["/hop"] = redirect("file:///etc/passwd")
    message = await refused(MediaPolicy(**LOOPBACK, allowed_local_dir="/"),
                            web.url("/hop"))
    assert "redirects to 'file:///etc/passwd', which is not http or https" in message


async def test_a_redirect_to_a_malformed_url_is_a_failed_fetch(web):
    web.routes["/hop"] = redirect("http://[::1/a.png")
    message = await refused(OPEN, web.url("/hop"), MediaFetchFailed)
    assert message.endswith("redirects to 'http://[::1/a.png', which is not a valid URL")


async def test_a_redirect_loop_stops_at_the_limit(web):
    web.routes["/loop"] = redirect("/loop")
    message = await refused(OPEN, web.url("/loop"), MediaFetchFailed)
    assert "redirects more than 5 times" in message
    assert web.paths == ["/loop"] * 6


async def test_a_unicode_path_is_sent_percent_escaped(web):
    web.routes["/%C3%BC.png?q=%C3%A9"] = answer(PNG)
    assert (await fetch(OPEN, web.url("/\u00fc.png?q=\u00e9"))).data == PNG


# -- sizes and time ----------------------------------------------------------------------

async def test_a_declared_length_over_the_limit_is_refused_before_the_body(web):
    async def head_only(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                              b"Content-Length: 5000\r\n\r\n")
        await trio.sleep_forever()  # (a fetch that waited for the body would time out)

    web.routes["/big.png"] = head_only
    message = await refused(MediaPolicy(max_bytes=1000, **LOOPBACK,
                                        fetch_timeout=GENEROUS * 2),
                            web.url("/big.png"), MediaTooLarge)
    assert "declares 5000 bytes, more than the limit of 1000" in message


async def test_an_undeclared_body_is_counted_and_cut_past_the_limit(web):
    async def endless_chunks(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n")
        while True:  # (until the client hangs up)
            await stream.send_all(b"1f4\r\n" + PNG[:8] + bytes(492) + b"\r\n")

    web.routes["/big.png"] = endless_chunks
    message = await refused(MediaPolicy(max_bytes=2000, **LOOPBACK,
                                        fetch_timeout=GENEROUS * 2),
                            web.url("/big.png"), MediaTooLarge)
    assert "sent more than the limit of 2000 bytes" in message


async def test_a_stalled_server_is_a_timeout(web):
    async def stall(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    web.routes["/slow.png"] = stall
    message = await refused(MediaPolicy(fetch_timeout=0.5, **LOOPBACK),
                            web.url("/slow.png"), MediaTimeout)
    assert "was not fetched within 0.5 s" in message


async def test_the_timeout_covers_the_wait_for_a_slot(web):
    web.routes["/a.png"] = answer(PNG)
    fetcher = MediaFetcher(MediaPolicy(fetch_timeout=0.5, max_fetches=1, **LOOPBACK))
    with trio.fail_after(GENEROUS):
        holder = object()
        fetcher.limiter.acquire_on_behalf_of_nowait(holder)  # (every slot taken)
        with pytest.raises(MediaTimeout):
            await fetcher.fetch_image(web.url("/a.png"))
        assert fetcher.statistics().tasks_waiting == 0 and web.paths == []


async def test_a_cancelled_fetch_closes_its_connection(web):
    sent, closed = trio.Event(), trio.Event()

    async def part_then_wait(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                              b"Content-Length: 1000\r\n\r\n" + PNG[:10])
        sent.set()
        try:
            while await stream.receive_some(4096):
                pass
        except trio.BrokenResourceError:
            pass  # (a reset is a close too)
        closed.set()

    web.routes["/a.png"] = part_then_wait
    fetcher = MediaFetcher(MediaPolicy(**LOOPBACK, fetch_timeout=GENEROUS * 2))
    # (closed by the fetch, not left to the garbage collector: that warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with trio.fail_after(GENEROUS):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetcher.fetch_image, web.url("/a.png"))
                await sent.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert not closed.is_set()
                nursery.cancel_scope.cancel()
            await closed.wait()
        gc.collect()
    # (only this fetch's socket, to the test's server: the collection also finds sockets
    # other tests of this process left to it)
    to_web = f"raddr=('127.0.0.1', {urlsplit(web.url('/')).port})"
    assert [w.message for w in caught if issubclass(w.category, ResourceWarning)
            and to_web in str(w.message)] == []
    assert fetcher.statistics().borrowed_tokens == 0


# -- content types -----------------------------------------------------------------------

@pytest.mark.parametrize("body, content_type, why", [
    (PNG, "text/html", "has content type 'text/html', not an accepted image type"),
    (SVG, "image/svg+xml", "is an SVG image, which is not accepted"),
    (JPEG_MAGIC, "image/png", "is declared 'image/png' but its bytes are image/jpeg"),
    (b"<html></html>", "image/png", "is declared 'image/png' but its bytes are not an "
                                    "accepted image"),
    (PNG, None, "declares no content type"),
], ids=["html", "svg", "jpeg-as-png", "html-as-png", "undeclared"])
async def test_only_images_whose_type_and_magic_agree(web, body, content_type, why):
    web.routes["/x"] = answer(body, content_type)
    assert why in await refused(OPEN, web.url("/x"))


async def test_a_jpeg_is_fetched_as_jpeg(web):
    web.routes["/x.jpg"] = answer(JPEG_MAGIC, "image/jpg")
    assert (await fetch(OPEN, web.url("/x.jpg"))).media_type == "image/jpeg"


async def test_an_error_status_is_a_failed_fetch(web):
    message = await refused(OPEN, web.url("/missing.png"), MediaFetchFailed)
    assert message.endswith("was answered HTTP 404")


# -- data: URLs --------------------------------------------------------------------------

def data_url(body: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(body).decode()}"


async def test_a_data_url_is_decoded_without_a_fetch():
    image = await fetch(MediaPolicy(), data_url(PNG))
    assert image == FetchedImage(PNG, "image/png", hashlib.sha256(PNG).hexdigest())


@pytest.mark.parametrize("url, kind, why", [
    ("data:image/png;base64,iVBOR%%%w0KGgo=", MediaRefused, "whose base64 is invalid"),
    (data_url(b"hello", "text/plain"), MediaRefused,
     "of media type 'text/plain', not an image"),
    ("data:image/png,rawbytes", MediaRefused, "that is not base64"),
    (data_url(JPEG_MAGIC), MediaRefused, "but its bytes are image/jpeg"),
    (data_url(PNG + bytes(1000)), MediaTooLarge, "is larger than 1000 bytes"),
], ids=["bad-base64", "text", "not-base64", "jpeg-as-png", "too-large"])
async def test_refused_data_urls(url, kind, why):
    policy = MediaPolicy(max_bytes=1000)
    assert why in await refused(policy, url, kind)


async def test_a_large_data_url_is_decoded(web):
    big = PNG + bytes(3 * 1024 * 1024)  # (decoded and hashed off the event loop)
    image = await fetch(MediaPolicy(), data_url(big))
    assert image.data == big and image.sha256 == hashlib.sha256(big).hexdigest()
    web.routes["/big.png"] = answer(big)
    assert (await fetch(OPEN, web.url("/big.png"))).data == big


async def test_the_data_url_limit_is_on_decoded_bytes():
    # (999 bytes pass the estimate made before decoding: the decoded count refuses them)
    exact = PNG + bytes(998 - len(PNG))
    policy = MediaPolicy(max_bytes=998)
    assert len(data_url(exact)) > 998 and (await fetch(policy, data_url(exact))).data == exact
    await refused(policy, data_url(exact + b"\x00"), MediaTooLarge)


# -- file: URLs --------------------------------------------------------------------------

async def test_file_urls_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "escape.png")
    policy = MediaPolicy(allowed_local_dir=str(allowed))

    assert (await fetch(policy, f"file://{allowed}/a.png")).data == PNG
    for path in (tmp_path / "secret.png", allowed / "escape.png", allowed / ".." / "secret.png"):
        message = await refused(policy, f"file://{path}")
        assert message.endswith("names a file outside --allowed-local-media-path")
    message = await refused(MediaPolicy(), f"file://{allowed}/a.png")
    assert message.endswith("no --allowed-local-media-path is set")
    with pytest.raises(ValueError, match="not a directory"):
        MediaFetcher(MediaPolicy(allowed_local_dir=str(tmp_path / "none")))


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://x/", "javascript:1",
                                 "/etc/passwd", "a.png"])
async def test_other_schemes_are_refused(url):
    assert "has a scheme that is not fetched" in await refused(MediaPolicy(), url)


# -- the domain allowlist ----------------------------------------------------------------

async def test_an_unlisted_host_is_refused_before_resolution(web):
    policy = MediaPolicy(allowed_domains=frozenset({"images.example.com"}),
                         allow_private_addresses=True)
    # (a name that cannot resolve: a look-up would fail the fetch, not refuse it)
    message = await refused(policy, "http://no-such-host.invalid/a.png")
    assert message.endswith("names host 'no-such-host.invalid', which is not in "
                            "--allowed-media-domains")
    await refused(policy, web.url("/a.png"))
    assert web.paths == []
    web.routes["/a.png"] = answer(PNG)
    listed = MediaPolicy(allowed_domains=frozenset({"LOCALHOST."}), allow_private_addresses=True)
    assert (await fetch(listed, web.url("/a.png"))).data == PNG


async def test_a_name_that_does_not_resolve_is_a_failed_fetch():
    message = await refused(MediaPolicy(), "http://no-such-host.invalid/a.png",
                            MediaFetchFailed)
    assert "names host 'no-such-host.invalid', which does not resolve" in message


# -- options -----------------------------------------------------------------------------

def clear_proxy_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    """No proxy variable of any spelling but ``values`` (``HTTP_PROXY="..."``): the
    policy of the options reads them (server.media.proxy)."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_the_options_make_the_policy(tmp_path, monkeypatch):
    clear_proxy_env(monkeypatch)
    args = build_parser().parse_args([
        "--allowed-media-domains", "Images.Example.com,cdn.example.com", "--allowed-media-domains",
        "b.example.org", "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout",
        "2.5", "--max-media-bytes", "1M", "--max-media-fetches", "3",
        "--allow-private-media-addresses"])
    assert policy_from_config(config_from_args(args)) == MediaPolicy(
        allowed_domains=frozenset({"images.example.com", "cdn.example.com", "b.example.org"}),
        allowed_local_dir=str(tmp_path), fetch_timeout=2.5, max_bytes=1024 * 1024,
        max_fetches=3, allow_private_addresses=True)
    assert policy_from_config(config_from_args(build_parser().parse_args([]))) == MediaPolicy()


def test_the_switch_needs_the_domain_list():
    with pytest.raises(ValueError, match="needs --allowed-media-domains"):
        MediaPolicy(allow_private_addresses=True)
    args = build_parser().parse_args(["--allow-private-media-addresses"])
    with pytest.raises(SystemExit, match="needs --allowed-media-domains"):
        config_from_args(args)
