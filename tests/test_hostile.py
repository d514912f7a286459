"""Hostile and broken clients through hypercorn: malformed input, a property-based fuzzer,
clients that never read or read slowly, idle sockets, and storms of disconnects.

What must hold (issue 5): a 4xx with an OpenAI-style body for anything malformed (never a
5xx, never a traceback), the server keeps serving, and afterwards nothing is left in the
manager or in any worker (``running_server`` checks that when each test's server stops).
Protocol-level garbage that h11 rejects before the app sees it is answered by the server's
protocol layer (server/connections/http11.py), with the same OpenAI-style body.
"""

from __future__ import annotations

import json
import os
import random
import socket
import string
from urllib.parse import urlsplit

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.config import EngineConfig, Limits
from server.engines.sim.engine import FAULT_KINDS
from tests.conftest import FAST_SIM, JSON, assert_engine_idle, running_server

# -- helpers ---------------------------------------------------------------------------------


def check_error(r: httpx.Response, status: int | None = None) -> dict:
    """A 4xx (``status`` if given) with an OpenAI-style error body."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code == status, r.text[:500]
    assert "Traceback" not in r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def addr(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def _first_response_complete(raw: bytes, head_only: bool) -> bool:
    """Whether ``raw`` holds a whole first response whose end its framing tells (a
    close-delimited one ends at EOF)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    status, headers, _ = split_response(head + sep)
    if head_only or status in (204, 304):
        return True
    if "content-length" in headers:
        return len(body) >= int(headers["content-length"])
    if "chunked" in headers.get("transfer-encoding", ""):
        return body.endswith(b"0\r\n\r\n")
    return False


async def raw_exchange(url: str, data: bytes, wait: float = 2.0) -> bytes:
    """Send raw bytes on a new connection; what came back until EOF, or until ``wait`` s
    after the first whole response (a kept-alive connection stays open). The first
    response is waited for up to 30 s (a hang guard: a busy machine can take seconds)."""
    sock = await trio.open_tcp_stream(*addr(url))
    out = b""
    head_only = data.startswith(b"HEAD ")
    try:
        await sock.send_all(data)
        with trio.move_on_after(30):
            while not _first_response_complete(out, head_only):
                chunk = await sock.receive_some(65536)
                if not chunk:
                    return out
                out += chunk
        with trio.move_on_after(wait):
            while chunk := await sock.receive_some(65536):
                out += chunk
    except trio.BrokenResourceError:
        pass
    finally:
        await sock.aclose()
    return out


def split_response(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode()] = v.strip().decode("latin-1")
    return status, headers, body


def request_bytes(url: str, path: str, body: bytes, headers: str = "") -> bytes:
    host, port = addr(url)
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


async def small_window_socket(url: str) -> trio.SocketStream:
    """A connection whose receive buffer is tiny, so a client that does not read blocks the
    server's writes after a few KiB instead of megabytes."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(addr(url))
    return trio.SocketStream(sock)


async def read_response(sock: trio.SocketStream) -> bytes:
    """One whole HTTP/1.1 response (Content-Length or chunked framing; the server may keep
    the connection open afterwards)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = await sock.receive_some(65536)
        assert chunk, raw[-200:]
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length if length is not None else not body.endswith(b"0\r\n\r\n"):
        chunk = await sock.receive_some(65536)
        assert chunk, raw[-200:]
        body += chunk
    return head + b"\r\n\r\n" + body


def sse_events(body: bytes) -> list[bytes]:
    """The SSE events of a chunked response body (de-chunked first)."""
    data = b""
    rest = body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        data += rest[:size]
        rest = rest[size + 2 :]
    return [e for e in data.split(b"\n\n") if e]


# -- malformed bodies ------------------------------------------------------------------------

DEPTH = 100_000
HOSTILE_COMPLETIONS = [
    # deep nesting inside an otherwise fine request, in an object and in a list
    b'{"prompt": "x", "extra": ' + b'{"a": ' * DEPTH + b"1" + b"}" * DEPTH + b"}",
    b'{"prompt": ' + b"[" * DEPTH + b"]" * DEPTH + b"}",
    b'{"prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    # invalid UTF-8: in a string, overlong encodings, a UTF-16 body, a BOM, NUL bytes
    b'{"prompt": "caf\xe9"}',
    b'{"prompt": "\xc0\xaf"}',
    '{"prompt": "x"}'.encode("utf-16"),
    b'\xef\xbb\xbf{"prompt": "x"}',
    b'{"prompt": "x"\x00}',
    b"\x00" * 64,
    b"",
    # huge numbers
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",  # past int parsing's digit limit
    b'{"prompt": "x", "max_tokens": 1e999999}',
    b'{"prompt": "x", "max_tokens": -1e999999}',
    b'{"prompt": "x", "n": 1' + b"0" * 100 + b"}",
    b'{"prompt": "x", "seed": 1' + b"0" * 40 + b"}",
    b'{"prompt": "x", "temperature": 1e308}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "top_p": -Infinity}',
    b'{"prompt": [99999999999999999999]}',
    b'{"prompt": [[1, 2], [3, 1e400]]}',
    # caps
    b'{"prompt": "x", "n": 17}',
    b'{"prompt": "x", "max_tokens": 32769}',
    b'{"prompt": "x", "max_tokens": 8192}',  # under the cap, over the context: the engine says
    b'{"prompt": ' + json.dumps(["x"] * 65).encode() + b"}",
    b'{"prompt": "x", "stop": ' + json.dumps(["s"] * 17).encode() + b"}",
    # wrong shapes
    b'{"prompt": {"a": 1}}',
    b'{"prompt": null}',
    b'{"prompt": "x", "stream_options": [1]}',
    b'{"prompt": "x", "stream": true, "stream_options": "yes"}',
    b'{"prompt": "x", "user": 5}',
    b'{"prompt": "x", "echo": "true"}',
    b'{"prompt": "x", "ignore_eos": 1}',
    b'{"prompt": "x"} trailing',
    b'{"prompt": "x", "prompt": 5}',  # duplicate key: the last one wins
]

HOSTILE_CHAT = [
    b'{"messages": ' + b"[" * DEPTH + b"]" * DEPTH + b"}",
    b'{"messages": [{"role": "user", "content": [' + b"[" * 5000 + b"]" * 5000 + b"]}]}",
    b'{"messages": [{"role": "user", "content": "\xff"}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99999999999}',
    b'{"messages": [{"role": "user", "content": "x"}], "n": 1000000}',
    b'{"messages": [{"role": ["user"], "content": "x"}]}',
    b'{"messages": [{"content": "x"}]}',
    b'{"messages": [null]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    b'{"messages": [{"role": "user", "content": [null]}]}',
    b'{"messages": {"role": "user", "content": "x"}}',
    b'{"prompt": "completions field on chat"}',
]


async def test_hostile_bodies_get_a_4xx_with_an_openai_body():
    async with running_server(max_body_bytes=1 << 20) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for body in HOSTILE_COMPLETIONS:
                check_error(await http.post("/v1/completions", content=body, headers=JSON))
            for body in HOSTILE_CHAT:
                check_error(await http.post("/v1/chat/completions", content=body, headers=JSON))
            # A body that is too large, declared or not, and an absurd Content-Length.
            check_error(await http.post("/v1/completions", content=b"x" * (2 << 20), headers=JSON), 413)
            raw = await raw_exchange(
                url, request_bytes(url, "/v1/completions", b"{}").replace(
                    b"Content-Length: 2", b"Content-Length: 1000000000000"
                )
            )
            status, headers, body = split_response(raw)
            assert status == 413 and json.loads(body)["error"]["code"] == "payload_too_large"
            r = await http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


async def test_lone_surrogates_are_a_400_and_leave_nothing_behind():
    bodies = [
        ("/v1/completions", b'{"prompt": "\\ud800"}'),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff x"], "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ]
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for path, body in bodies:
                check_error(await http.post(path, content=body, headers=JSON), 400)
            # a valid surrogate pair is just an emoji
            r = await http.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', headers=JSON)
            assert r.status_code == 200
        stats = url.engine.statistics()
        assert (stats.open_streams, stats.outstanding) == (0, 0)


async def test_unknown_model_with_a_lone_surrogate_is_a_4xx():
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            r = await http.post("/v1/completions", content=b'{"prompt": "x", "model": "\\ud800"}', headers=JSON)
            check_error(r)


async def test_seed_at_the_top_of_its_range_with_n():
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            r = await http.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 2, "n": 3, "seed": 2**64 - 1},
            )
            assert r.status_code < 500, r.text
        stats = url.engine.statistics()
        assert (stats.open_streams, stats.outstanding) == (0, 0)


# -- bad headers, routes and methods ---------------------------------------------------------

H = b"Host: test\r\n"
RAW_REQUESTS = {
    "content-length not a number": b"POST /v1/completions HTTP/1.1\r\n" + H + b"Content-Length: abc\r\n\r\n{}",
    "negative content-length": b"POST /v1/completions HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n{}",
    "two content-lengths": b"POST /v1/completions HTTP/1.1\r\n" + H + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "header too large": b"GET /health HTTP/1.1\r\n" + H + b"X-A: " + b"a" * 100_000 + b"\r\n\r\n",
    "bad header name": b"GET /health HTTP/1.1\r\n" + H + b"X A: b\r\n\r\n",
    "header without colon": b"GET /health HTTP/1.1\r\n" + H + b"nonsense\r\n\r\n",
    "garbage request line": b"GARBAGE\r\n\r\n",
    "binary junk": b"\x00\x01\x02\x03\xff\r\n\r\n",
    "no host": b"GET /health HTTP/1.1\r\n\r\n",
    "request line too long": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n" + H + b"\r\n",
    "body in latin-1": b"POST /v1/completions HTTP/1.1\r\n" + H
    + b"Content-Type: application/json; charset=latin-1\r\nContent-Length: 17\r\n\r\n"
    + b'{"prompt": "caf\xe9"}',
    "body in utf-16": b"POST /v1/chat/completions HTTP/1.1\r\n" + H
    + b"Content-Type: application/json; charset=utf-16\r\nContent-Length: 6\r\n\r\n"
    + "{}".encode("utf-16"),
    "non-ascii header value": b"POST /v1/completions HTTP/1.1\r\n" + H
    + b"X-Request-Id: \xff\xfe\x00\r\nAuthorization: Bearer \xe9\r\nContent-Length: 2\r\n\r\n{}",
    "form-encoded body": b"POST /v1/completions HTTP/1.1\r\n" + H
    + b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 8\r\n\r\nprompt=x",
    "unknown route": b"GET /v2/completions HTTP/1.1\r\n" + H + b"\r\n",
    "trailing slash": b"POST /v1/completions/ HTTP/1.1\r\n" + H + b"Content-Length: 2\r\n\r\n{}",
    "path traversal": b"GET /../../etc/passwd HTTP/1.1\r\n" + H + b"\r\n",
    "percent-encoded junk": b"GET /v1/models/%ff%fe%00%ED%A0%80 HTTP/1.1\r\n" + H + b"\r\n",
    "DELETE completions": b"DELETE /v1/completions HTTP/1.1\r\n" + H + b"\r\n",
    "PATCH chat": b"PATCH /v1/chat/completions HTTP/1.1\r\n" + H + b"Content-Length: 2\r\n\r\n{}",
    "PUT health": b"PUT /health HTTP/1.1\r\n" + H + b"Content-Length: 0\r\n\r\n",
    "TRACE": b"TRACE /v1/models HTTP/1.1\r\n" + H + b"\r\n",
    "made-up method": b"BREW /v1/completions HTTP/1.1\r\n" + H + b"\r\n",
    "websocket upgrade": b"GET /v1/completions HTTP/1.1\r\n" + H
    + b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: x\r\nSec-WebSocket-Version: 13\r\n\r\n",
}


@pytest.mark.direct_http
async def test_bad_headers_routes_and_methods_are_4xx_never_5xx():
    async with running_server() as url:
        async with trio.open_nursery() as nursery:
            results = {}

            async def one(name, data):
                results[name] = await raw_exchange(url, data, wait=3.0)

            for name, data in RAW_REQUESTS.items():
                nursery.start_soon(one, name, data)
        for name, raw in results.items():
            assert raw.startswith(b"HTTP/1.1 4"), (name, raw[:300])
            status, headers, body = split_response(raw)
            assert b"Traceback" not in raw, name
            assert "server" not in headers, name  # no banner naming the implementation
            assert headers["x-request-id"], name  # also on what h11 refused before the app
            if "chunked" in headers.get("transfer-encoding", ""):
                body = b"".join(sse_events(body))
            error = json.loads(body)["error"]
            assert error["message"] and "type" in error, name
        assert split_response(results["unknown route"])[0] == 404
        assert split_response(results["DELETE completions"])[0] == 405
        assert split_response(results["PUT health"])[0] == 405
        assert split_response(results["header too large"])[0] == 431
        # The one 5xx: h11 answers a transfer coding it does not implement with 501, as RFC
        # 9112 asks, before the app sees the request.
        raw = await raw_exchange(
            url, b"POST /v1/completions HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip\r\n\r\n{}"
        )
        status, headers, body = split_response(raw)
        assert status == 501 and json.loads(body)["error"]["code"] == "not_implemented"
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.head("/v1/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200


# -- the property-based fuzzer ---------------------------------------------------------------

# Integers up to 2**80, but none just under 2**64 (see test_seed_at_the_top_of_its_range_with_n,
# a known bug; drop the filter once it is fixed).
_ints = st.integers(-(2**80), 2**80).filter(lambda i: not 2**64 - 64 < i < 2**64)
# st.text() never makes lone surrogates (see test_lone_surrogates_are_a_400_..., a known bug).
_texts = st.text(max_size=30)
_scalars = st.none() | st.booleans() | _ints | st.floats() | _texts
json_values = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
    max_leaves=20,
)
_mixed = st.lists(_scalars, min_size=1, max_size=4)  # a list of the wrong things
_token_ids = st.lists(st.integers(-3, 2**32) | _ints, max_size=8)
_prompt = (
    st.text(max_size=60)
    | st.lists(st.text(max_size=20), max_size=6)
    | _token_ids
    | st.lists(_token_ids, max_size=5)
    | _mixed
    | json_values
)
_content = (
    st.text(max_size=60)
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]) | json_values},
            optional={"text": st.text(max_size=20) | json_values},
        ),
        max_size=3,
    )
    | json_values
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", ""])
        | json_values,
        "content": _content,
        "name": _texts,
    },
)
_counts = st.integers(-3, 80) | _ints | json_values
FIELDS = {
    "model": st.sampled_from(["sim", "gpt-4", ""]) | json_values,
    "prompt": _prompt,
    "messages": st.lists(_message | json_values, max_size=4) | _mixed | json_values,
    "max_tokens": _counts,
    "max_completion_tokens": _counts,
    "n": st.integers(-2, 6) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values,
    "seed": _ints | json_values,
    "stop": st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=20) | _mixed | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values})
    | json_values,
    "logprobs": st.sampled_from([None, False, 0, True, 1, 5]) | json_values,
    "echo": st.booleans() | json_values,
    "user": _texts | json_values,
    "ignore_eos": st.booleans() | json_values,
    # fault injection is off on this server: the field must be refused by name
    "fault": st.fixed_dictionaries(
        {"kind": st.sampled_from(FAULT_KINDS), "after": st.integers(0, 3)}
    ),
}
_objects = st.builds(
    lambda known, extra: {**extra, **known},
    st.fixed_dictionaries({}, optional=FIELDS),
    st.dictionaries(st.text(max_size=10), json_values, max_size=3),
)
_valid_completion = st.fixed_dictionaries(
    {"prompt": st.text(string.ascii_letters + " ", min_size=1, max_size=30),
     "max_tokens": st.integers(1, 64)}
)
_valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                               "content": st.text(max_size=30)}),
        min_size=1, max_size=3)}
)
_COMMON_FIELDS = sorted(set(FIELDS) - {"prompt", "messages", "echo"})
_wrong = _mixed | _scalars | json_values  # a value of the wrong kind, for any field


def _one_mistake(valid, structural: str, own: list[str]):
    """A valid body with one field added or replaced by a generated value: a plausible one
    or one of the wrong kind. The endpoint's structural field (prompt, messages) is picked
    as often as all the others together."""
    names = st.sampled_from(_COMMON_FIELDS + own) | st.just(structural)
    plausible = names.flatmap(lambda name: FIELDS[name].map(lambda value: {name: value}))
    wrong = st.builds(lambda name, value: {name: value}, names, _wrong)
    change = st.just({}) | plausible | wrong | wrong
    return st.builds(lambda base, change: {**base, **change}, valid, change).map(
        lambda o: json.dumps(o).encode()
    )


anything = (
    _objects.map(lambda o: json.dumps(o).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
)
_reserved = {
    "content-length", "transfer-encoding", "host", "connection", "upgrade", "expect",
    "http2-settings", "te", "trailer", "keep-alive", "proxy-connection",
}
_header_names = st.sampled_from(
    ["content-type", "accept", "authorization", "x-request-id", "user-agent", "origin",
     "accept-encoding", "content-encoding", "openai-organization", "cookie", "x-forwarded-for"]
) | st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=20)
_header_values = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60) | st.sampled_from(
    ["application/json", "text/plain", "application/json; charset=utf-16", "gzip",
     "text/event-stream", "Bearer x", ""]
)
headers = st.dictionaries(_header_names, _header_values, max_size=5).map(
    # JSON unless the example says otherwise: the content type is one of the headers drawn
    lambda h: {"content-type": "application/json"}
    | {k.lower(): v for k, v in h.items() if k.lower() not in _reserved}
)
#: How many generated requests (set TRIO_LLM_FUZZ_EXAMPLES=2000 for a longer hunt).
FUZZ_EXAMPLES = int(os.environ.get("TRIO_LLM_FUZZ_EXAMPLES", "150"))
_paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
cases = st.one_of(
    # most examples are one mistake away from a valid request for their endpoint
    st.tuples(st.just("/v1/completions"), _one_mistake(_valid_completion, "prompt", ["echo"]), headers),
    st.tuples(st.just("/v1/chat/completions"), _one_mistake(_valid_chat, "messages", []), headers),
    st.tuples(_paths, anything, headers),
)


def check_any_response(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text
    if r.status_code >= 400:
        check_error(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
    else:
        assert r.json()["choices"]


async def test_property_generated_requests_never_get_a_5xx():
    config = EngineConfig(
        engine_options={**FAST_SIM, "itl_ms": 0.5, "max_model_len": 64}, drain_timeout=0.5
    )
    limits = Limits(max_n=4, max_tokens=64, max_prompts=4)
    async with running_server(config, limits=limits, max_body_bytes=1 << 16) as url:
        engine = url.engine
        seen = []

        def fuzz():  # runs in a thread; the server runs in this test's Trio loop
            with httpx.Client(base_url=url, timeout=30) as http:

                @settings(
                    max_examples=FUZZ_EXAMPLES,
                    deadline=None,
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                @given(cases)
                def one(case):
                    path, body, hdrs = case
                    r = http.post(path, content=body, headers=hdrs)
                    seen.append(r.status_code)
                    check_any_response(r)
                    trio.from_thread.run(assert_engine_idle, engine, 2.0)

                one()

        await trio.to_thread.run_sync(fuzz)
        assert len(seen) >= FUZZ_EXAMPLES
        print("statuses:", {s: seen.count(s) for s in sorted(set(seen))})
        assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/completions", json={"prompt": "after", "max_tokens": 3})
            assert r.status_code == 200
        await assert_engine_idle(engine)


# -- clients that never read, read slowly, or send nothing -----------------------------------


async def test_unread_streams_are_merged_not_queued_and_others_are_not_slowed():
    config = EngineConfig(engine_options={**FAST_SIM, "itl_ms": 1.0, "max_model_len": 100_000})
    limits = Limits(max_tokens=100_000)
    async with running_server(config, limits=limits) as url:
        engine = url.engine
        worker = engine.workers[0]
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})).status_code == 200

            # Three clients send a streaming request for 2000 tokens and never read.
            socks, choices = [], []
            try:
                body = json.dumps({"prompt": "p", "max_tokens": 2000, "stream": True}).encode()
                for _ in range(3):
                    known = set(worker.states)
                    sock = await small_window_socket(url)
                    await sock.send_all(request_bytes(url, "/v1/completions", body))
                    socks.append(sock)
                    with trio.fail_after(30):
                        while not set(worker.states) - known:
                            await trio.sleep(0.005)
                    (rid,) = set(worker.states) - known
                    choices.append(worker.states[rid])

                # The writers block on the full sockets; what the engine produces meanwhile is
                # merged into one pending string per choice, with at most one ready entry.
                biggest_queue = 0
                with trio.fail_after(20):
                    while not all(len(c.text) > 3000 for c in choices):
                        biggest_queue = max(biggest_queue, *(len(c.waker.ready) for c in choices))
                        await trio.sleep(0.01)
                assert biggest_queue <= 1
                assert all(not c.done for c in choices)

                # Meanwhile another client is served, while the three writers stay blocked on
                # their full sockets (how fast is the machine's: the bound is a hang guard).
                with trio.fail_after(20):
                    r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
                assert r.status_code == 200

                # The engine finishes them while nobody reads: what was not sent is one string.
                with trio.fail_after(30):
                    while not all(c.done for c in choices):
                        await trio.sleep(0.02)
                assert all(c.completion_tokens == 2000 for c in choices)
                assert all(len(c.waker.ready) <= 1 for c in choices)

                # Reading now gets everything, in far fewer events than tokens.
                for sock in socks:
                    raw = b""
                    with trio.fail_after(30):
                        while not raw.endswith(b"0\r\n\r\n"):
                            chunk = await sock.receive_some(65536)
                            assert chunk, raw[-200:]
                            raw += chunk
                    await sock.aclose()
                    status, _, chunked = split_response(raw)
                    assert status == 200
                    events = sse_events(chunked)
                    assert events[-1] == b"data: [DONE]"
                    data = [json.loads(e[6:]) for e in events[:-1]]
                    text = "".join(d["choices"][0]["text"] for d in data)
                    assert len(text.split()) == 2000
                    assert data[-1]["choices"][0]["finish_reason"] == "length"
                    assert len(data) < 2000 / 2
            finally:  # (a server cannot stop while a client holds a stream unread: see
                for sock in socks:  # test_a_client_that_never_reads_does_not_hold_up_...)
                    await sock.aclose()


async def test_a_slow_reader_gets_everything_and_does_not_slow_others():
    config = EngineConfig(engine_options={**FAST_SIM, "itl_ms": 1.0})
    async with running_server(config) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = json.dumps({"prompt": "p", "max_tokens": 2000, "stream": True}).encode()
            sock = await small_window_socket(url)
            try:
                await sock.send_all(request_bytes(url, "/v1/completions", body))
                raw = b""
                served: list[int] = []
                with trio.fail_after(120):
                    while not raw.endswith(b"0\r\n\r\n"):
                        chunk = await sock.receive_some(1024)  # 1 KiB every 20 ms
                        assert chunk
                        raw += chunk
                        await trio.sleep(0.02)
                        if len(served) < 5 and len(raw) > 4096 * (len(served) + 1):
                            # another client is served meanwhile (the bound: a hang guard)
                            with trio.fail_after(20):
                                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
                            served.append(r.status_code)
            finally:
                await sock.aclose()
        events = sse_events(split_response(raw)[2])
        assert events[-1] == b"data: [DONE]"
        data = [json.loads(e[6:]) for e in events[:-1]]
        assert len("".join(d["choices"][0]["text"] for d in data).split()) == 2000
        assert served == [200] * 5


async def test_idle_and_half_open_connections_are_closed_by_hypercorn():
    async with running_server(keep_alive_timeout=1.0, read_timeout=1.0) as url:
        host, port = addr(url)
        closed: dict[str, bytes] = {}

        async def watch(name, data=b"", then_read_response=False):
            sock = await trio.open_tcp_stream(host, port)
            if data:
                await sock.send_all(data)
            got = b""
            with trio.move_on_after(30):  # a hang guard (the timeouts are 1 s): how soon each
                try:                      # is closed is not asserted on a busy machine
                    while True:
                        chunk = await sock.receive_some(65536)
                        if not chunk:
                            break
                        got += chunk
                except trio.BrokenResourceError:
                    pass
                closed[name] = got
            await sock.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, "sends nothing")
            nursery.start_soon(watch, "half a request line", b"POST /v1/comp")
            nursery.start_soon(watch, "headers, no end", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            nursery.start_soon(
                watch, "body never finished",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro",
            )
            nursery.start_soon(
                watch, "idle keep-alive",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 32\r\n\r\n"
                b'{"prompt": "a", "max_tokens": 1}',
            )
            # and the server keeps serving meanwhile
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
                assert r.status_code == 200
        assert set(closed) == {
            "sends nothing", "half a request line", "headers, no end", "body never finished",
            "idle keep-alive",
        }, closed
        for name, got in closed.items():
            if got:
                assert not got.startswith(b"HTTP/1.1 5"), (name, got[:200])
        assert closed["idle keep-alive"].startswith(b"HTTP/1.1 200")


async def test_a_long_stream_outlives_the_read_timeout():
    async with running_server(read_timeout=1.0, keep_alive_timeout=1.0) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"prompt": "p", "max_tokens": 1200, "stream": True}  # ~2.5 s at 2 ms a token
            async with http.stream("POST", "/v1/completions", json=body) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
            assert raw.endswith(b"data: [DONE]\n\n")
            r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 1200})
            assert r.status_code == 200


async def read_to_eof(url: str, data: bytes) -> bytes:
    sock = await trio.open_tcp_stream(*addr(url))
    try:
        await sock.send_all(data)
        raw = b""
        while chunk := await sock.receive_some(65536):
            raw += chunk
        return raw
    finally:
        await sock.aclose()


async def test_connection_close_and_http_1_0_end_with_the_response():
    stream = json.dumps({"prompt": "x", "max_tokens": 3, "stream": True}).encode()
    async with running_server(read_timeout=30.0) as url:
        cases = {
            "health, Connection: close":
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            "health, HTTP/1.0": b"GET /health HTTP/1.0\r\n\r\n",
            "completion, Connection: close": request_bytes(
                url, "/v1/completions", b'{"prompt": "x", "max_tokens": 3}', "Connection: close\r\n"
            ),
            "stream, HTTP/1.0":
                b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(stream), stream),
        }
        for name, data in cases.items():
            with trio.fail_after(30):
                raw = await read_to_eof(url, data)
            assert raw.startswith(b"HTTP/1.1 200"), name
        assert raw.endswith(b"data: [DONE]\n\n")


# -- storms ----------------------------------------------------------------------------------


async def test_a_storm_of_clients_that_disconnect_at_random_points():
    rng = random.Random(5)
    config = EngineConfig(engine_options={**FAST_SIM, "faults": True}, workers=2, drain_timeout=0.5)
    async with running_server(config) as url:
        host, port = addr(url)
        outcomes = {"normal": 0, "cut": 0}
        limiter = trio.CapacityLimiter(100)

        async def client(k: int) -> None:
            how = rng.randrange(9)
            chat = rng.random() < 0.3
            body = {"max_tokens": rng.randint(1, 400), "stream": rng.random() < 0.7}
            if chat:
                body["messages"] = [{"role": "user", "content": "hi " * rng.randint(1, 20)}]
            else:
                body["prompt"] = ["a b", "c"] if rng.random() < 0.2 else "x " * rng.randint(1, 30)
            if rng.random() < 0.2:
                body["n"] = rng.randint(2, 4)
            if rng.random() < 0.1:
                body["fault"] = {"kind": rng.choice(["stall", "ignore_abort", "error"]), "after": rng.randint(0, 5)}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            data = request_bytes(url, path, json.dumps(body).encode())
            cut = {
                0: 0,                              # connect, then close
                1: rng.randint(1, 40),             # inside the request line or headers
                2: data.index(b"\r\n\r\n") + 4,    # headers, no body
                3: len(data) - rng.randint(1, 5),  # most of the body
            }.get(how, len(data))
            delay = rng.random() * 0.2
            async with limiter:
                sock = await trio.open_tcp_stream(host, port)
                try:
                    await sock.send_all(data[:cut])
                    if how <= 4:  # 4: the whole request, then gone
                        await trio.sleep(delay)
                        outcomes["cut"] += 1
                        return
                    if how <= 6:  # read some of the response, then gone
                        want = rng.randint(1, 5000)
                        got = 0
                        with trio.move_on_after(delay + 0.05):
                            while got < want:
                                chunk = await sock.receive_some(want - got)
                                if not chunk:
                                    break
                                got += len(chunk)
                        outcomes["cut"] += 1
                        return
                    # 7, 8: a normal client
                    with trio.move_on_after(1 if body.get("fault") else 30) as scope:
                        raw = await read_response(sock)
                    if scope.cancelled_caught:  # a stalled request: give up on it
                        outcomes["cut"] += 1
                        return
                    status = int(raw.split()[1])
                    assert status < 500 or b"engine_error" in raw, raw[:300]
                    if status == 200 and body["stream"]:
                        assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), raw[-100:]
                    outcomes["normal"] += 1
                finally:
                    await sock.aclose()

        async with trio.open_nursery() as nursery:
            for k in range(300):
                nursery.start_soon(client, k)
                if k % 25 == 0:
                    await trio.sleep(0.02)
        assert sum(outcomes.values()) == 300 and outcomes["normal"] > 20, outcomes
        # ignore_abort requests run to their end in the worker; give them time
        await assert_engine_idle(url.engine, timeout=15)
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/completions", json={"prompt": "calm", "max_tokens": 3})
            assert r.status_code == 200


async def test_idle_keep_alive_after_a_quart_route_is_closed():
    # quart-trio cancelled itself on the disconnect hypercorn delivers inside the last send,
    # which cancelled hypercorn restarting its idle timer (see HeaderSend.receive).
    async with running_server(keep_alive_timeout=1.0) as url:
        host, port = addr(url)
        sock = await trio.open_tcp_stream(host, port)
        await sock.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(30):
            while await sock.receive_some(65536):
                pass
        await sock.aclose()


@pytest.mark.direct_http
async def test_clients_that_stop_reading_do_not_keep_their_slots():
    from server.config import ServerConfig

    extra = {}
    if "send_timeout" in ServerConfig.__dataclass_fields__:  # a bound on stalled writes
        extra["send_timeout"] = 2.0
    async with running_server(max_concurrent_requests=2, request_timeout=1.0, **extra) as url:
        socks = []
        try:
            body = json.dumps({"prompt": "p", "max_tokens": 3000, "stream": True}).encode()
            for _ in range(2):
                sock = await small_window_socket(url)
                await sock.send_all(request_bytes(url, "/v1/completions", body))
                socks.append(sock)
            async with httpx.AsyncClient(base_url=url) as http:
                # (a hang guard: without the bound on stalled writes the slots are held
                # for ever; with it, request timeout + drain + the bound: about 4 s)
                with trio.fail_after(30):
                    while True:
                        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                        if r.status_code == 200:
                            break
                        assert r.json()["error"]["code"] == "server_overloaded"
                        await trio.sleep(0.5)
        finally:
            for sock in socks:
                await sock.aclose()


@pytest.mark.direct_http
async def test_connections_closed_by_their_clients_are_released_at_once():
    import os

    async with running_server(keep_alive_timeout=30.0) as url:
        await trio.sleep(0.3)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(30):  # each on its own connection, closed by the client
            async with httpx.AsyncClient(base_url=url) as http:
                body = {"prompt": "x", "max_tokens": 2, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_raw():
                        pass
        # released at once, not after the 30 s keep-alive: waited for within 20 s (a hang
        # guard under that timeout), not assumed done after a fixed pause
        with trio.fail_after(20):
            while len(os.listdir("/proc/self/fd")) > before + 5:
                await trio.sleep(0.05)
