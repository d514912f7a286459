"""Image URLs fetched through an HTTP proxy (server.media.proxy), on real sockets.

The proxy is written here in Trio: it forwards an absolute-form GET and tunnels a CONNECT,
recording what it was asked. The image server is test_media_fetch's, on loopback. The
origin is named ``images.test``, which a test resolver maps to 127.0.0.1 (listed, with the
private-address switch): a URL to ``localhost`` or a loopback literal never goes through
a proxy. Each test sets the proxy variables it needs and clears the others, so a
developer's own ``HTTPS_PROXY`` changes nothing here. Real time, under generous bounds.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import logging
import ssl
from urllib.parse import urlsplit

import openai
import pytest
import trio

from server.cli import build_parser, config_from_args
from server.media import (MediaFetcher, MediaFetchFailed, MediaPolicy, MediaProxyFailed,
                          MediaRefused, MediaTimeout)
from server.media.policy import policy_from_config
from server.media.proxy import Proxy, ProxyRoutes, proxy_routes_from_environment
from tests.conftest import running_server
from tests.remote import make_certificate
from tests.test_images import (IMAGE_TOKENS, IMAGES, RED, ImageServer, chat_tokens,
                               client_of, data_url, image_part)
from tests.test_media_fetch import (GENEROUS, PNG, Answers, LoopbackServer, answer,
                                    clear_proxy_env, read_head, redirect)

#: The test names (the first two: the loopback image server), listed in ``through``.
NAMES = {"images.test": [["127.0.0.1"]], "direct.test": [["127.0.0.1"]],
         "internal.test": [["10.0.0.5"]], "meta.test": [["169.254.169.254"]],
         "localhost": [["127.0.0.1"]]}
LISTED = frozenset(NAMES) - {"localhost"}


class LoopbackProxy:
    """An HTTP proxy on 127.0.0.1: forwards absolute-form requests, tunnels CONNECT.
    Records each request line and its ``Proxy-Authorization``. With ``credentials`` (a
    header value) it answers 407 to a request without them; with ``refuse`` (a status) it
    answers that to every request."""

    def __init__(self, credentials: str | None = None, refuse: int | None = None) -> None:
        self.credentials = credentials
        self.refuse = refuse
        self.asked: list[str] = []
        self.authorizations: list[str | None] = []
        self.port = 0

    async def handle(self, client: trio.SocketStream) -> None:
        head = await read_head(client)
        if head is None:
            return
        lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ")
        fields = dict(line.split(": ", 1) for line in lines[1:])
        authorization = next((v for k, v in fields.items()
                              if k.lower() == "proxy-authorization"), None)
        self.asked.append(f"{method} {target}")
        self.authorizations.append(authorization)
        if self.credentials is not None and authorization != self.credentials:
            await client.send_all(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                                  b'Proxy-Authenticate: Basic realm="t"\r\n'
                                  b"Content-Length: 0\r\n\r\n")
            return
        if self.refuse is not None:
            await client.send_all(f"HTTP/1.1 {self.refuse} No\r\nContent-Length: 0\r\n"
                                  "\r\n".encode())
            return
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            upstream = await trio.open_tcp_stream(host.strip("[]"), int(port))
            await client.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            split = urlsplit(target)
            upstream = await trio.open_tcp_stream(split.hostname, split.port or 80)
            origin_form = split.path + (f"?{split.query}" if split.query else "")
            kept = [line for line in lines[1:] if not line.lower().startswith("proxy-")]
            await upstream.send_all("\r\n".join(
                [f"{method} {origin_form} HTTP/1.1", *kept, "", ""]).encode("latin-1"))
        async with upstream:
            await splice(client, upstream)


async def splice(one: trio.abc.Stream, other: trio.abc.Stream) -> None:
    """Bytes both ways until either side ends."""
    async def pump(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
        try:
            while data := await source.receive_some(65536):
                await sink.send_all(data)
        except trio.BrokenResourceError:
            pass
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, one, other)
        nursery.start_soon(pump, other, one)


async def serve(nursery: trio.Nursery, handler) -> int:
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0,
                                                      host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


@pytest.fixture
async def web(nursery):
    trio.socket.set_custom_hostname_resolver(Answers(NAMES))
    server = LoopbackServer()
    server.port = await serve(nursery, server.handle)
    server.routes["/a.png"] = answer(PNG)
    return server


async def start_proxy(nursery: trio.Nursery, **options) -> LoopbackProxy:
    proxy = LoopbackProxy(**options)
    proxy.port = await serve(nursery, proxy.handle)
    return proxy


def through(proxy: LoopbackProxy | int, authorization: str | None = None,
            no_proxy: str | None = None) -> MediaPolicy:
    """The test names listed and let reach loopback, every fetch through ``proxy``."""
    port = proxy if isinstance(proxy, int) else proxy.port
    return MediaPolicy(allowed_domains=LISTED, allow_private_addresses=True,
                       proxies=ProxyRoutes(Proxy("127.0.0.1", port, "HTTP_PROXY", authorization),
                                           Proxy("127.0.0.1", port, "HTTPS_PROXY", authorization),
                                           no_proxy))


async def fetch(policy: MediaPolicy, url: str, ssl_context: ssl.SSLContext | None = None):
    with trio.fail_after(GENEROUS):
        return await MediaFetcher(policy, ssl_context=ssl_context).fetch_image(url)


# -- http and https through the proxy ----------------------------------------------------

async def test_an_http_url_goes_to_the_proxy_in_absolute_form(web, nursery):
    proxy = await start_proxy(nursery)
    assert (await fetch(through(proxy), f"http://images.test:{web.port}/a.png")).data == PNG
    assert proxy.asked == [f"GET http://images.test:{web.port}/a.png"]
    assert proxy.authorizations == [None] and web.paths == ["/a.png"]


def tls_context(tmp_path) -> tuple[ssl.SSLContext, ssl.SSLContext, list[str | None]]:
    """A server context whose certificate is for images.test and 127.0.0.1, a client
    context that trusts it, and the server names (SNI) the server is asked for."""
    cert_path, key_path = make_certificate(tmp_path, "images.test", "127.0.0.1")
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert_path, key_path)
    names: list[str | None] = []
    server_context.sni_callback = lambda sock, name, context: names.append(name)
    return server_context, ssl.create_default_context(cadata=cert_path.read_text()), names


def over_tls(handler, context: ssl.SSLContext):
    """``handler`` behind TLS (a client that refuses the certificate ends it)."""
    async def handle(stream: trio.SocketStream) -> None:
        wrapped = trio.SSLStream(stream, context, server_side=True)
        try:
            await handler(wrapped)
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(wrapped)
    return handle


async def test_an_https_url_goes_through_a_tunnel_with_tls_to_the_origin(web, nursery,
                                                                         tmp_path):
    server_context, trusting, names = tls_context(tmp_path)
    port = await serve(nursery, over_tls(web.handle, server_context))
    proxy = await start_proxy(nursery)
    image = await fetch(through(proxy), f"https://images.test:{port}/a.png", trusting)
    assert image.data == PNG and names == ["images.test"]
    assert proxy.asked == [f"CONNECT images.test:{port}"] and web.paths == ["/a.png"]
    # (the certificate is checked as when direct: one no CA vouches for is refused)
    with pytest.raises(MediaFetchFailed, match="TLS with images.test:.* failed"):
        await fetch(through(proxy), f"https://images.test:{port}/a.png")


async def test_an_https_proxy_is_reached_over_tls(web, nursery, tmp_path, monkeypatch):
    server_context, trusting, names = tls_context(tmp_path)
    origin = await serve(nursery, over_tls(web.handle, server_context))
    proxy = LoopbackProxy()
    proxy.port = await serve(nursery, over_tls(proxy.handle, server_context))
    clear_proxy_env(monkeypatch, HTTP_PROXY=f"https://127.0.0.1:{proxy.port}",
                    HTTPS_PROXY=f"https://127.0.0.1:{proxy.port}")
    policy = MediaPolicy(allowed_domains=LISTED, allow_private_addresses=True,
                         proxies=proxy_routes_from_environment())
    assert (await fetch(policy, f"http://images.test:{web.port}/a.png", trusting)).data == PNG
    # (an https URL: its TLS inside the tunnel, inside the TLS to the proxy)
    assert (await fetch(policy, f"https://images.test:{origin}/a.png", trusting)).data == PNG
    assert proxy.asked == [f"GET http://images.test:{web.port}/a.png",
                           f"CONNECT images.test:{origin}"]
    # (the two TLS sessions with the proxy name no server, as an IP address has no SNI;
    # the one inside the tunnel names the origin)
    assert names == [None, None, "images.test"]
    with pytest.raises(MediaProxyFailed) as info:  # (no CA vouches)
        await fetch(policy, f"http://images.test:{web.port}/a.png")
    assert info.value.why.startswith(f"TLS with the proxy https://127.0.0.1:{proxy.port} "
                                     "(HTTP_PROXY) failed")
    assert len(proxy.asked) == 2


async def test_each_redirect_goes_through_the_proxy_and_is_checked(web, nursery):
    proxy = await start_proxy(nursery)
    web.routes["/hop"] = redirect(f"http://direct.test:{web.port}/a.png")
    assert (await fetch(through(proxy), f"http://images.test:{web.port}/hop")).data == PNG
    assert proxy.asked == [f"GET http://images.test:{web.port}/hop",
                           f"GET http://direct.test:{web.port}/a.png"]
    web.routes["/meta"] = redirect("http://meta.test/latest/meta-data/")
    message = (await refusal(through(proxy), f"http://images.test:{web.port}/meta")).message
    # (the hop's name resolves here first: a metadata address is refused, listed or not)
    assert message.endswith("resolves to a cloud metadata address 169.254.169.254")
    assert proxy.asked[2:] == [f"GET http://images.test:{web.port}/meta"]  # (not the hop)


# -- the address rule --------------------------------------------------------------------

async def test_the_address_rule_holds_through_the_proxy(web, nursery):
    """The origin's name is resolved here and every address checked before the proxy is
    asked: a proxy cannot be used to reach by name what a direct fetch may not."""
    proxy = await start_proxy(nursery)
    open_to_all = MediaPolicy(proxies=through(proxy).proxies)
    message = (await refusal(open_to_all, "http://internal.test/admin.png")).message
    assert message.endswith("resolves to a private address 10.0.0.5")
    message = (await refusal(open_to_all, f"http://images.test:{web.port}/a.png")).message
    assert message.endswith("resolves to a loopback address 127.0.0.1")
    # (listed, with the switch: loopback and private pass, metadata never does)
    message = (await refusal(through(proxy), "http://meta.test/latest/meta-data/")).message
    assert message.endswith("resolves to a cloud metadata address 169.254.169.254")
    assert proxy.asked == [] and web.paths == []


async def refusal(policy: MediaPolicy, url: str) -> MediaRefused:
    with pytest.raises(MediaRefused) as info:
        await fetch(policy, url)
    return info.value


async def test_localhost_and_loopback_go_direct(web, nursery):
    proxy = await start_proxy(nursery)
    policy = MediaPolicy(allowed_domains=frozenset({"localhost", "127.0.0.1"}),
                         allow_private_addresses=True, proxies=through(proxy).proxies)
    for host in ("localhost", "127.0.0.1"):
        assert (await fetch(policy, f"http://{host}:{web.port}/a.png")).data == PNG
    assert proxy.asked == [] and web.paths == ["/a.png", "/a.png"]


# -- the environment ---------------------------------------------------------------------

async def test_no_proxy_hosts_go_direct(web, nursery, monkeypatch):
    proxy = await start_proxy(nursery)
    clear_proxy_env(monkeypatch, HTTP_PROXY=f"127.0.0.1:{proxy.port}",
                    NO_PROXY="elsewhere.example, .direct.test")
    policy = MediaPolicy(allowed_domains=LISTED, allow_private_addresses=True,
                         proxies=proxy_routes_from_environment())
    for host in ("direct.test", "images.test"):
        assert (await fetch(policy, f"http://{host}:{web.port}/a.png")).data == PNG
    assert proxy.asked == [f"GET http://images.test:{web.port}/a.png"]
    assert web.paths == ["/a.png", "/a.png"]
    clear_proxy_env(monkeypatch, http_proxy=f"http://127.0.0.1:{proxy.port}", no_proxy="*")
    policy = MediaPolicy(allowed_domains=LISTED, allow_private_addresses=True,
                         proxies=proxy_routes_from_environment())
    assert (await fetch(policy, f"http://images.test:{web.port}/a.png")).data == PNG
    assert len(proxy.asked) == 1


def test_the_variables_as_urllib_reads_them(monkeypatch):
    clear_proxy_env(monkeypatch, HTTPS_PROXY="http://u%40x:p%3Ass@Proxy.Internal:3128/",
                    https_proxy="http://proxy.internal:3129", HTTP_PROXY="cache:8080")
    routes = proxy_routes_from_environment()
    assert routes == ProxyRoutes(http=Proxy("cache", 8080, "HTTP_PROXY"),
                                 https=Proxy("proxy.internal", 3129, "https_proxy"))
    clear_proxy_env(monkeypatch, HTTPS_PROXY="http://u%40x:p%3Ass@Proxy.Internal")
    https = proxy_routes_from_environment().https
    assert https == Proxy("proxy.internal", 80, "HTTPS_PROXY",
                          "Basic " + base64.b64encode(b"u@x:p:ss").decode())
    # (never the credentials in a message or the log: only that there are some)
    assert str(https) == "http://proxy.internal:80 (HTTPS_PROXY)"
    assert "Basic" not in repr(ProxyRoutes(https=https))
    assert Proxy.parse(" http://gw:3128\n", "HTTP_PROXY") == Proxy("gw", 3128, "HTTP_PROXY")
    assert ProxyRoutes(https=https, no_proxy=".internal").describe() == (
        "image URLs: http direct; https through http://proxy.internal:80 (HTTPS_PROXY) with "
        "credentials; direct to NO_PROXY=.internal; direct to localhost and loopback")
    clear_proxy_env(monkeypatch, HTTPS_PROXY="https://proxy.internal")
    assert proxy_routes_from_environment() == ProxyRoutes(
        https=Proxy("proxy.internal", 443, "HTTPS_PROXY", tls=True))
    clear_proxy_env(monkeypatch, NO_PROXY="*")
    assert proxy_routes_from_environment() is None


@pytest.mark.parametrize("variable, value, why", [
    ("HTTPS_PROXY", "ftp://proxy.internal:21", "HTTPS_PROXY names a ftp:// proxy"),
    ("http_proxy", "socks5://u:secret@proxy.internal:1080", "http_proxy names a socks5:// proxy"),
    ("HTTP_PROXY", "http://proxy.internal:3128/path", "HTTP_PROXY is not a proxy URL"),
    ("HTTP_PROXY", "http://proxy.internal:99999", "HTTP_PROXY is not a valid proxy URL"),
    # (a password not percent-encoded, or a port cut from it: never echoed)
    ("HTTPS_PROXY", "http://u:se/cret@gw:3128", r"an '@' after its host \(http://gw:3128\)"),
    ("HTTPS_PROXY", "http://u:4711/secret@gw:3128", "must be percent-encoded"),
    ("HTTPS_PROXY", "http://u:4711#secret@gw:3128", "must be percent-encoded"),
    ("HTTPS_PROXY", "http://u:se?cret@gw:3128", "must be percent-encoded"),
    ("HTTPS_PROXY", "http://u:secret@gw:31x8", r"not a valid proxy URL \(http://gw:31x8\)"),
])
def test_a_proxy_that_cannot_be_used_is_refused_at_start(monkeypatch, variable, value, why):
    clear_proxy_env(monkeypatch, **{variable: value})
    args = build_parser().parse_args([])
    with pytest.raises(SystemExit, match=why) as info:
        config_from_args(args)
    assert "secret" not in str(info.value) and "4711" not in str(info.value)


# -- a proxy that refuses or is not there ------------------------------------------------

@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_proxy_that_wants_credentials(web, nursery, scheme):
    wanted = "Basic " + base64.b64encode(b"user:pass").decode()
    proxy = await start_proxy(nursery, credentials=wanted)
    url = f"{scheme}://images.test:{web.port}/a.png"
    with pytest.raises(MediaProxyFailed) as info:
        await fetch(through(proxy), url)
    method = "CONNECT" if scheme == "https" else "GET"
    # (the operator's fault: a 502 that names neither the proxy nor why; the log does)
    assert info.value.status == 502 and info.value.code == "media_proxy_failed"
    assert str(proxy.port) not in info.value.message
    assert (f"the proxy http://127.0.0.1:{proxy.port} ({scheme.upper()}_PROXY) refused "
            f"{method}") in info.value.why
    assert "HTTP 407 Proxy Authentication Required (it wants credentials" in info.value.why
    with pytest.raises(MediaProxyFailed) as info:
        await fetch(through(proxy, "Basic " + base64.b64encode(b"user:no").decode()), url)
    assert "it refused the credentials in" in info.value.why
    if scheme == "http":
        assert (await fetch(through(proxy, wanted), url)).data == PNG
        assert proxy.authorizations[-1] == wanted
    assert web.paths == ([] if scheme == "https" else ["/a.png"])


async def test_a_proxy_that_refuses_the_tunnel_or_is_not_there(web, nursery):
    proxy = await start_proxy(nursery, refuse=502)
    with pytest.raises(MediaFetchFailed) as info:
        await fetch(through(proxy), "https://images.test/a.png")
    # (the proxy cannot or will not reach the client's URL: the client's 400, which does
    # not name the proxy)
    assert info.value.status == 400 and info.value.message.endswith(
        "this server's proxy refused CONNECT images.test:443: HTTP 502 No")
    assert str(proxy.port) not in info.value.message
    with pytest.raises(MediaFetchFailed,
                       match=r"was answered HTTP 502 \(through this server's proxy\)"):
        await fetch(through(proxy), "http://images.test/a.png")
    with trio.socket.socket() as closed:  # (a port nothing listens on)
        await closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(MediaProxyFailed) as failed:  # (the proxy is not there: a 502)
        await fetch(through(port), "http://images.test/a.png")
    assert failed.value.status == 502 and str(port) not in failed.value.message
    assert f"no connection to the proxy http://127.0.0.1:{port} (HTTP_PROXY)" in \
        failed.value.why


@pytest.mark.parametrize("answer, why", [
    # (a tunnel's first bytes are the origin's, and it speaks only after the TLS hello)
    (b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.1 200 OK\r\n",
     "sent bytes before the tunnel was used"),
    (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 1_000_000, "answered CONNECT with malformed HTTP"),
    (None, "was not fetched within 0.5 s"),
])
async def test_a_proxy_that_answers_the_tunnel_wrongly(web, nursery, answer, why):
    """What the proxy says before the tunnel is refused; a head past the bound is not read
    whole; a proxy that never answers is bounded by the fetch's time limit. Each time the
    fetch closes its connection to the proxy (cancelled, in the last case)."""
    hung_up = trio.Event()

    async def handle(client: trio.SocketStream) -> None:
        await read_head(client)
        try:  # (the fetch may hang up partway through a long head)
            if answer is not None:
                await client.send_all(answer)
            while await client.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        hung_up.set()

    port = await serve(nursery, handle)
    policy = through(port) if answer else dataclasses.replace(through(port), fetch_timeout=0.5)
    with pytest.raises((MediaProxyFailed, MediaTimeout)) as info:
        await fetch(policy, f"https://images.test:{web.port}/a.png")
    # (a proxy that breaks HTTP is the operator's 502; a slow fetch the client's 400)
    failed = info.value
    assert why in (failed.why if isinstance(failed, MediaProxyFailed) else failed.message)
    assert failed.status == (502 if answer else 400) and web.paths == []
    with trio.fail_after(GENEROUS):  # (while the error, its traceback, is still held)
        await hung_up.wait()


# -- end to end --------------------------------------------------------------------------

async def test_a_chat_image_is_fetched_through_the_servers_proxy(monkeypatch, caplog):
    """The server reads HTTP_PROXY at start (from its own environment, as vLLM does),
    logs it without the password, and fetches a chat's image URL through it."""
    trio.socket.set_custom_hostname_resolver(Answers({"images.test": [["127.0.0.1"]]}))
    image_server = ImageServer(RED)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(image_server.run)
            wanted = "Basic " + base64.b64encode(b"frontend:s3cret").decode()
            proxy = await start_proxy(nursery, credentials=wanted)
            # (NO_PROXY: the test's own HTTP clients, which read the variables too, go
            # direct to the server)
            clear_proxy_env(monkeypatch,
                            HTTP_PROXY=f"http://frontend:s3cret@127.0.0.1:{proxy.port}",
                            NO_PROXY="127.0.0.1,localhost")
            url = f"http://images.test:{image_server.port}/a.png"
            with caplog.at_level(logging.INFO, logger="server.media"):
                async with running_server(IMAGES, allowed_media_domains=("images.test",),
                                          allow_private_media_addresses=True) as server:
                    client = client_of(server)
                    text = {"type": "text", "text": "describe"}
                    fetched = await chat_tokens(client, [text, image_part(url)])
                    sent = await chat_tokens(client, [text, image_part(data_url(RED))])
                    plain, _ = await chat_tokens(client, [text])
            assert fetched == sent and fetched[0] == plain + IMAGE_TOKENS
            assert proxy.asked == [f"GET {url}"] and image_server.requests == 1
            logged = [r.getMessage() for r in caplog.records if r.name == "server.media"]
            assert logged == [f"image URLs: http through http://127.0.0.1:{proxy.port} "
                              "(HTTP_PROXY) with credentials; https direct; direct to "
                              "NO_PROXY=127.0.0.1,localhost; direct to localhost and loopback"]
            nursery.cancel_scope.cancel()


async def test_a_failing_proxy_is_the_servers_502_and_logged(monkeypatch, caplog):
    """A proxy that wants credentials the server lacks fails every fetch: the operator's
    fault, so a 502 (which 5xx alerting sees), naming the client's part but not the proxy;
    the server's log says which proxy and why. Two images: the concurrent path."""
    trio.socket.set_custom_hostname_resolver(Answers({"images.test": [["127.0.0.1"]]}))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            proxy = await start_proxy(
                nursery, credentials="Basic " + base64.b64encode(b"u:p").decode())
            clear_proxy_env(monkeypatch, HTTP_PROXY=f"http://127.0.0.1:{proxy.port}",
                            NO_PROXY="127.0.0.1,localhost")
            urls = [f"http://images.test:1/{name}.png" for name in ("a", "b")]
            with caplog.at_level(logging.WARNING, logger="server.media"):
                async with running_server(IMAGES, allowed_media_domains=("images.test",),
                                          allow_private_media_addresses=True) as server:
                    client = client_of(server)
                    text = {"type": "text", "text": "describe"}
                    with pytest.raises(openai.APIStatusError) as info:
                        await chat_tokens(client, [text, *map(image_part, urls)])
                    plain, _ = await chat_tokens(client, [text])  # (serving on)
            error = info.value.body
            assert info.value.status_code == 502 and error["code"] == "media_proxy_failed"
            assert error["param"].startswith("messages[0].content[")
            assert str(proxy.port) not in error["message"]
            logged = [r.getMessage() for r in caplog.records if r.name == "server.media"]
            assert len(logged) == 1 and f"the proxy http://127.0.0.1:{proxy.port} " \
                "(HTTP_PROXY) refused GET: HTTP 407" in logged[0]
            assert plain > 0
            nursery.cancel_scope.cancel()


async def test_the_proxys_failures_are_logged_at_most_once_a_period(monkeypatch, caplog):
    trio.socket.set_custom_hostname_resolver(Answers(NAMES))
    with trio.socket.socket() as closed:  # (a port nothing listens on)
        await closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    fetcher = MediaFetcher(through(port))
    with caplog.at_level(logging.WARNING, logger="server.media"):
        for _ in range(3):
            with pytest.raises(MediaProxyFailed), trio.fail_after(GENEROUS):
                await fetcher.fetch_image("http://images.test/a.png")
        monkeypatch.setattr("server.media.fetch.PROXY_WARNING_PERIOD", 0.0)
        with pytest.raises(MediaProxyFailed), trio.fail_after(GENEROUS):
            await fetcher.fetch_image("http://images.test/a.png")
    logged = [r.getMessage() for r in caplog.records if r.name == "server.media"]
    assert len(logged) == 2 and f"no connection to the proxy http://127.0.0.1:{port}" in \
        logged[0]
    assert "(1 fetch(es) failed by the proxy" in logged[0]
    assert "(3 fetch(es) failed by the proxy" in logged[1]


def test_the_policy_of_a_clean_environment_has_no_proxy(monkeypatch):
    clear_proxy_env(monkeypatch)
    assert policy_from_config(config_from_args(build_parser().parse_args([]))).proxies is None
