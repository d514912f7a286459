"""Tests of the load generator (bench/loadgen.py, code in bench/loadgen_lib/): the sans-IO
parsers on byte strings split at every position, and the whole load generator against an
in-process stand-in server (trio, raw HTTP/1.1)."""

from __future__ import annotations

import json
import os
from functools import partial

import pytest
import trio

from bench.loadgen_lib.cli import build_parser, main, parse_args
from bench.loadgen_lib.client import Context
from bench.loadgen_lib.http11 import HTTPResponseParser, ProtocolError
from bench.loadgen_lib.openai_api import StreamTracker, error_message
from bench.loadgen_lib.procstat import pids_listening_on, server_pid_from_port
from bench.loadgen_lib.report import format_table
from bench.loadgen_lib.runner import run_benchmark
from bench.loadgen_lib.sse import SSEParser
from bench.loadgen_lib.stats import percentile, tokens_between
from bench.loadgen_lib.target import Target, api_path, check_loopback_url


# ---------------------------------------------------------------------------------------------
# helpers


def chunked(*pieces: bytes, ext: bool = False, trailers: bytes = b"") -> bytes:
    out = b""
    for i, p in enumerate(pieces):
        size = b"%x" % len(p)
        if ext and i % 2:
            size += b";name=value"
        out += size + b"\r\n" + p + b"\r\n"
    return out + b"0\r\n" + trailers + b"\r\n"


def splits(data: bytes):
    """Every way to cut ``data`` in two, then byte by byte."""
    for i in range(len(data) + 1):
        yield [data[:i], data[i:]]
    yield [data[i : i + 1] for i in range(len(data))]


def feed_all(parser: HTTPResponseParser, pieces, eof: bool = False) -> bytes:
    body = b"".join(parser.feed(p) for p in pieces)
    if eof:
        parser.feed_eof()
    return body


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\nx-empty:\r\n\r\n"
)


def completion_chunk(text: str, finish=None) -> bytes:
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def chat_chunk(delta: dict, finish=None) -> bytes:
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage_chunk(completion_tokens: int) -> bytes:
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens,
                                    "total_tokens": 3 + completion_tokens}}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def run_stream(wire_pieces, *, chat=False):
    """Feed wire bytes through HTTP parser -> SSE parser -> tracker; return them all."""
    parser = HTTPResponseParser(method="POST")
    sse = SSEParser()
    tracker = StreamTracker(chat=chat)
    for t, piece in enumerate(wire_pieces):
        body = parser.feed(piece)
        if body:
            for ev, data in sse.feed(body):
                tracker.on_event(ev, data, float(t))
    return parser, sse, tracker


# ---------------------------------------------------------------------------------------------
# HTTP/1.1 response parsing


def test_chunked_split_at_every_byte_boundary():
    body_pieces = [b"hello ", b"\xf0\x9f\x99\x82 world", b"x" * 300, b"\r\n\r\n", b"end"]
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n"
            + chunked(*body_pieces, ext=True, trailers=b"X-Trailer: yes\r\n"))
    expected = b"".join(body_pieces)
    for pieces in splits(wire + b"NEXT"):
        p = HTTPResponseParser()
        body = feed_all(p, pieces)
        assert body == expected, pieces
        assert p.done
        assert p.head.status == 200 and p.head.reason == "OK"
        assert p.head.get("x-a") == "1"
        assert p.keep_alive
        assert p.trailing == b"NEXT"


def test_content_length_split_everywhere_with_pipelined_bytes():
    wire = (b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
            b"Content-Length: 11\r\n\r\n{\"a\": \"b\"}" + b"\nHTTP/1.1 200")
    for pieces in splits(wire):
        p = HTTPResponseParser()
        assert feed_all(p, pieces) == b'{"a": "b"}\n'
        assert p.done and p.head.status == 404
        assert p.trailing == b"HTTP/1.1 200"


def test_body_until_close_and_connection_close():
    wire = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nsome body"
    for pieces in splits(wire):
        p = HTTPResponseParser()
        assert feed_all(p, pieces) == b"some body"
        assert not p.done
        p.feed_eof()
        assert p.done and not p.keep_alive


def test_interim_response_skipped_and_no_body_statuses():
    wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"
    for pieces in splits(wire):
        p = HTTPResponseParser()
        assert feed_all(p, pieces) == b""
        assert p.done and p.head.status == 204


def test_http10_is_not_keep_alive_and_bare_lf_tolerated():
    p = HTTPResponseParser()
    assert p.feed(b"HTTP/1.0 200 OK\nContent-Length: 2\n\nok") == b"ok"
    assert p.done and not p.keep_alive


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
        b"FTP 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
    ],
)
def test_protocol_errors(wire):
    with pytest.raises(ProtocolError):
        HTTPResponseParser().feed(wire)


@pytest.mark.parametrize(
    "wire",
    [
        b"",
        b"HTTP/1.1 200 OK\r\nContent-Le",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n",
    ],
)
def test_eof_before_the_end_is_an_error(wire):
    p = HTTPResponseParser()
    p.feed(wire)
    with pytest.raises(ProtocolError):
        p.feed_eof()
    assert not p.done


# ---------------------------------------------------------------------------------------------
# SSE


SSE_STREAM = (
    b": comment line\n"
    b"data: one\n\n"
    b"event: custom\r\ndata: two a\r\ndata:two b\r\n\r\n"
    b"id: 7\rretry: 100\rdata: three \xe5\xad\x97\xf0\x9f\x99\x82\r\r"
    b"data\n\n"
    b"data: [DONE]\n\n"
    b"data: incomplete at end"
)
SSE_EVENTS = [
    ("message", "one"),
    ("custom", "two a\ntwo b"),
    ("message", "three 字🙂"),
    ("message", ""),
    ("message", "[DONE]"),
]


def test_sse_split_at_every_position():
    for pieces in splits(SSE_STREAM):
        sse = SSEParser()
        events = [e for p in pieces for e in sse.feed(p)]
        assert events == SSE_EVENTS, pieces


def test_sse_through_chunked_encoding_split_everywhere():
    # the chunk boundaries fall in the middle of events, lines and a UTF-8 character
    cut = [SSE_STREAM[:5], SSE_STREAM[5:23], SSE_STREAM[23:58], SSE_STREAM[58:90],
           SSE_STREAM[90:]]
    assert b"".join(cut) == SSE_STREAM
    wire = SSE_HEAD + chunked(*cut)
    for pieces in splits(wire):
        p = HTTPResponseParser()
        sse = SSEParser()
        events = [e for piece in pieces for e in sse.feed(p.feed(piece))]
        assert events == SSE_EVENTS
        assert p.done


def test_sse_bom_is_stripped():
    sse = SSEParser()
    assert sse.feed(b"\xef\xbb") == []
    assert sse.feed(b"\xbfdata: x\n\n") == [("message", "x")]


# ---------------------------------------------------------------------------------------------
# OpenAI stream interpretation


def test_completion_stream_with_usage_and_done_split_everywhere():
    events = (completion_chunk(" Hello") + completion_chunk("") + completion_chunk(" wörld 🙂")
              + completion_chunk(" !", "length") + usage_chunk(5) + b"data: [DONE]\n\n")
    wire = SSE_HEAD + chunked(events[:40], events[40:41], events[41:200], events[200:])
    for pieces in splits(wire):
        parser, _, tr = run_stream(pieces)
        assert parser.done
        assert tr.done and tr.error is None
        assert tr.content_events == 3  # the empty-text chunk is not a content event
        assert tr.usage_tokens == 5 and tr.tokens == 5
        assert tr.first is not None and len(tr.gaps) == 2
        assert all(g >= 0 for g in tr.gaps)


def test_gaps_and_first_token_times():
    tr = StreamTracker(chat=False)
    tr.on_event("message", completion_chunk("")[6:-2].decode(), 1.0)
    for t in (2.0, 2.5, 4.0):
        tr.on_event("message", completion_chunk(" x")[6:-2].decode(), t)
    assert tr.first == 2.0
    assert tr.gaps == [0.5, 1.5]
    assert tr.tokens == 3  # no usage chunk: one per content event
    assert not tr.done


def test_chat_stream_role_chunk_is_not_content():
    events = (chat_chunk({"role": "assistant", "content": ""}) + chat_chunk({"content": "Hi"})
              + chat_chunk({"content": " there"}) + chat_chunk({}, "stop") + b"data: [DONE]\n\n")
    _, _, tr = run_stream([SSE_HEAD + chunked(events)], chat=True)
    assert tr.done and tr.content_events == 2 and tr.usage_tokens is None and tr.tokens == 2


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"error": {"message": "engine blew up", "type": "engine_error"}}\n\n',
        b'event: error\ndata: {"error": {"message": "engine blew up"}}\n\n',
        b"event: error\ndata: engine blew up\n\n",
    ],
)
def test_error_event(event):
    wire = SSE_HEAD + chunked(completion_chunk(" a") + event + b"data: [DONE]\n\n")
    for pieces in splits(wire):
        _, _, tr = run_stream(pieces)
        assert tr.error == "engine blew up"
        assert tr.done and tr.content_events == 1


def test_stream_without_done():
    _, _, tr = run_stream([SSE_HEAD + chunked(completion_chunk(" a"))])
    assert not tr.done and tr.content_events == 1 and tr.error is None


def test_non_200_json_body_split_everywhere():
    body = json.dumps({"error": {"message": "max_tokens is too large", "type":
                                 "invalid_request_error", "param": "max_tokens", "code": None}})
    wire = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body.encode())
    for pieces in splits(wire):
        p = HTTPResponseParser(method="POST")
        got = feed_all(p, pieces)
        assert p.done and p.head.status == 400
        assert error_message(got) == "max_tokens is too large"
    assert error_message(b"<html>oops</html>") == "<html>oops</html>"


# ---------------------------------------------------------------------------------------------
# small pure helpers


def test_percentile_nearest_rank():
    pct = percentile
    assert pct([], 50) is None
    assert pct([7], 99) == 7
    values = list(range(1, 101))  # 1..100
    assert pct(values, 50) == 50 and pct(values, 99) == 99 and pct(values, 100) == 100
    assert pct(values, 0) == 1 and pct(values, 0.5) == 1 and pct(values, 99.5) == 100
    assert pct([1, 2, 3, 4], 50) == 2 and pct([1, 2, 3, 4], 51) == 3


def test_tokens_between_counts_events_inside_the_window():
    # two streams: events at 1, 2, 3, 4 (2 tokens each) and at 2.5, 2.5, 5 (1 token each)
    streams = [(1.0, [1.0, 1.0, 1.0], 2.0), (2.5, [0.0, 2.5], 1.0)]
    assert tokens_between(streams, 0.0, 10.0) == 8 + 3
    assert tokens_between(streams, 2.0, 4.0) == 2 * 2 + 2  # [2, 4): 2 and 3; 2.5 twice
    assert tokens_between(streams, 4.0, 5.0) == 2  # 5 is past the end
    assert tokens_between(streams, 5.0, 6.0) == 1
    assert tokens_between([], 0.0, 1.0) == 0


def test_loopback_only():
    assert check_loopback_url("http://127.0.0.1:8000") == (
        "127.0.0.1", 8000, "", "127.0.0.1:8000")
    assert check_loopback_url("http://localhost:9/v1/")[:3] == ("localhost", 9, "/v1")
    assert check_loopback_url("http://[::1]:5")[3] == "[::1]:5"
    for url in ("http://example.com:8000", "http://10.0.0.1", "https://127.0.0.1",
                "http://0.0.0.0:80", "http://127.0.0.1.example.com"):
        with pytest.raises(ValueError):
            check_loopback_url(url)
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://192.168.1.1:8000"])
    assert api_path("", "completions") == "/v1/completions"
    assert api_path("/v1", "models") == "/v1/models"


def test_request_bytes_and_prompt():
    args = parse_args(["--prompt-tokens", "7", "--max-tokens", "3", "--no-include-usage",
                               "--endpoint", "chat", "--api-key", "k"])
    target = Target("http://127.0.0.1:8123")
    ctx = Context(args, target, "mymodel")
    req = ctx.request_bytes(42)
    head, _, body = req.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8123\r\n")
    assert b"\r\nContent-Length: %d\r\n" % len(body) in head + b"\r\n"
    assert b"Authorization: Bearer k" in head
    obj = json.loads(body)
    assert obj["model"] == "mymodel" and obj["max_tokens"] == 3 and obj["stream"] is True
    assert "stream_options" not in obj
    words = obj["messages"][0]["content"].split()
    assert len(words) == 7 and words[0] == "r42"


# ---------------------------------------------------------------------------------------------
# end to end against an in-process stand-in server


class StandIn:
    """A raw HTTP/1.1 server speaking just enough OpenAI streaming. ``mode`` picks a fault
    for every third request: "ok", "mixed" (400 / no [DONE] / error event), "close" (closes
    the connection after each response without saying so), "http10" (close-delimited)."""

    def __init__(self, mode: str = "ok", tokens_per_event: int = 1) -> None:
        self.mode = mode
        self.tokens_per_event = tokens_per_event
        self.requests = 0
        self.connections = 0
        self.port = 0
        # per request, by ticket (the prompt's first word, "r<ticket>"): trio clock times
        self.arrivals: dict[int, float] = {}
        self.ends: dict[int, float] = {}

    async def handle(self, stream) -> None:
        self.connections += 1
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].split(b" ")
                headers = {k.strip().lower(): v.strip()
                           for k, v in (ln.split(b":", 1) for ln in lines[1:])}
                n = int(headers.get(b"content-length", b"0"))
                while len(buf) < n:
                    buf += await stream.receive_some(65536)
                body, buf = buf[:n], buf[n:]
                keep = await self.respond(stream, method, path, body)
                if not keep:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await stream.aclose()

    async def respond(self, stream, method, path, body) -> bool:
        if path == b"/v1/models":
            data = b'{"object":"list","data":[{"id":"standin-model","object":"model"}]}'
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                  b"content-length: %d\r\n\r\n" % len(data) + data)
            return True
        self.requests += 1
        k = self.requests
        req = json.loads(body)
        chat = path.endswith(b"/chat/completions")
        prompt = req["messages"][0]["content"] if chat else req["prompt"]
        ticket = int(prompt.split()[0][1:])
        self.arrivals[ticket] = trio.current_time()
        fault = self.mode == "mixed" and k % 3 == 0
        kind = (k // 3) % 3 if fault else None
        if kind == 0:
            data = b'{"error":{"message":"standin says no","type":"invalid_request_error"}}'
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json"
                                  b"\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
            return True
        http10 = self.mode == "http10"
        if http10:
            await stream.send_all(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
            wrap = lambda b: b  # noqa: E731
        else:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                  b"transfer-encoding: chunked\r\n\r\n")
            wrap = lambda b: b"%x\r\n" % len(b) + b + b"\r\n"  # noqa: E731
        n = req["max_tokens"]
        if chat:
            await stream.send_all(wrap(chat_chunk({"role": "assistant", "content": ""})))
        sent = 0
        while sent < n:
            await trio.sleep(0.001)
            m = min(self.tokens_per_event, n - sent)
            text = " tok" * m
            sent += m
            finish = "length" if sent == n else None
            ev = chat_chunk({"content": text}, finish) if chat else completion_chunk(text, finish)
            await stream.send_all(wrap(ev))
            if kind == 2 and sent >= 2:
                await stream.send_all(wrap(
                    b'data: {"error":{"message":"engine failed","type":"engine_error"}}\n\n'))
                break
        tail = b""
        if (req.get("stream_options") or {}).get("include_usage"):
            tail += usage_chunk(sent)
        if kind != 1:
            tail += b"data: [DONE]\n\n"
        if tail:
            await stream.send_all(wrap(tail))
        self.ends[ticket] = trio.current_time()
        if http10:
            return False
        await stream.send_all(b"0\r\n\r\n")
        return self.mode != "close"


async def start_standin(nursery, standin: StandIn) -> StandIn:
    listeners = await nursery.start(partial(trio.serve_tcp, standin.handle, 0, host="127.0.0.1"))
    standin.port = listeners[0].socket.getsockname()[1]
    return standin


def bench_args(port: int, *extra: str):
    return parse_args(["--url", f"http://127.0.0.1:{port}", "--quiet", *extra])


async def test_end_to_end_consistent_summary(nursery):
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "--concurrency", "4", "--requests", "12", "--max-tokens", "5",
                      "--prompt-tokens", "16", "--itl-ms", "2", "--pid", str(os.getpid()))
    s = await run_benchmark(args)
    assert s["model"] == "standin-model"
    assert srv.requests == 12
    assert s["requests"] == 12 and s["errors"] == 0 and s["incomplete_streams"] == 0
    assert s["delivered_tokens"] == 60 and s["content_events"] == 60
    assert s["tokens_per_event"] == 1.0
    assert s["http_statuses"] == {"200": 12}
    # rates are computed from the unrounded duration; duration_s is rounded to 1 ms
    assert 60 / s["delivered_tokens_per_s"] == pytest.approx(s["duration_s"], abs=2e-3)
    assert 60 / s["events_per_s"] == pytest.approx(s["duration_s"], abs=2e-3)
    assert 12 / s["requests_per_s"] == pytest.approx(s["duration_s"], abs=2e-3)
    assert s["offered_tokens_per_s"] == 2000.0
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_p99_ms"] <= s["ttft_max_ms"]
    assert 0 <= s["gap_p50_ms"] <= s["gap_p99_ms"] <= s["gap_max_ms"]
    assert s["ttft_p99_ms"] < s["duration_s"] * 1000
    # keep-alive: one connection per client, reused
    # + 1 preflight connection and 1 for GET /v1/models
    assert s["connections_opened"] == 4 and srv.connections == 4 + 2
    # CPU of this very process (the stand-in runs in it), no workers (none that the run
    # started: a session-scoped server, tests/conftest.py's vllm_server, may be a child)
    assert s["frontend_pid"] == os.getpid()
    assert s["frontend_cpu_s"] >= 0 and s["frontend_cpu_us_per_token"] >= 0
    assert [w for w in s["workers"] if w["new"]] == []
    json.dumps(s)  # JSON-able
    assert "requests" in format_table(s)


async def test_end_to_end_errors_and_incomplete_streams(nursery):
    srv = await start_standin(nursery, StandIn(mode="mixed"))
    args = bench_args(srv.port, "-c", "3", "-n", "18", "--max-tokens", "4",
                      "--model", "given")
    s = await run_benchmark(args)
    # requests 3,6,...,18 are faulty: kind (k//3)%3 -> 400, no [DONE], error event
    # k=3:1(no DONE) 6:2(error) 9:0(400) 12:1 15:2 18:0
    assert s["model"] == "given"
    assert s["requests"] == 18
    assert s["http_statuses"] == {"200": 16, "400": 2}
    assert s["incomplete_streams"] == 2
    assert s["errors"] == 4  # 2 x HTTP 400 + 2 x error event
    assert s["error_kinds"] == {"http_400": 2, "error_event": 2}
    assert any("standin says no" in e for e in s["error_samples"])
    assert any("engine failed" in e for e in s["error_samples"])
    # 12 full streams x 4 tokens + 2 without [DONE] x 4 + 2 cut by the error after 2
    assert s["delivered_tokens"] == 12 * 4 + 2 * 4 + 2 * 2
    assert s["connections_opened"] == 3


async def test_end_to_end_chat_multi_token_events_without_usage(nursery):
    srv = await start_standin(nursery, StandIn(tokens_per_event=2))
    args = bench_args(srv.port, "--endpoint", "chat", "-c", "2", "-n", "4", "--max-tokens", "6",
                      "--no-include-usage")
    s = await run_benchmark(args)
    assert s["errors"] == 0 and s["incomplete_streams"] == 0
    assert s["content_events"] == 12
    # without a usage chunk tokens are counted per event (3 per request here)
    assert s["delivered_tokens"] == 12 and s["tokens_per_event"] == 1.0


async def test_end_to_end_with_usage_counts_multi_token_events(nursery):
    srv = await start_standin(nursery, StandIn(tokens_per_event=3))
    args = bench_args(srv.port, "-c", "2", "-n", "4", "--max-tokens", "6")
    s = await run_benchmark(args)
    assert s["delivered_tokens"] == 24 and s["content_events"] == 8
    assert s["tokens_per_event"] == 3.0


@pytest.mark.parametrize("mode", ["close", "http10"])
async def test_end_to_end_connection_not_reused(nursery, mode):
    srv = await start_standin(nursery, StandIn(mode=mode))
    args = bench_args(srv.port, "-c", "2", "-n", "6", "--max-tokens", "3", "--model", "m")
    s = await run_benchmark(args)
    assert s["errors"] == 0 and s["incomplete_streams"] == 0 and s["delivered_tokens"] == 18
    assert srv.requests == 6 and s["connections_opened"] >= 6


async def test_duration_mode_and_warmup(nursery, autojump_clock, monkeypatch):
    # virtual time: the window's bounds below hold however busy the cores are
    virtual_measurements(monkeypatch)
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "-c", "2", "--duration", "0.2", "--warmup", "0.1",
                      "--max-tokens", "3", "--model", "m")
    s = await run_benchmark(args)
    assert s["errors"] == 0 and s["requests"] >= 2
    assert srv.requests > s["requests"]  # the warmup requests are not counted
    assert 0.2 <= s["duration_s"] < 1.0


async def test_steady_state_rate_is_not_biased_by_the_last_requests(nursery):
    # Requests of ~40 events (1 ms apart, so ~45+ ms) over a 0.3 s window: tokens of the
    # requests started in the window, divided by the window up to the last one's end, read
    # low; the steady rate matches what the stand-in itself sent per second.
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "-c", "3", "--warmup", "0.1", "--duration", "0.3",
                      "--max-tokens", "40", "--ramp-up", "0.03", "--model", "m")
    s = await run_benchmark(args)
    assert s["errors"] == 0
    lengths = [srv.ends[k] - srv.arrivals[k] for k in srv.ends]
    served = 3 * 40 / (sum(lengths) / len(lengths))  # tokens/s with all 3 clients busy
    assert s["steady_tokens_per_s"] == pytest.approx(served, rel=0.25)
    assert s["steady_tokens_per_s"] > s["delivered_tokens_per_s"]
    assert s["steady_efficiency"] == pytest.approx(
        s["steady_tokens_per_s"] / s["offered_tokens_per_s"], abs=1e-3)
    assert "steady-state tokens/s" in format_table(s)


def test_ramp_up_and_warmup_options():
    a = parse_args(["--max-tokens", "256"])  # auto: one request's nominal length, 256 * 8 ms
    assert a.ramp_up == pytest.approx(2.048) and a.warmup == 0.0 and a.requests == 256
    a = parse_args(["--max-tokens", "100", "--itl-ms", "2", "--duration", "10"])
    assert a.ramp_up == pytest.approx(0.2) and a.warmup == pytest.approx(0.2)  # = the ramp-up
    a = parse_args(["--ramp-up", "0", "--duration", "10"])
    assert a.ramp_up == 0.0 and a.warmup == 0.0
    a = parse_args(["--ramp-up", "1.5", "--warmup", "3", "-d", "10"])
    assert a.ramp_up == 1.5 and a.warmup == 3.0
    for bad in (["--ramp-up", "-1"], ["--ramp-up", "soon"], ["--ramp-up", "nan"],
                ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--ramp-up" in build_parser().format_help()


def first_arrival_per_connection(srv: StandIn, n: int) -> list[float]:
    return sorted(srv.arrivals.values())[:n]


# The schedule tests run in virtual time (autojump_clock): the stand-in and the load
# generator share this test's Trio clock over real loopback sockets, so when a request is
# sent is the schedule's doing, whatever the machine's load.


async def test_ramp_up_spreads_the_first_requests(nursery, autojump_clock):
    # 4 clients over 0.2 s: first requests at +0, +0.05, +0.1, +0.15 s; each request lasts
    # longer than the ramp-up (>= 250 x 1 ms), so every client sends exactly one
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "-c", "4", "-n", "4", "--max-tokens", "250", "--model", "m",
                      "--ramp-up", "0.2")
    s = await run_benchmark(args)
    assert s["requests"] == 4 and s["errors"] == 0 and s["ramp_up_s"] == 0.2
    t = [srv.arrivals[k] for k in sorted(srv.arrivals)]
    assert t == sorted(t)  # client i sends ticket i + 1
    offsets = [x - t[0] for x in t]
    assert offsets == [pytest.approx(0.05 * i, abs=0.002) for i in range(4)], offsets
    assert s["connections_opened"] == 4


async def test_ramp_up_zero_starts_all_clients_at_once(nursery, autojump_clock):
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "-c", "4", "-n", "4", "--max-tokens", "30", "--model", "m",
                      "--ramp-up", "0")
    s = await run_benchmark(args)
    assert s["requests"] == 4 and s["ramp_up_s"] == 0.0
    t = sorted(srv.arrivals.values())
    assert t[-1] - t[0] == pytest.approx(0, abs=0.002)


async def test_burst_is_one_wave_measured_against_the_ideal(nursery, autojump_clock):
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "-c", "5", "--burst", "--max-tokens", "30", "--itl-ms", "1",
                      "--model", "m", "--pid", str(os.getpid()))
    s = await run_benchmark(args)
    assert srv.requests == s["requests"] == 5 and s["errors"] == 0  # one request per client
    t = sorted(srv.arrivals.values())
    assert t[-1] - t[0] == pytest.approx(0, abs=0.002)  # all at once
    assert s["burst_ideal_s"] == pytest.approx(0.030)
    # (duration_s is rounded to the ms, and is wall time: short here, the stand-in's token
    # delays being virtual; the ratio is computed before rounding)
    assert s["burst_wall_over_ideal"] * 0.030 == pytest.approx(s["duration_s"], abs=0.0006)
    assert s["frontend_cpu_us_per_request"] >= 0  # (10 ms ticks: a short run may read 0)
    assert "burst wall / ideal" in format_table(s)
    for clash in (["-n", "5"], ["-d", "1"], ["--ramp-up", "0"], ["--warmup", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--burst", *clash])


def virtual_measurements(monkeypatch) -> None:
    """The load generator measures with ``time.perf_counter``: on the test's Trio clock
    instead, its figures and the stand-in's times are in one (virtual) time."""
    from bench.loadgen_lib import client, reactor

    monkeypatch.setattr(client, "_perf", trio.current_time)
    monkeypatch.setattr(reactor, "_perf", trio.current_time)


async def test_seamless_warmup_counts_only_requests_started_after_it(
    nursery, autojump_clock, monkeypatch
):
    # 3 clients spread over 30 ms, requests of ~25-40 ms: 0.15 s of warmup, then 0.2 s
    # measured, no pause between them. In virtual time: on busy cores the requests would
    # take longer than the window.
    virtual_measurements(monkeypatch)
    warmup, duration = 0.15, 0.2
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "-c", "3", "--warmup", str(warmup), "--duration",
                      str(duration), "--max-tokens", "20", "--ramp-up", "0.03", "--model", "m")
    s = await run_benchmark(args)
    w, n = s["warmup_requests"], s["requests"]
    assert s["errors"] == 0 and s["warmup_s"] == warmup and w >= 3 and n >= 6
    # every request was counted once, as warmup or measured, and none was left unfinished
    assert srv.requests == w + n == len(srv.ends)
    assert sorted(srv.arrivals) == list(range(1, w + n + 1))
    # tickets are handed out in order: 1..w are the warmup, w+1..w+n the measured requests
    t0 = min(srv.arrivals.values())  # ~ the start of the run (client 0's first request)
    warm_t = [srv.arrivals[k] for k in range(1, w + 1)]
    meas_t = [srv.arrivals[k] for k in range(w + 1, w + n + 1)]
    assert max(warm_t) < t0 + warmup + 0.02
    assert min(meas_t) >= t0 + warmup - 0.005
    assert max(meas_t) < t0 + warmup + duration + 0.02
    # seamless: the clients did not wait for the warmup requests to finish
    assert max(srv.ends[k] for k in range(1, w + 1)) > min(meas_t)
    # the window runs from the end of the warmup to the end of the last measured request
    last_end = max(srv.ends.values())
    assert duration <= s["duration_s"] <= last_end - (t0 + warmup) + 0.02
    assert s["delivered_tokens"] == 20 * n


async def test_seamless_warmup_with_a_request_count(nursery):
    srv = await start_standin(nursery, StandIn())
    args = bench_args(srv.port, "-c", "3", "--warmup", "0.1", "-n", "7", "--max-tokens", "20",
                      "--ramp-up", "0.03", "--model", "m")
    s = await run_benchmark(args)
    w = s["warmup_requests"]
    assert s["requests"] == 7 and w >= 3
    # the clients stopped once the 7 measured requests were issued
    assert srv.requests == w + 7 == len(srv.ends)
    assert s["delivered_tokens"] == 7 * 20


async def test_connection_refused_is_fatal():
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        with pytest.raises(ConnectionError):
            await run_benchmark(bench_args(port, "-n", "1", "--model", "m"))


async def test_server_found_by_port(nursery):
    srv = await start_standin(nursery, StandIn())
    assert os.getpid() in pids_listening_on(srv.port)
    assert server_pid_from_port(srv.port) == os.getpid()


class StallingStandIn(StandIn):
    """Sends the head and one event, then goes quiet."""

    async def respond(self, stream, method, path, body) -> bool:
        if path == b"/v1/models":
            return await super().respond(stream, method, path, body)
        self.requests += 1
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n")
        ev = completion_chunk(" a")
        await stream.send_all(b"%x\r\n" % len(ev) + ev + b"\r\n")
        await trio.sleep_forever()


async def test_request_timeout(nursery):
    srv = await start_standin(nursery, StallingStandIn())
    args = bench_args(srv.port, "-c", "2", "-n", "3", "--model", "m", "--request-timeout", "0.1",
                      "--ramp-up", "0")
    s = await run_benchmark(args)
    assert s["requests"] == 3 and s["errors"] == 3 and s["incomplete_streams"] == 3
    assert s["error_kinds"] == {"timeout": 3}
    assert s["content_events"] == 3 and s["ttft_p50_ms"] is not None
    assert s["connections_opened"] == 3  # a timed-out connection is not reused


async def test_time_limit_aborts(nursery, autojump_clock, monkeypatch):
    # virtual time: the window's bounds below hold however busy the cores are
    virtual_measurements(monkeypatch)
    srv = await start_standin(nursery, StallingStandIn())
    args = bench_args(srv.port, "-c", "2", "-n", "3", "--model", "m", "--time-limit", "0.2")
    with trio.fail_after(3):
        s = await run_benchmark(args)
    assert "time limit" in s["aborted"]
    assert s["requests"] == 0 and 0.2 <= s["duration_s"] < 1.0


STDLIB_SERVER = r'''
import argparse, json, signal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Ctrl-C ends it even when it inherited SIGINT ignored (as a child of a process that ignores it).
signal.signal(signal.SIGINT, signal.default_int_handler)

p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--tokens", type=int)
args = p.parse_args()

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _json(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        self._json({"data": [{"id": "stdlib-model"}]} if self.path == "/v1/models" else {})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200); self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked"); self.end_headers()
        def send(b):
            self.wfile.write(b"%x\r\n" % len(b) + b + b"\r\n"); self.wfile.flush()
        n = min(req["max_tokens"], args.tokens)
        for i in range(n):
            send(b'data: {"choices":[{"index":0,"text":" w"}]}\n\n')
        send(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % n)
        self.wfile.write(b"0\r\n\r\n"); self.wfile.flush()

try:
    ThreadingHTTPServer((args.host, args.port), H).serve_forever()
except KeyboardInterrupt:
    pass
'''


def test_cli_spawn_server(tmp_path, monkeypatch, capsys):
    (tmp_path / "stdlib_standin.py").write_text(STDLIB_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out_json = tmp_path / "out.json"
    code = main(["--spawn-server", "--tokens 3", "--server-module", "stdlib_standin",
                         "-c", "2", "-n", "4", "--max-tokens", "5", "--quiet",
                         "--json-out", str(out_json), "--health-timeout", "10"])
    out, err = capsys.readouterr()
    assert code == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert last == json.loads(out_json.read_text())
    assert last["model"] == "stdlib-model"
    assert last["requests"] == 4 and last["errors"] == 0 and last["incomplete_streams"] == 0
    assert last["delivered_tokens"] == 12  # the stand-in stops at 3 tokens
    assert last["frontend_cpu_s"] is not None and last["frontend_cpu_us_per_token"] is not None
    assert "server stopped (exit status 0)" in err


def test_cli_refuses_remote_hosts(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://203.0.113.7:8000"])
    assert exc.value.code == 2
    assert "only loopback" in capsys.readouterr().err


def test_server_ttft_reads_first_token_times_of_successful_requests(tmp_path):
    from bench.server_ttft import first_token_times

    log = tmp_path / "server.log"
    lines = [json.dumps({"status": 200, "first_token_ms": t}) for t in (24.0, 26.0, 25.0)]
    lines += [
        "2026-11-30 INFO server: serving on http://127.0.0.1:8000",  # not JSON
        json.dumps({"status": 400, "first_token_ms": None}),
        json.dumps({"status": 200, "first_token_ms": None}),  # no first token (aborted early)
        json.dumps({"status": 503, "first_token_ms": 1.0}),
    ]
    log.write_text("\n".join(lines) + "\n")
    times = sorted(first_token_times(str(log)))
    assert times == [24.0, 25.0, 26.0]
    assert percentile(times, 50) == 25.0 and percentile(times, 90) == 26.0


# ---------------------------------------------------------------------------------------------
# The tracker against the server's own streams (in-memory engine, virtual time)

@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
async def test_tracker_reads_the_servers_own_streams(autojump_clock, endpoint):
    import server
    from bench.loadgen_lib.openai_api import BodyMaker
    from server.testing import open_in_memory_engine
    from server.testing.asgi import open_asgi_client

    maker = BodyMaker(chat=endpoint == "chat", responses=endpoint == "responses", model="sim",
                      prompt_tokens=8, max_tokens=6, include_usage=True)
    path = {"chat": "/v1/chat/completions"}.get(endpoint, f"/v1/{endpoint}")
    async with open_in_memory_engine(itl_ms=10) as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            r = await client.post(path, json=json.loads(maker.body(7)))
    assert r.status == 200, r.body
    sse = SSEParser()
    tracker = StreamTracker(chat=endpoint == "chat", responses=endpoint == "responses")
    for t, data in r.chunks:
        for ev, d in sse.feed(data):
            tracker.on_event(ev, d, t)
    assert tracker.error is None and tracker.done
    assert tracker.usage_tokens == 6 and tracker.content_events == 6
    assert len(tracker.gaps) == 5 and tracker.first is not None
