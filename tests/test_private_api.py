"""Issue 25 item 3: the private names of hypercorn and h11 in one module, checked.

* The version check is exact, and names what differs (sans-IO).
* The installed libraries are the ones it was written for, so the direct path is in use
  (a test that fails when a dependency update silently turns it off).
* A server whose libraries differ refuses to start unless the fallback is allowed; then it
  serves through hypercorn's public ``serve()``, says so at every start and in /metrics,
  and streams the same answers; forcing the direct path then is refused.
"""

from __future__ import annotations

import json
import logging

import h11
import httpx
import pytest

from server.connections import private_api
from server.connections.private_api import WRITTEN_FOR, use_direct_path, version_mismatch
from tests.conftest import JSON, running_server


def test_the_version_check_is_exact_and_names_what_differs():
    assert version_mismatch(dict(WRITTEN_FOR)) is None
    newer = {**WRITTEN_FOR, "hypercorn": "0.18.1"}
    problem = version_mismatch(newer)
    assert problem == f"hypercorn 0.18.1 (written for {WRITTEN_FOR['hypercorn']})"
    gone = {"hypercorn": WRITTEN_FOR["hypercorn"], "h11": None}
    assert version_mismatch(gone) == f"h11 not installed (written for {WRITTEN_FOR['h11']})"


def test_the_installed_libraries_are_the_ones_it_was_written_for(monkeypatch):
    monkeypatch.delenv(private_api.FALLBACK_ENV, raising=False)
    assert private_api.direct_path_problem() is None
    assert private_api.missing_names() == []
    assert use_direct_path() is True


async def _stream_one(url: str) -> tuple[str, str | None]:
    """The text and finish reason of one streamed completion (not where events split: that
    depends on the load)."""
    body = {"prompt": "hi", "max_tokens": 12, "stream": True, "seed": 7}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body, headers=JSON) as r:
            assert r.status_code == 200
            assert r.headers["transfer-encoding"] == "chunked"
            raw = "".join([chunk async for chunk in r.aiter_text()])
    assert raw.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


async def _http_fallback_gauge(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    (line,) = [x for x in text.splitlines() if x.startswith("trio_llm:http_fallback{")]
    return line.split()[1]


async def test_other_versions_refuse_to_start_unless_the_fallback_is_allowed(monkeypatch, caplog):
    """Issue 42 item 6: which patch release pip picked must not silently turn off the
    connection limit, bounded writes and the head checks."""
    monkeypatch.delenv(private_api.FALLBACK_ENV, raising=False)
    monkeypatch.setattr(private_api, "direct_path_problem", lambda: "hypercorn 9.9 (written for x)")
    with pytest.raises(ValueError, match="hypercorn 9.9"):
        use_direct_path(True)
    with pytest.raises(private_api.HTTPPathError, match="--allow-http-fallback"):
        use_direct_path()
    with pytest.RaisesGroup(pytest.RaisesExc(private_api.HTTPPathError, match="hypercorn 9.9"),
                            flatten_subgroups=True):
        async with running_server():
            raise AssertionError("served with libraries it was not written for")
    caplog.set_level(logging.WARNING, logger="server.http")
    for _ in range(2):
        async with running_server(allow_http_fallback=True) as url:
            text, finish = await _stream_one(url)
            assert len(text.split()) == 12 and finish == "length"
            # hypercorn's own connections: the listener's pool never saw one.
            assert url.app.connections is None
            assert await _http_fallback_gauge(url) == "1.0"
    lines = [r.getMessage() for r in caplog.records if "public serve()" in r.getMessage()]
    assert len(lines) == 2 and all("hypercorn 9.9" in line for line in lines), lines


async def test_the_direct_path_answers_the_same_stream(monkeypatch):
    monkeypatch.delenv(private_api.FALLBACK_ENV, raising=False)
    async with running_server() as url:
        direct = await _stream_one(url)
        assert url.app.connections is not None
        assert await _http_fallback_gauge(url) == "0.0"
    monkeypatch.setenv(private_api.FALLBACK_ENV, "1")
    async with running_server() as url:
        public = await _stream_one(url)
        assert url.app.connections is None

    assert direct == public and len(direct[0].split()) == 12


_REQUESTS = [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.0\r\n\r\n",
    b"HEAD /health HTTP/1.0\r\n\r\n",
]
_HEADS = [
    [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")],
    [(b"Content-Length", b"2"), (b"date", b"Sat, 05 Dec 2026 01:30:00 GMT")],
    [(b"transfer-encoding", b"Chunked"), (b"content-length", b"7")],
    [(b"Connection", b"Keep-Alive, Upgrade"), (b"server", b"x")],
    [(b"connection", b"close")],
]


@pytest.mark.parametrize("request_head", _REQUESTS)
@pytest.mark.parametrize("headers", _HEADS)
@pytest.mark.parametrize("status", [200, 204, 304, 404])
def test_strict_connections_write_the_response_heads_h11_writes(request_head, headers, status):
    """StrictH11Connection sets a head's framing headers on the headers h11 validated
    once, instead of validating them again at each edit: the same bytes, the same states."""
    sent = []
    for cls in (h11.Connection, private_api.StrictH11Connection):
        connection = cls(h11.SERVER)
        connection.receive_data(request_head)
        assert type(connection.next_event()) is h11.Request
        data = connection.send(h11.Response(status_code=status, headers=headers, reason=b"R"))
        sent.append((data, connection.our_state, connection.their_state,
                     connection._cstate.keep_alive))
    assert sent[0] == sent[1]
