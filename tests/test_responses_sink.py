"""A ``/v1/responses`` stream's deltas written by the worker's router
(server.connections.sink.ResponseSink): the same events, numbered, in order, as the request's
task writes them; what the sink cannot write (an item closing or opening, a full socket, a
chunk the kernel takes in part) still goes out once and in order; a stored response keeps
every event; a client that goes away while the router writes ends the request.

End to end through hypercorn with a real worker process, on real time: where the engine's
steps fall into events depends on the load (a busy task merges steps), so what is compared
is the events apart from their splits: the items and their events, the text of each item,
the numbering, and the bytes of each event.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import trio

import server.http.responses_write as responses_write
from server.config import EngineConfig
from server.connections.connection import ServingConnection
from server.connections.http11 import DirectBody
from server.openai.encode import dumps
from tests.conftest import FAST_SIM, assert_engine_idle, running_server
from tests.test_http_cancellation import open_request, read_until
from tests.test_responses import WEATHER

pytestmark = pytest.mark.direct_http

#: 10 ms a token: the request's task parks between steps (so the router writes) unless
#: the frontend stalls for a whole answer.
SIM = {**FAST_SIM, "itl_ms": 10.0}

#: Fields that differ between two runs of the same answer.
_RUN_FIELDS = {"id", "item_id", "call_id", "created_at", "sequence_number"}


def _events(body: bytes) -> list[tuple[bytes, dict]]:
    """``(bytes, event)`` of each event of a stream, its ``event:`` line checked."""
    assert body.endswith(b"}\n\n"), body[-200:]
    found = []
    for block in body.split(b"\n\n")[:-1]:
        head, data = block.split(b"\ndata: ", 1)
        event = json.loads(data)
        assert head == b"event: " + event["type"].encode(), block
        found.append((block + b"\n\n", event))
    return found


def _without_run_fields(value):
    if isinstance(value, dict):
        return {k: _without_run_fields(v) for k, v in value.items() if k not in _RUN_FIELDS}
    if isinstance(value, list):
        return [_without_run_fields(v) for v in value]
    return value


def _answer(body: bytes) -> tuple[list, list[str]]:
    """What must not depend on who wrote the events, checked on the way: the events but
    the deltas (less what differs between runs), and each item's delta text."""
    events = _events(body)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    items: list[str] = []
    texts: list[str] = []
    open_item = None
    for raw, e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_item is None and e["output_index"] == len(items)
            open_item = e["item"]["id"]
            items.append(open_item)
            texts.append("")
        elif kind == "response.output_item.done":
            assert e["item"]["id"] == open_item
            open_item = None
        elif "item_id" in e:  # every event of an item comes between its added and its done
            assert e["item_id"] == open_item and e["output_index"] == len(items) - 1, e
        if kind.endswith(".delta"):
            # byte for byte the event the task writes (ResponseEvents' encoding)
            assert raw == b"event: " + kind.encode() + b"\ndata: " + dumps(e) + b"\n\n"
            texts[-1] += e["delta"]
    others = [_without_run_fields(e) for _, e in events if not e["type"].endswith(".delta")]
    final = events[-1][1]["response"]["output"]
    for item, text in zip(final, texts, strict=True):  # the deltas add up to each item
        whole = item["arguments"] if item["type"] == "function_call" else \
            item["content"][0]["text"]
        assert text == whole, (item, text)
    return others, texts


async def _stream(http: httpx.AsyncClient, body: dict) -> bytes:
    async with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        return b"".join([chunk async for chunk in r.aiter_raw()])


async def _replayed(http: httpx.AsyncClient, body: bytes) -> bytes:
    """The events the server stored for the response that ``body`` streamed."""
    response_id = _events(body)[0][1]["response"]["id"]
    r = await http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
    assert r.status_code == 200
    return r.content


def _recording(monkeypatch) -> list[bytes]:
    """The bodies the router's sink wrote whole (DirectBody.write_nowait)."""
    real = DirectBody.write_nowait
    written: list[bytes] = []

    def recording(self, body):
        rest = real(self, body)
        if rest == b"":
            written.append(body)
        return rest

    monkeypatch.setattr(DirectBody, "write_nowait", recording)
    return written


def _tearing(monkeypatch) -> list[int]:
    """Every third direct write taken only in half by the kernel; the count of those."""
    real = ServingConnection.write_nowait
    writes = [0]
    torn = [0]

    def tearing(self, data):
        writes[0] += 1
        if writes[0] % 3 == 0 and len(data) > 1 and not self.send_lock.locked():
            torn[0] += 1
            return real(self, data[: len(data) // 2])
        return real(self, data)

    monkeypatch.setattr(ServingConnection, "write_nowait", tearing)
    return torn


@pytest.mark.parametrize("kind", ["text", "reasoning", "call"])
async def test_deltas_written_by_the_router_are_the_tasks_events(monkeypatch, kind):
    config = EngineConfig(engine_options=SIM)
    options: dict = {}
    body: dict = {"input": "a b c", "max_output_tokens": 100}
    deltas = {"response.output_text.delta"}
    if kind == "reasoning":
        # thinking, then the answer: a reasoning item closes and a message item opens while
        # the router writes the deltas
        config = EngineConfig(engine_options={**SIM, "reasoning_tokens": 30})
        options = {"reasoning_parser": "qwen3"}
        deltas = {"response.reasoning_text.delta", "response.output_text.delta"}
    elif kind == "call":
        # the call's head held back by the parser, then its arguments
        options = {"tool_call_parser": "hermes"}
        body = {"input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 100}
        deltas = {"response.function_call_arguments.delta"}
    body = {**body, "stream": True, "temperature": 0}
    streams = {}
    async with running_server(config, **options) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(30):
                # the request's task writes every event (the path without a sink)
                with monkeypatch.context() as m:
                    m.setattr(responses_write, "_hand_over", lambda *args: None)
                    streams["task"] = await _stream(http, body)
                # the router writes the deltas
                with monkeypatch.context() as m:
                    written = _recording(m)
                    streams["sink"] = await _stream(http, body)
                # the sink makes the events but no write goes through: it holds them all
                # for the task
                with monkeypatch.context() as m:
                    m.setattr(DirectBody, "write_nowait", lambda self, body: None)
                    streams["held"] = await _stream(http, body)
                # the kernel takes some writes in part: the rest goes first
                with monkeypatch.context() as m:
                    torn = _tearing(m)
                    streams["torn"] = await _stream(http, body)
                replays = {name: await _replayed(http, b) for name, b in streams.items()}
    assert torn[0] >= 1
    expected = _answer(streams["task"])
    for name, stream in streams.items():
        assert _answer(stream) == expected, name
        assert replays[name] == stream, name  # a stored response keeps every event
    # the router wrote whole delta events of the stream, of each kind
    raw = {event for event, _ in _events(streams["sink"])}
    assert written and all(chunk in raw for chunk in written)
    kinds = [json.loads(chunk.split(b"\ndata: ", 1)[1])["type"] for chunk in written]
    assert set(kinds) == deltas, kinds


async def test_a_client_gone_while_the_router_writes_ends_the_request(monkeypatch, caplog):
    # A long answer, its deltas written by the router; then the connection stops taking
    # the router's writes (as a full socket buffer, or one the client closed, does), and
    # the client goes away: the request is aborted, nothing fails, the server serves on.
    caplog.set_level(logging.ERROR)
    config = EngineConfig(engine_options={**SIM, "max_model_len": 1 << 20})
    async with running_server(config) as url:
        written = _recording(monkeypatch)
        sock = await open_request(url, "/v1/responses", {
            "input": "go", "max_output_tokens": 30_000, "stream": True})
        with trio.fail_after(30):
            await read_until(sock, b"response.output_text.delta", 5)
            while len(written) < 10:
                await read_until(sock, b"response.output_text.delta")
            refused = []
            monkeypatch.setattr(DirectBody, "write_nowait",
                                lambda self, body: refused.append(body))
            while len(refused) < 3:  # held by the sink, sent by the request's task
                await read_until(sock, b"response.output_text.delta")
        (running, _), = await url.engine.ping_all()
        assert running == 1
        await sock.aclose()
        await assert_engine_idle(url.engine, timeout=30)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(30):
                again = await _stream(http, {"input": "x", "max_output_tokens": 5,
                                             "stream": True})
        assert _events(again)[-1][1]["type"] == "response.incomplete"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
