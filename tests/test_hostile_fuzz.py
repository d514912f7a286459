"""Issue 18: the property-based fuzzer, extended to HTTP/2 frames and to the framing of
HTTP/1.1 request heads (the body fuzzer is in tests/test_hostile.py).

What must hold for every generated connection: no connection error reaches the boundary
(``errors == 0``: nothing raised in the HTTP layer), every answer is a well-formed response
with an OpenAI-style body and never a 500, nothing follows a refused head on its
connection, the server keeps serving, and nothing is left in the manager or any worker.
"""

from __future__ import annotations

import json
import os
import re
import socket

import hpack
import pytest
import httpx
import trio
from hyperframe import frame as hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.config import EngineConfig, Limits
from tests.conftest import FAST_SIM, assert_engine_idle, running_server
from tests.test_hostile import addr

EXAMPLES = int(os.environ.get("TRIO_LLM_FUZZ_EXAMPLES", "120"))
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# -- HTTP/2 frames -----------------------------------------------------------------------------

_stream_ids = st.sampled_from([1, 3, 5, 2**31 - 1])
_any_stream_ids = st.sampled_from([0, 1, 3, 2**31 - 1])
_headers = st.lists(
    st.tuples(
        st.sampled_from([":method", ":path", ":scheme", ":authority", "content-length",
                         "content-type", "te", "connection", "x-a"]),
        st.sampled_from(["POST", "GET", "/v1/completions", "/nope", "http", "x", "2000", "0",
                         "-1", "application/json", "trailers", "close", ""]),
    ),
    max_size=8,
)


def _headers_frame(stream_id, headers, end_stream, end_headers):
    f = hf.HeadersFrame(stream_id)
    f.data = hpack.Encoder().encode(headers)
    f.flags = {flag for flag, on in (("END_STREAM", end_stream), ("END_HEADERS", end_headers)) if on}
    return f.serialize()


def _data_frame(stream_id, data, end_stream):
    f = hf.DataFrame(stream_id)
    f.data = data
    if end_stream:
        f.flags.add("END_STREAM")
    return f.serialize()


def _window_update(stream_id, increment):
    f = hf.WindowUpdateFrame(stream_id)
    f.window_increment = increment
    return f.serialize()


def _settings(window):
    f = hf.SettingsFrame(0)
    f.settings = {hf.SettingsFrame.INITIAL_WINDOW_SIZE: window}
    return f.serialize()


def _rst(stream_id):
    f = hf.RstStreamFrame(stream_id)
    f.error_code = 8
    return f.serialize()


h2_frames = st.one_of(
    st.builds(_headers_frame, _stream_ids, _headers, st.booleans(), st.booleans()),
    st.builds(_data_frame, _stream_ids, st.binary(max_size=3000), st.booleans()),
    st.builds(_window_update, _any_stream_ids, st.integers(0, 2**31 - 1)),
    st.builds(_settings, st.integers(0, 2**31 - 1)),
    st.builds(_rst, _stream_ids),
    st.binary(min_size=1, max_size=64),  # not a frame at all
)
h2_connections = st.tuples(
    st.sampled_from([PREFACE, PREFACE[:16], b""]),
    st.lists(h2_frames, min_size=1, max_size=8),
    st.booleans(),  # pause between frames (a body still arriving after an answer)
)

# -- HTTP/1.1 heads ----------------------------------------------------------------------------

_te = st.sampled_from(["chunked", "Chunked", " chunked", "chunked, identity", "gzip, chunked",
                       "identity", "chunked\t"])
_cl = st.sampled_from(["5", "+5", "05", "5, 5", "-1", " 5 ", "1e1", "18446744073709551621", "0"])
_header_line = st.one_of(
    _te.map(lambda v: f"Transfer-Encoding: {v}"),
    _cl.map(lambda v: f"Content-Length: {v}"),
    st.just("Content-Type: application/json"),
    st.just("Content-Type: text/plain"),
    st.just("Connection: keep-alive"),
    st.just("Expect: 100-continue"),
    st.just("Upgrade: h2c"),
    st.just("Upgrade: websocket"),
    st.just("X-A: a\r\n b"),  # obs-fold
    st.just("X-A : b"),  # whitespace before the colon
    st.just("Host: y"),  # a second Host
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),
)
_heads = st.builds(
    lambda method, target, version, lines, eol, body, follow: (
        (f"{method} {target} HTTP/{version}{eol}Host: x{eol}"
         + "".join(line + eol for line in lines) + eol).encode() + body + follow
    ),
    st.sampled_from(["POST", "GET", "PUT", "PRI", "post"]),
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/health", "*",
                     "http://x/v1/models", "//v1/models"]),
    st.sampled_from(["1.1", "1.0", "2.0", "3.0", "1.9"]),
    st.lists(_header_line, max_size=5),
    st.sampled_from(["\r\n", "\n"]),
    st.sampled_from([b"", b'{"prompt": "x", "max_tokens": 2}', b"0\r\n\r\n",
                     b"5\r\nhello\r\n0\r\n\r\n", b"\x00" * 10]),
    st.sampled_from([b"", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"]),
)

_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})")


def exchange(url: str, chunks: list[bytes], pause: float = 0.0) -> bytes:
    """Send ``chunks`` on a fresh connection (``pause`` s apart), then read until the server
    closes or goes quiet for 0.3 s."""
    sock = socket.create_connection(addr(url))
    sock.settimeout(0.3)
    out = b""
    try:
        for chunk in chunks:
            sock.sendall(chunk)
            if pause:
                trio.from_thread.run(trio.sleep, pause)
        while True:
            data = sock.recv(65536)
            if not data:
                break
            out += data
    except (TimeoutError, ConnectionError, OSError):
        pass
    finally:
        sock.close()
    return out


#: The codes of heads refused by the protocol layer (server/connections/http11.py): after one,
#: the connection is closed and nothing else on it may run.
REFUSED = {"ambiguous_framing", "obs_fold", "invalid_http", "http_version_not_supported",
           "request_header_fields_too_large", "not_implemented"}


def check_responses(raw: bytes) -> list[int]:
    statuses = [int(s) for s in _STATUS.findall(raw)]
    assert 500 not in statuses, raw[:500]
    assert b"Traceback" not in raw
    if statuses and statuses[0] >= 400:
        head, _, body = raw.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head)
        if length is not None and len(body) >= int(length.group(1)):
            error = json.loads(body[: int(length.group(1))])["error"]
            assert error["message"]
            if error["code"] in REFUSED:
                assert b"connection: close" in head.lower()
                assert len(statuses) == 1, raw[:600]
    return statuses


async def fuzz_server(strategy, one_example) -> None:
    config = EngineConfig(engine_options={**FAST_SIM, "itl_ms": 0.5}, drain_timeout=0.5)
    async with running_server(config, limits=Limits(max_tokens=64)) as url:
        engine, pool = url.engine, url.app.connections

        def fuzz():
            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(strategy)
            def one(case):
                one_example(url, case)
                assert pool.statistics().errors == 0
                trio.from_thread.run(assert_engine_idle, engine, 2.0)

            one()

        await trio.to_thread.run_sync(fuzz)
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/completions", json={"prompt": "after", "max_tokens": 3})
            assert r.status_code == 200
        assert pool.statistics().errors == 0


@pytest.mark.direct_http  # (the refusals and pool statistics of the direct path)
async def test_fuzzed_http2_frames_end_no_more_than_their_connection():
    def one(url, case):
        preface, frames, pause = case
        raw = exchange(url, [preface, *frames], pause=0.02 if pause else 0.0)
        statuses = check_responses(raw)
        if preface == PREFACE:  # answered 505 (or reset while the frames were unread)
            assert statuses in ([505], []), raw[:300]

    await fuzz_server(h2_connections, one)


@pytest.mark.direct_http  # (the refusals and pool statistics of the direct path)
async def test_fuzzed_request_heads_are_answered_or_refused_never_smuggled():
    def one(url, head):
        check_responses(exchange(url, [head]))

    await fuzz_server(_heads, one)
