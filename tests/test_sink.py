"""The router writes a plain stream's text events (server.connections.sink): same bytes, no wakeups.

End to end through hypercorn with a real worker process, and at the manager level with
in-memory workers under autojump_clock.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import server
from server.config import EngineConfig
from server.openai.encode import ChunkEncoder, dumps, text_json
from server.connections.http11 import DirectBody
from server.connections.sink import TextSink
from server.manager.pacing import Pacer
from server.manager.stream import Choice, Waker
from tests.conftest import FAST_SIM, running_server
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


def _text_events(body: bytes) -> list[tuple[bytes, dict]]:
    """``(bytes, chunk)`` of each event with a choice (not usage, not [DONE])."""
    found = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = json.loads(event[6:])
            if chunk["choices"]:
                found.append((event + b"\n\n", chunk))
    return found


def _answer(body: bytes) -> tuple[str, str, dict]:
    """A stream's text, finish reason and usage: what must not depend on the timing."""
    events = _text_events(body)
    text = "".join(c["choices"][0]["text"] for _, c in events)
    return text, events[-1][1]["choices"][0]["finish_reason"], _events(body)[-2]["usage"]


def _what_the_task_writes(chunk: dict) -> bytes:
    """The event the request's task writes for ``chunk``'s content (its encoder)."""
    enc = ChunkEncoder(chat=False, response_id=chunk["id"], created=chunk["created"],
                       model=chunk["model"])
    choice = chunk["choices"][0]
    return enc.delta(choice["index"], choice["text"], choice["finish_reason"])


@pytest.mark.direct_http
@pytest.mark.parametrize("interval", [0.0, 0.02])
async def test_plain_text_events_are_written_by_the_router_byte_for_byte(monkeypatch, interval):
    # Real processes on real time: how the engine's steps fall into events depends on the
    # load (a busy consumer merges steps), so what is compared is the text, the usage and
    # the bytes of each event, never where the events split.
    real = DirectBody.write_parts_nowait
    direct: list[bytes] = []

    def recording(self, head, middle, tail):
        rest = real(self, head, middle, tail)
        if rest == b"":
            direct.append(head + middle + tail)
        return rest

    body = {"prompt": "a b c", "max_tokens": 100, "stream": True, "seed": 3,
            "stream_options": {"include_usage": True}}
    # 10 ms per token: the request's task parks between steps (so the router writes) unless
    # the frontend stalls for the whole 1 s of the answer (400 ms was within a loaded CI
    # machine's reach)
    # (and with a 20 ms stream interval: two steps per event, written by the router too)
    config = EngineConfig(engine_options={**FAST_SIM, "itl_ms": 10.0}, stream_interval=interval)
    async with running_server(config) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            monkeypatch.setattr(DirectBody, "write_parts_nowait", recording)
            with trio.fail_after(20):
                fast = await _stream(http, body)
            # without the extension's writes: the request's task writes every event
            monkeypatch.setattr(DirectBody, "write_parts_nowait", lambda self, *parts: None)
            with trio.fail_after(20):
                slow = await _stream(http, body)
    assert fast.endswith(b"data: [DONE]\n\n") and slow.endswith(b"data: [DONE]\n\n")
    events = {name: _text_events(b) for name, b in (("fast", fast), ("slow", slow))}
    # the same answer: text, finish reason, usage
    assert _answer(fast) == _answer(slow)
    text, finish, usage = _answer(fast)
    assert len(text.split()) == usage["completion_tokens"] == 100 and finish == "length"
    assert [c["choices"][0]["finish_reason"] for _, c in events["fast"][:-1]] == [None] * (
        len(events["fast"]) - 1)
    # every event byte for byte what the request's task writes for that content (the
    # router's writes included), and the router wrote whole events of this stream
    for name in events:
        assert all(raw == _what_the_task_writes(c) for raw, c in events[name]), name
    raw_events = {raw for raw, _ in events["fast"]}
    assert direct and all(chunk in raw_events for chunk in direct), direct


#: Text as an engine may make it: any code point, lone surrogates and the line breaks JSON
#: leaves raw (escaped here) included.
_TEXTS = st.text(st.characters(exclude_categories=())) | st.sampled_from(
    ["", "\x85", "a\u2028b", "\u2029", '"\\\n\t\x00', "\ud800", "é\u2028\ud83d"])


@settings(max_examples=500, deadline=None)
@given(text=_TEXTS, chat=st.booleans(), index=st.integers(0, 12))
def test_the_sinks_parts_make_the_tasks_event_byte_for_byte(text, chat, index):
    # The sink builds each event from parts made once; the task calls delta: same bytes,
    # and the same refusal (a lone surrogate) that hands the text back to the task.
    enc = ChunkEncoder(chat=chat, response_id="cmpl-1", created=1700000000, model="m")
    head, tail = enc.text_parts(index)
    try:
        expected = enc.delta(index, text)
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            text_json(text)
        return
    assert head + text_json(text) + tail == expected
    assert text_json(text) == dumps(text)  # (the encoder of every other JSON answer)
    # one SSE line for every line splitter, and the text as sent
    assert expected.endswith(b"}\n\n") and len(expected[:-2].decode().splitlines()) == 1
    assert json.loads(expected[6:])["choices"][0]["delta" if chat else "text"] == (
        {"content": text} if chat else text)


class _Choice:
    def __init__(self, text: str, index: int = 0) -> None:
        self.index, self.text, self.ntok = index, text, 1


class _Body:
    """A DirectBody's write, recorded (the bytes it would frame: head + middle + tail)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write_parts_nowait(self, head: bytes, middle: bytes, tail: bytes) -> bytes:
        self.written.append(head + middle + tail)
        return b""


def test_the_sink_writes_each_choices_event_and_hands_back_what_it_cannot_encode():
    enc = ChunkEncoder(chat=True, response_id="chatcmpl-1", created=1700000000, model="m")
    body = _Body()
    itl: list[float] = []
    sink = TextSink(body, enc, itl.append, last=0.0)  # type: ignore[arg-type]
    first, other, bad = _Choice(" a\u2028"), _Choice(" b", index=2), _Choice("\ud800")
    assert sink(first) and sink(other)
    assert body.written == [enc.delta(0, " a\u2028"), enc.delta(2, " b")]
    assert (first.text, first.ntok, len(itl)) == ("", 0, 2)
    assert not sink(bad)  # left as it was: the request's task meets it (an error event)
    assert (bad.text, bad.ntok, len(body.written)) == ("\ud800", 1, 2)


async def test_a_token_without_text_is_the_sinks_and_the_consumer_sleeps_on():
    """A step whose token made no text yet (a detokenizer holding back part of a
    character: real tokenizers do, the sim's words never) is an event with empty text. The
    sink writes it, byte for byte the task's, so the consumer is not woken for it; it
    wakes for the end. (Before, each such token woke the request's task: with the vllm
    engine on the tests' tiny model, a fifth of the tokens.)"""
    waker = Waker(Pacer(0.0))
    choice = Choice(1, 0, None, waker)  # type: ignore[arg-type]
    enc = ChunkEncoder(chat=True, response_id="chatcmpl-1", created=1700000000, model="m")
    body = _Body()
    itl: list[float] = []
    waker.sink = TextSink(body, enc, itl.append, last=0.0)  # type: ignore[arg-type]
    woke = []

    async def consumer() -> None:
        await waker.park()
        woke.append(choice.finish_reason)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        choice.push("", 1, None, None)
        choice.push(" b", 1, None, None)
        choice.push("", 1, None, None)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [] and not waker.ready
        assert body.written == [enc.delta(0, ""), enc.delta(0, " b"), enc.delta(0, "")]
        assert (choice.ntok, choice.completion_tokens, len(itl)) == (0, 3, 3)
        choice.push("", 0, "length", None)
    assert woke == ["length"]


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


async def test_with_pacing_the_sink_takes_merged_text_once_per_interval(autojump_clock):
    # 20 ms interval, 8 ms steps: the sink (not the consumer) gets the steps in between, 3
    # tokens at a time, at least an interval apart; the consumer wakes for the end only.
    taken = []

    def sink(choice) -> bool:
        taken.append((trio.current_time(), choice.ntok))
        choice.text, choice.ntok = "", 0
        return True

    config = sim_config(itl_ms=8.0, ttft_ms=20.0, prefill_us_per_token=0.0)
    paced = server.EngineConfig(engine_options=config.engine_options, stream_interval=0.02)
    async with open_fake_engine(paced) as (engine, _):
        first, woken = await _first_then_rest(engine, sink, 1 + 3 * 10)
    assert len(woken) == 1 and woken[0][0].finish_reason == "length"
    assert len(taken) >= 8 and all(n == 3 for _, n in taken), taken
    times = [t for t, _ in taken]
    assert all(b - a >= 0.02 - 1e-9 for a, b in zip(times, times[1:])), times
    assert first[0].num_tokens + 3 * len(taken) + woken[0][0].num_tokens == 31


@pytest.mark.direct_http
async def test_chunks_the_kernel_takes_in_part_go_out_whole_and_in_order(monkeypatch):
    """A socket buffer that takes only part of a chunk (the kernel's choice): the rest goes
    out first, from the request's task; the stream and the next response on the same
    connection are byte for byte those of a socket that takes everything."""
    from server.connections.connection import ServingConnection

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
    assert torn >= 1
    # the same answers (text, finish reason, usage), whole events each; not compared: where
    # the events split (real processes: that depends on the load)
    assert [_answer(b) for b in parts] == [_answer(b) for b in whole]
    for b in parts:
        assert b.endswith(b"data: [DONE]\n\n")
        assert all(raw == _what_the_task_writes(c) for raw, c in _text_events(b))
