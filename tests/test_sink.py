"""The router writes a plain stream's text events (server.http.sink): same bytes, no wakeups.

End to end through hypercorn with a real worker process, and at the manager level with
in-memory workers under autojump_clock.
"""

from __future__ import annotations

import json

import httpx
import trio

import server
from server.http.protocol import DirectBody
from server.manager.stream import RequestStream
from tests.conftest import running_server
from tests.fakes import open_fake_engine, sim_config


def _events(body: bytes) -> list:
    """The stream's events, without what differs between two runs (id, created)."""
    out = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = json.loads(event[6:])
            chunk.pop("id", None)
            chunk.pop("created", None)
            out.append(chunk)
        elif event:
            out.append(event.decode())
    return out


async def _stream(http: httpx.AsyncClient, body: dict) -> bytes:
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        return b"".join([chunk async for chunk in r.aiter_raw()])


async def test_plain_text_events_are_written_by_the_router_byte_for_byte(monkeypatch):
    real = DirectBody.write_nowait
    direct = 0

    def counting(self, body):
        nonlocal direct
        rest = real(self, body)
        if rest == b"":
            direct += 1
        return rest

    body = {"prompt": "a b c", "max_tokens": 40, "stream": True, "seed": 3,
            "stream_options": {"include_usage": True}}
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            monkeypatch.setattr(DirectBody, "write_nowait", counting)
            with trio.fail_after(20):
                fast = await _stream(http, body)
            # without the extension's writes: the request's task writes every event
            monkeypatch.setattr(DirectBody, "write_nowait", lambda self, body: None)
            with trio.fail_after(20):
                slow = await _stream(http, body)
    assert fast.endswith(b"data: [DONE]\n\n")
    assert _events(fast) == _events(slow)
    assert len(_events(fast)) == 40 + 2  # an event per token, usage, [DONE]
    # the first event and the last go through the task; most others through the router
    assert direct >= 30, direct


async def _first_then_rest(engine, sink, max_tokens: int):
    params = server.SamplingParams(max_tokens=max_tokens)
    woken = []
    async with engine.generate("a b", params) as stream:
        first = await stream.next_batch()
        stream.set_sink(sink)
        while outs := await stream.next_batch():
            woken.append(outs)
    return first, woken


async def test_a_sink_takes_text_without_waking_the_consumer(autojump_clock):
    taken = []

    def sink(choice) -> bool:
        taken.append((choice.text, choice.ntok))
        choice.text, choice.ntok = "", 0
        return True

    config = sim_config(itl_ms=8.0, ttft_ms=20.0, prefill_us_per_token=0.0)
    async with open_fake_engine(config) as (engine, _):
        first, woken = await _first_then_rest(engine, sink, 20)
    # the consumer woke once more: for the end; the sink had every step in between
    assert len(woken) == 1 and woken[0][0].finish_reason == "length"
    assert [n for _, n in taken] == [1] * (20 - 1 - woken[0][0].num_tokens)
    text = first[0].text + "".join(t for t, _ in taken) + woken[0][0].text
    assert len(text.split()) == 20


async def test_a_sink_that_declines_or_fails_leaves_the_text_to_the_consumer(autojump_clock):
    calls = 0

    def declining(choice) -> bool:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a broken sink")  # dropped; the router goes on
        return False

    config = sim_config(itl_ms=8.0, ttft_ms=20.0, prefill_us_per_token=0.0)
    async with open_fake_engine(config) as (engine, _):
        first, woken = await _first_then_rest(engine, declining, 10)
    assert calls == 3  # dropped after it raised
    outs = [o for batch in woken for o in batch]
    assert len((first[0].text + "".join(o.text for o in outs)).split()) == 10
    assert outs[-1].finish_reason == "length"


async def test_no_sink_with_pacing(autojump_clock):
    config = sim_config(itl_ms=8.0, ttft_ms=20.0, prefill_us_per_token=0.0)
    paced = server.EngineConfig(engine_options=config.engine_options, stream_interval=0.02)
    async with open_fake_engine(paced) as (engine, _):
        async with engine.generate("a b", server.SamplingParams(max_tokens=3)) as stream:
            assert isinstance(stream, RequestStream)
            stream.set_sink(lambda choice: True)
            assert stream._waker.sink is None
            async for _ in stream:
                pass


async def test_chunks_the_kernel_takes_in_part_go_out_whole_and_in_order(monkeypatch):
    """A socket buffer that takes only part of a chunk (the kernel's choice): the rest goes
    out first, from the request's task; the stream and the next response on the same
    connection are byte for byte those of a socket that takes everything."""
    from server.http.connection import ServingConnection

    real = ServingConnection.write_nowait
    writes = torn = 0

    def tearing(self, data):
        nonlocal writes, torn
        writes += 1
        if writes % 3 == 0 and len(data) > 1 and not self.send_lock.locked():
            torn += 1
            return real(self, data[: len(data) // 2])
        return real(self, data)

    body = {"prompt": "a b c", "max_tokens": 60, "stream": True, "seed": 5,
            "stream_options": {"include_usage": True}}
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(20):
                whole = [await _stream(http, body) for _ in range(2)]
            monkeypatch.setattr(ServingConnection, "write_nowait", tearing)
            with trio.fail_after(20):
                parts = [await _stream(http, body) for _ in range(2)]  # one connection
    assert torn >= 20
    assert [_events(b) for b in parts] == [_events(b) for b in whole]
    assert all(b.endswith(b"data: [DONE]\n\n") for b in parts)
