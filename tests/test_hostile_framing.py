"""Issue 18, items 3, 4 and 10: what a request must look like before anything runs.

* Item 3, cross-site requests: a generation body must be declared JSON. ``text/plain``,
  forms and multipart are what a web page can POST without a CORS preflight: 415, and the
  engine never sees them.
* Item 4, request smuggling shapes (RFC 9112): ``Content-Length`` with
  ``Transfer-Encoding`` and obs-folded header lines are refused with 400 and the
  connection closed; bytes after such a request never run as a second request.
* Item 10: request lines claiming HTTP/2.0 or HTTP/3.0 are a 505; a WebSocket upgrade is
  served as the plain HTTP/1.1 request it also is (OpenAI-style body, request id); numbers
  of thousands of digits and lone surrogates in fields nobody reads are a 400 with our own
  words; no ``server`` header.
"""

from __future__ import annotations

import gc
import json
import re

import pytest
import trio

from server.connections import private_api
from tests.conftest import running_server
from tests.test_hostile import addr, raw_exchange, split_response

#: Request-head refusals: the direct path's (server.connections.framing, protocol).
pytestmark = pytest.mark.direct_http

BODY = b'{"prompt": "x", "max_tokens": 2}'


def post(content_type: bytes | None, body: bytes = BODY, path: bytes = b"/v1/completions") -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % path
    if content_type is not None:
        head += b"Content-Type: %s\r\n" % content_type
    return head + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)


def statuses(raw: bytes) -> list[int]:
    """The status of every response in ``raw`` (to count what ran)."""
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]


def error_of(raw: bytes) -> tuple[int, dict, dict]:
    status, headers, body = split_response(raw)
    return status, headers, json.loads(body)["error"]


# -- item 3: content types ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, b"text/plain", b"application/x-www-form-urlencoded",
     b"multipart/form-data; boundary=x", b"text/json", b"application/jsonx", b""],
)
async def test_a_generation_body_not_declared_json_is_a_415(content_type):
    async with running_server() as url:
        for path in (b"/v1/completions", b"/v1/chat/completions"):
            raw = await raw_exchange(url, post(content_type, path=path))
            status, headers, error = error_of(raw)
            assert status == 415, raw[:300]
            assert error["code"] == "unsupported_media_type" and error["param"] == "content-type"
            assert headers["x-request-id"]
        stats = url.engine.statistics()
        assert stats.open_streams == 0 and not url.app.metrics.finished["length"]


@pytest.mark.parametrize(
    "content_type",
    [b"application/json", b"Application/JSON", b"application/json; charset=utf-8",
     b"application/vnd.api+json"],
)
async def test_json_content_types_are_served(content_type):
    async with running_server() as url:
        raw = await raw_exchange(url, post(content_type))
        assert split_response(raw)[0] == 200, raw[:300]


# -- item 4: smuggling shapes ------------------------------------------------------------------


async def test_content_length_with_transfer_encoding_is_refused_and_nothing_follows():
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    for order in (
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    ):
        async with running_server() as url:
            raw = await raw_exchange(
                url,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + order + b"\r\n0\r\n\r\n" + smuggled,
            )
            status, headers, error = error_of(raw)
            assert status == 400 and error["code"] == "ambiguous_framing", raw[:300]
            assert headers["connection"] == "close"
            assert statuses(raw) == [400]  # the smuggled request never ran


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n\tb\r\n\r\n",
        b"GET /health HTTP/1.1\nHost: x\nX-A: a\n b\n\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length:\r\n 32\r\n\r\n" + BODY,
    ],
)
async def test_obs_folded_header_lines_are_refused(head):
    # Also the proof that the hook into h11's request reader applies (the direct path).
    assert private_api.direct_path_problem() is None
    async with running_server() as url:
        raw = await raw_exchange(url, head)
        status, headers, error = error_of(raw)
        assert status == 400 and error["code"] == "obs_fold", raw[:300]
        assert headers["connection"] == "close" and statuses(raw) == [400]


async def test_a_refused_head_after_a_served_request_on_one_connection():
    # The strict reader applies to every request of a kept-alive connection.
    async with running_server() as url:
        raw = await raw_exchange(
            url,
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n"
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        assert statuses(raw) == [200, 400], raw[:600]


# -- item 10 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [b"2.0", b"3.0", b"1.2", b"9.9"])
async def test_request_lines_of_other_http_versions_are_a_505(version):
    async with running_server() as url:
        raw = await raw_exchange(url, b"GET /health HTTP/%b\r\nHost: x\r\n\r\n" % version)
        status, headers, error = error_of(raw)
        assert status == 505 and error["code"] == "http_version_not_supported", raw[:300]
        assert raw.startswith(b"HTTP/1.1 505 ")


async def test_a_websocket_upgrade_is_served_as_http_1_1():
    upgrade = (
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    async with running_server() as url:
        raw = await raw_exchange(url, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n" + upgrade)
        status, headers, error = error_of(raw)
        assert status == 405 and headers["x-request-id"] and error["code"] == "method_not_allowed"
        raw = await raw_exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\n" + upgrade)
        assert raw.startswith(b"HTTP/1.1 200"), raw[:300]


async def test_absurd_numbers_and_hidden_lone_surrogates_are_a_400_in_our_words():
    bodies = {
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}": None,
        b'{"prompt": "x", "unknown": ' + b"1" * 5000 + b"}": None,
        b'{"prompt": "x", "user": "\\ud800"}': "user",
        b'{"prompt": "x", "metadata": {"k": ["\\udfff"]}}': "metadata.k[0]",
        b'{"prompt": "x", "\\ud800": 1}': None,
    }
    async with running_server() as url:
        for body, param in bodies.items():
            raw = await raw_exchange(url, post(b"application/json", body))
            status, _, error = error_of(raw)
            assert status == 400, (body[:60], raw[:300])
            assert "set_int_max_str_digits" not in error["message"]
            assert error["param"] == param, error
            assert len(raw) < 1000
        # A surrogate pair is one character, not a lone surrogate.
        pair = b'{"prompt": "x", "max_tokens": 2, "user": "\\ud83d\\ude00"}'
        raw = await raw_exchange(url, post(b"application/json", pair))
        assert split_response(raw)[0] == 200


async def test_no_server_header_names_the_implementation():
    async with running_server() as url:
        for data in (
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            post(b"application/json"),
            b"GARBAGE\r\n\r\n",
        ):
            raw = await raw_exchange(url, data)
            assert "server" not in split_response(raw)[1], raw[:300]


async def test_refused_heads_leave_nothing_behind():
    # A refusal raised again and again as one shared exception object kept every
    # traceback it had, and with them every refused connection (its buffers, protocol,
    # task group): memory any client could fill with folded headers.
    from server.connections.private_api import StrictH11Connection

    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\nX-Pad: %b\r\n\r\n" % (b"p" * 8000)
    async with running_server() as url:
        for _ in range(30):
            raw = await raw_exchange(url, head)
            assert split_response(raw)[0] == 400
        with trio.fail_after(30):
            while url.app.connections.statistics().open:
                await trio.sleep(0.02)
        gc.collect()
        alive = [o for o in gc.get_objects() if type(o) is StrictH11Connection]
        assert len(alive) <= 1, len(alive)


async def test_expect_100_continue_over_the_body_limit_is_a_413_at_once():
    # Issue 42, item 8: hypercorn sent "100 Continue" as soon as the head was in, and the
    # client then sent the body the server was about to refuse.
    body = b'{"prompt": "x", "max_tokens": 2}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n")
    async with running_server(max_body_bytes=1 << 16) as url:
        raw = await raw_exchange(url, head % (1 << 20))  # no body: the client waits
        assert raw.startswith(b"HTTP/1.1 413 "), raw[:200]
        assert split_response(raw)[1]["connection"] == "close"
        assert error_of(raw)[2]["code"] == "payload_too_large"
        # Within the limit: 100 Continue, then the answer once the body is sent.
        stream = await trio.open_tcp_stream(*addr(url))
        async with stream:
            await stream.send_all(head % len(body))
            out = b""
            with trio.fail_after(120):
                while b"\r\n\r\n" not in out:
                    out += await stream.receive_some(65536)
                assert out.startswith(b"HTTP/1.1 100 "), out
                out = out.partition(b"\r\n\r\n")[2]
                await stream.send_all(body)
                while chunk := await stream.receive_some(65536):
                    out += chunk
        assert split_response(out)[0] == 200
