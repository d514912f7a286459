"""The request stream's guarantees, end to end: HTTP in front of real sim worker processes.

Each guarantee here also has a virtual-time test (tests/test_stream_fake.py); these show it
through the whole server, where a client disconnects, a request times out, and a worker
ignores aborts. Every frame on a worker's pipes is recorded (tests/fakes.py
``RecordingSpawner``), so aborts are counted where the worker sees them.

1. Exactly one abort per unfinished choice, none for a finished one, also when the server
   aborted first (a request timeout) and the client goes away during the drain.
2. The drain deadline: a worker that ignores the abort is cut off at the deadline; the
   manager holds nothing and the server serves on.
3. Several choices, one ending long before the others (a stop string): every choice
   arrives in full, streamed and not, completions and chat.

docs/testing.md ("Mutations the suite catches") lists the mutations of server/manager that
these tests fail under. Bounds are hang guards only (generous: the machine is shared).
"""

from __future__ import annotations

import functools
import json
from contextlib import aclosing, asynccontextmanager

import httpx
import trio

import server
from server.config import EngineConfig, Limits, ServerConfig
from server.http.app import create_app
from server.http.serve import serve
from server.testing import open_asgi_client
from tests.fakes import RecordingSpawner

FAST = {"itl_ms": 2.0, "ttft_ms": 5.0, "prefill_us_per_token": 0.0, "faults": True,
        "max_model_len": 1 << 20}
#: Tokens of a request that must be aborted, not run to its end: 60 s at 2 ms a token,
#: longer than any hang guard below.
ENDLESS = 30_000
GUARD = 30  # seconds a step that is immediate when all is well may take (2 busy cores)
TEST_LIMIT = 240


# -- the server -------------------------------------------------------------------------------


@asynccontextmanager
async def open_recorded_server(drain_timeout: float, **server_options):
    """hypercorn on 127.0.0.1 port 0 in front of one real sim worker whose pipes are
    recorded; yields ``(url, engine, spawner)``. At the end: nothing left in the manager,
    and (once stopped) no worker process. The worker itself may still be running a request
    whose abort it ignored: its late output is dropped, and the shutdown ends it."""
    spawner = RecordingSpawner()
    engine_config = EngineConfig(engine_options=dict(FAST), drain_timeout=drain_timeout,
                                 shutdown_grace=1.0)
    config = ServerConfig(engine=engine_config, host="127.0.0.1", port=0,
                          limits=Limits(allow_faults=True), shutdown_timeout=0,
                          close_timeout=0.2, **server_options)
    async with server.open_engine(engine_config, spawn=spawner) as engine:
        app = create_app(config, engine=engine)
        async with trio.open_nursery() as nursery:
            shutdown = trio.Event()
            binds = await nursery.start(
                functools.partial(serve, config, app=app, shutdown_trigger=shutdown)
            )
            try:
                yield binds[0], engine, spawner
                assert_manager_empty(engine)
            finally:
                shutdown.set()
    spawner.assert_all_exited()


def assert_manager_empty(engine) -> None:
    stats = engine.statistics()
    assert (stats.open_streams, stats.outstanding) == (0, 0)


async def manager_empty(engine) -> None:
    """Wait (a hang guard) until the manager holds no stream and no request."""
    with trio.fail_after(GUARD):
        while True:
            stats = engine.statistics()
            if (stats.open_streams, stats.outstanding) == (0, 0):
                return
            await trio.sleep(0.01)


async def until(condition) -> None:
    with trio.fail_after(GUARD):
        while not condition():
            await trio.sleep(0.01)


def finishes(spawner, rid: int) -> list[str]:
    """How the worker ended ``rid`` (its finish rows: ``["abort"]`` when it confirmed one)."""
    return [out[3] for _, out in spawner.outputs_for(rid) if out[3] is not None]


async def data_events(lines):
    """The data of each server-sent event of an ``aiter_lines()``, parsed (or ``[DONE]``)."""
    async for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


# -- choosing stop strings ------------------------------------------------------------------------


def words(text: str) -> list[str]:
    """The sim's tokens of ``text``: each word with its leading space."""
    return [" " + w for w in text.split(" ")[1:]]


def cut(text: str, stops: list[str]) -> tuple[str, str]:
    """``(text, finish_reason)`` of a choice whose whole text would be ``text``, with
    ``stops`` (a stop string ends it, and is not part of its text)."""
    at = min((text.find(s) for s in stops if s in text), default=None)
    return (text, "length") if at is None else (text[:at], "stop")


def stops_ending(texts: list[str], ends: dict[int, int]) -> list[str] | None:
    """Stop strings that end choice ``i`` at its token ``ends[i]`` (one token each) and
    leave the others to run out; None when ``texts`` allow none."""
    stops = [words(texts[i])[k] for i, k in ends.items()]
    for i, text in enumerate(texts):
        want = (text, "length") if i not in ends else ("".join(words(text)[:ends[i]]), "stop")
        if cut(text, stops) != want:
            return None
    return stops


async def find_stops(http, path: str, body: dict, ends: dict[int, int]):
    """A seed and stops for ``body`` (``stops_ending``), from the server's own answers
    without a stop; returns ``(seed, stops, expected)``."""
    for seed in range(100):
        r = await http.post(path, json={**body, "seed": seed})
        assert r.status_code == 200, r.text
        texts = [c["text"] if "text" in c else c["message"]["content"]
                 for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        stops = stops_ending(texts, ends)
        if stops is not None:
            return seed, stops, [cut(text, stops) for text in texts]
    raise AssertionError("no seed gives the stop strings this test needs")


# -- 1. exactly one abort per unfinished choice ----------------------------------------------------


async def five_token_stop(http) -> tuple[int, str]:
    """A seed, and a stop string of five tokens that ends the first of two prompts at its
    fourth token and that the second's first 512 do not hold. The second runs on for longer
    than the test reads: five words of the sim's 64 make a chance match there negligible
    (two words matched once in about 3,000 tokens, which a slow abort could reach)."""
    for seed in range(100):
        body = {"prompt": ["one", "two"], "max_tokens": 512, "seed": seed}
        r = await http.post("/v1/completions", json=body)
        first, second = (c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"]))
        stop = "".join(words(first)[3:8])
        if cut(first, [stop]) == ("".join(words(first)[:3]), "stop") and stop not in second:
            return seed, stop
    raise AssertionError("no seed gives the stop string this test needs")


async def test_a_disconnect_aborts_each_unfinished_choice_once_and_finished_ones_never():
    """Two prompts: the first ends (a stop string) while the second runs on; the client
    reads until the first's end, then goes away (the ASGI client's ``http.disconnect``)."""
    with trio.fail_after(TEST_LIMIT):
        async with open_recorded_server(drain_timeout=30.0) as (url, engine, spawner):
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                seed, stop = await five_token_stop(http)
            request = {"prompt": ["one", "two"], "max_tokens": ENDLESS, "seed": seed,
                       "stop": [stop], "stream": True}
            app = create_app(ServerConfig(limits=Limits(allow_faults=True)), engine=engine)
            async with open_asgi_client(app) as client:
                async with client.stream("POST", "/v1/completions", json=request) as response:
                    assert response.status == 200
                    ended = None
                    async with aclosing(response.events()) as events:
                        async for event in events:
                            if event["choices"][0].get("finish_reason") is not None:
                                ended = event["choices"][0]
                                break
                    await response.disconnect()
            assert (ended["index"], ended["finish_reason"]) == (0, "stop")
            await manager_empty(engine)
            done, running = spawner.rids()[-2:]
            assert finishes(spawner, done) == ["stop"]
            assert spawner.aborts(done) == 0
            assert spawner.aborts(running) == 1
            assert finishes(spawner, running) == ["abort"]  # the worker confirmed it


async def test_a_client_gone_while_a_timed_out_request_drains_sends_no_second_abort():
    """The server aborts first (the request timeout), the worker ignores it, and the client
    disconnects during the drain: the stream's close must not abort again."""
    with trio.fail_after(TEST_LIMIT):
        async with open_recorded_server(drain_timeout=5.0, request_timeout=1.0) as (
            url, engine, spawner
        ):
            body = {"prompt": "go", "max_tokens": ENDLESS, "stream": True,
                    "fault": {"kind": "ignore_abort", "after": 0}}
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    events = data_events(r.aiter_lines())
                    await events.__anext__()
                    [rid] = spawner.rids()
                    await until(lambda: spawner.aborts(rid) == 1)  # the timeout's
                    await events.aclose()
                # leaving both blocks closed the connection mid-stream
            await manager_empty(engine)  # cut off at the drain deadline
            assert spawner.aborts(rid) == 1
            assert "abort" not in finishes(spawner, rid)  # (it ignored it)


# -- 2. the drain deadline -------------------------------------------------------------------


async def test_a_worker_that_ignores_the_abort_is_cut_off_at_the_drain_deadline():
    with trio.fail_after(TEST_LIMIT):
        async with open_recorded_server(drain_timeout=0.5) as (url, engine, spawner):
            body = {"prompt": "go", "max_tokens": ENDLESS, "stream": True,
                    "fault": {"kind": "ignore_abort", "after": 0}}
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    events = data_events(r.aiter_lines())
                    assert [await events.__anext__() for _ in range(2)]
                    await events.aclose()
            # The client went away; only the deadline can end the stream now: the request
            # runs on in the worker for at least 60 s, past this guard.
            await manager_empty(engine)
            [rid] = spawner.rids()
            assert spawner.aborts(rid) == 1 and finishes(spawner, rid) == []
            assert await engine.ping_all() == [(1, 0)]  # still running there, not ours
            # and the server serves on
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                assert (await http.get("/health")).status_code == 200
                r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert (len(words(choice["text"])), choice["finish_reason"]) == (5, "length")


# -- 3. several choices, one ending first ------------------------------------------------------------


async def collect(http, path: str, body: dict) -> list[tuple[str, str]]:
    """``(text, finish_reason)`` of each choice, by index, streamed or not."""
    if not body.get("stream"):
        r = await http.post(path, json=body)
        assert r.status_code == 200, r.text
        return [(c["text"] if "text" in c else c["message"]["content"], c["finish_reason"])
                for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = [e async for e in data_events(r.aiter_lines())]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for c in event["choices"]:
            delta = c["text"] if "text" in c else c["delta"].get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + delta
            if c.get("finish_reason") is not None:
                assert c["index"] not in ends, "a choice ended twice"
                ends[c["index"]] = c["finish_reason"]
    assert sorted(ends) == sorted(texts) == list(range(len(texts)))
    return [(texts[i], ends[i]) for i in range(len(texts))]


async def test_every_choice_arrives_in_full_when_one_ends_first():
    """Completions of three prompts: the last ends at its first token (its end is there
    when the server first looks at the stream, and comes after the others' outputs of that
    step), the second at its third, the first runs to ``max_tokens``. Chat with n=2: the
    second sample ends at its first token. Streamed and not."""
    completions = {"prompt": ["one", "two", "three"], "max_tokens": 24}
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 24}
    with trio.fail_after(TEST_LIMIT):
        async with open_recorded_server(drain_timeout=5.0) as (url, engine, spawner):
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                for path, body, ends in (
                    ("/v1/completions", completions, {2: 0, 1: 2}),
                    ("/v1/chat/completions", chat, {1: 0}),
                ):
                    seed, stops, want = await find_stops(http, path, body, ends)
                    for stream in (False, True):
                        request = {**body, "seed": seed, "stop": stops, "stream": stream}
                        with trio.fail_after(GUARD):  # a lost choice hangs the request
                            got = await collect(http, path, request)
                        assert got == want, (path, stream)
            assert spawner.aborts() == 0
