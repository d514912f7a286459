"""Tests of bench/isolation.py's parts (bench/loadgen_lib/isolation*.py): the gap arithmetic on
plain lists of times, the heavy requests' bodies, and, against a real server with a sim
worker, the heavy request's sender and the detection of a worker's restart. No timing is
asserted: the figures are the benchmark's."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import trio

from bench.loadgen_lib.http11 import build_request
from bench.loadgen_lib.isolation import (HEAVY_KINDS, HeavyRequest, baseline_reference,
                                         gap_summary, heavy_request, largest_gap,
                                         stream_points, window_gaps, windows_max_gaps,
                                         worker_restarts)
from bench.loadgen_lib.isolation_run import WorkerWatch, send_heavy
from bench.loadgen_lib.openai_api import StreamTracker
from bench.loadgen_lib.sse import SSEParser
from bench.loadgen_lib.target import Target, simple_get


def test_stream_points_rebuild_the_event_times_and_add_a_silent_end():
    assert stream_points(None, [], 5.0) == []
    assert stream_points(1.0, [0.5, 0.25], None) == [1.0, 1.5, 1.75]
    assert stream_points(1.0, [0.5, 0.25], 4.0) == [1.0, 1.5, 1.75, 4.0]
    assert stream_points(1.0, [0.5], 1.2) == [1.0, 1.5]  # an end before the last event


def test_window_gaps_counts_every_gap_that_overlaps_the_window():
    streams = [[0.0, 1.0, 5.0, 6.0], [0.0, 10.0], [7.0, 7.5]]
    # the stall from 1 to 5 overlaps [2, 3] in full; so does the second stream's 0..10
    assert sorted(window_gaps(streams, 2.0, 3.0)) == [4.0, 10.0]
    # a gap that ends exactly where the window starts, or starts where it ends, does not
    assert window_gaps([[0.0, 1.0, 2.0]], 1.0, 1.0) == []
    assert sorted(window_gaps(streams, 5.5, 7.2)) == [0.5, 1.0, 10.0]
    assert window_gaps(streams, 20.0, 30.0) == []


def test_largest_gap_says_where_it_lies():
    streams = [[0.0, 1.0, 5.0, 6.0], [7.0, 7.5]]
    assert largest_gap(streams, 2.0, 3.0) == (1.0, 5.0)
    assert largest_gap(streams, 5.5, 7.2) == (5.0, 6.0)
    assert largest_gap(streams, 20.0, 30.0) is None


def test_windows_max_gaps_tiles_the_phase_from_its_end():
    streams = [[0.0, 1.0, 2.0, 3.0, 6.0, 7.0, 8.0]]
    # windows [6, 8], [4, 6], [2, 4]; [0, 2] too; a partial window at the start is left out
    assert windows_max_gaps(streams, 0.0, 8.0, 2.0) == [1.0, 3.0, 3.0, 1.0]
    assert windows_max_gaps(streams, 0.5, 8.0, 2.0) == [1.0, 3.0, 3.0]
    assert windows_max_gaps([[0.0, 1.0]], 5.0, 9.0, 2.0) == []


def test_a_phase_is_compared_with_baseline_windows_of_its_own_length():
    # a baseline [0, 12] with one slow stretch (4 s, from 5 to 9) and gaps of 1 s elsewhere
    streams = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0, 10.0, 11.0, 12.0]]
    # 3 s windows [9, 12], [6, 9], [3, 6], [0, 3]: largest 1, 4, 4, 1; median 2.5
    assert baseline_reference(streams, 0.0, 12.0, 3.0) == (2.5, 4)
    # as long as the baseline: its largest gap; longer: the same, one window
    assert baseline_reference(streams, 0.0, 12.0, 12.0) == (4.0, 1)
    assert baseline_reference(streams, 0.0, 12.0, 70.0) == (4.0, 1)
    assert baseline_reference(streams, 20.0, 30.0, 3.0) is None


def test_gap_summary_in_milliseconds():
    assert gap_summary([]) == {"gaps": 0, "max_gap_ms": None, "p99_gap_ms": None}
    gaps = [0.001 * i for i in range(1, 201)]
    s = gap_summary(gaps)
    assert s["gaps"] == 200 and s["max_gap_ms"] == 200.0 and s["p99_gap_ms"] == 198.0


def test_heavy_requests_are_the_sizes_the_issue_names():
    sizes = {}
    for kind in HEAVY_KINDS:
        heavy = heavy_request(kind, "m")
        body = json.loads(heavy.body)
        assert body["model"] == "m"
        sizes[kind] = (len(heavy.body), body)
    assert len(sizes["schema"][1]["response_format"]["json_schema"]["schema"]["properties"]) == 2000
    assert 3_500_000 <= sizes["tokenize"][0] < 3_600_000
    assert len(json.loads(heavy_request("tokenize", "m", 1000).body)["prompt"]) == 1000
    assert len(sizes["tokenize"][1]["prompt"].split()) == 1
    assert len(sizes["token-ids"][1]["prompt"]) == 1_900_000
    assert 3_800_000 <= sizes["token-ids"][0] < 3_900_000
    logprobs = sizes["logprobs"][1]
    assert (logprobs["n"], logprobs["max_tokens"], logprobs["logprobs"]) == (16, 900, 20)
    enum = sizes["schema-enum"][1]["response_format"]["json_schema"]["schema"]
    assert len(enum["properties"]["v"]["enum"]) == 100_000
    depth, node = 0, sizes["schema-deep"][1]["response_format"]["json_schema"]["schema"]
    while node.get("type") == "object":
        depth, node = depth + 1, node["properties"]["a"]
    assert depth == 300


def test_worker_restarts_reads_the_counter_or_says_it_is_absent():
    assert worker_restarts(b"# nothing here\n") is None


async def _send(url: str, heavy: HeavyRequest) -> dict:
    target = Target(url)
    req = build_request("POST", heavy.path, target.host_header, heavy.body,
                        (("Content-Type", "application/json"), ("Connection", "close")))
    return await send_heavy(target, heavy, req, timeout=30.0)


async def test_send_heavy_reads_an_answer_and_a_refusal(server_url):
    body = {"model": "sim", "prompt": "hello", "max_tokens": 5}
    ok = await _send(server_url, HeavyRequest("c", "/v1/completions",
                                              json.dumps(body).encode(), "small"))
    assert ok["status"] == 200 and ok["error"] is None and not ok["timed_out"]
    assert ok["completion_tokens"] == 5 and ok["response_bytes"] > 0
    refused = await _send(server_url, HeavyRequest("t", "/tokenize",
                                                   b'{"prompt": "hello"}', "small"))
    assert refused["status"] == 400 and "sim engine" in refused["error"]


async def test_a_crashed_worker_shows_as_a_restart_and_a_worker_died_event(fault_server_url):
    url = fault_server_url
    watch = WorkerWatch(Target(url), os.getpid())  # the server runs in this process
    before = await watch.snapshot()
    assert before["pids"] and before["restarts"] == 0
    assert WorkerWatch.compare(before, before)["restarted"] is False
    body = {"prompt": "p", "max_tokens": 50, "stream": True,
            "fault": {"kind": "crash", "after": 3}}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            raw = b"".join([part async for part in r.aiter_raw()])
    tracker = StreamTracker(chat=False)
    for event, data in SSEParser().feed(raw):
        tracker.on_event(event, data, 0.0)
    assert tracker.error_code == "worker_died"
    with trio.fail_after(30):
        while (await simple_get(Target(url), "/health"))[0] != 200:
            await trio.sleep(0.05)
        while (after := await watch.snapshot())["restarts"] != 1:
            await trio.sleep(0.05)
    seen = WorkerWatch.compare(before, after)
    assert seen["restarted"] and seen["worker_restarts"] == 1
    assert seen["lost_pids"] == sorted(before["pids"] - after["pids"]) != []


def test_the_benchmarks_tiny_model_has_only_whole_ascii_tokens():
    # bench/isolation.py reads gaps between events: a token that decodes to part of a
    # character would be held back by the detokenizer and read as a gap (tests/tiny_model.py).
    pytest.importorskip("tokenizers")
    from tests.tiny_model import SPECIAL_TOKENS, _train_tokenizer

    for ascii_only in (True, False):
        tok = _train_tokenizer(1000, 0, ascii_only)
        texts = [tok.decode([i]) for t, i in tok.get_vocab().items() if t not in SPECIAL_TOKENS]
        partial = [t for t in texts if not t or "\ufffd" in t or not t.isascii()]
        if ascii_only:
            assert tok.get_vocab_size() == 1000 and partial == []
        else:  # the default tokenizer, for contrast: most of its tokens are not whole ASCII
            assert len(partial) > len(texts) / 2
