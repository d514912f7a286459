"""Background responses end to end with the openai SDK on the sim (issue 44 item 3):
``background: true`` answered at once ``queued``, polled with ``responses.retrieve`` until it
ends, cancelled with ``responses.cancel`` (its engine request aborted once), a background
stream left and resumed with ``retrieve(stream=True, starting_after=N)`` to its end; two
servers on one ``--state-dir`` (two frontends sharing the store: one follows and cancels
what the other runs); another key's response a 404; on SQLite and PostgreSQL. A server
SIGKILLed in the middle of one leaves it ``in_progress`` only until its lease expires: the
next server on the same store (SQLite or PostgreSQL) marks it ``failed``; a server that
stops (drain) marks its own failed at once. On the transformers engine, the SDK end to end of issue 44
(a stored chain, background polled and cancelled, a batch read by ``custom_id``), here
because this module starts that server anyway. Real time, bounded by ``trio.fail_after``."""

from __future__ import annotations

import functools
import json
import os
import signal

import httpx
import openai
import pytest
import trio

from server.config import EngineConfig, Limits, ServerConfig
from server.http.app import create_app
from server.openai.responses import parse_responses
from server.openai.responses_events import ResponseEvents, new_response, response_usage, \
    split_events
from server.openai.responses_progress import ProgressCache, ProgressStatistics, ended, \
    response_so_far
from server.http.responses_background import LEASE_S, SWEEP_S
from server.http.responses_store import KIND
from server.http.serve import serve
from tests.conftest import FAST_SIM, ServerURL, running_server, wait_http_ok
from tests.postgres_server import STORES, state_options
from tests.remote import supervised

TIMEOUT_S = 60
#: Tokens of a response that must be cancelled, not run to its end (a minute at the sim's
#: 2 ms a token, in a context of 2**20: the engine is idle after the test only if it was
#: aborted). The killed server's (the default 8192-token context) takes 16 s.
LONG = 30_000
LONG_SIM = EngineConfig(engine_options={**FAST_SIM, "max_model_len": 1 << 20})


def client_of(url: str, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(params=STORES)
def store_options(request, tmp_path) -> dict:
    """Where a test's servers keep their state: SQLite, or PostgreSQL (tests/postgres_server.py)."""
    return state_options(request, tmp_path, "bg")


async def wait_status(client: openai.AsyncOpenAI, response_id: str, statuses: tuple):
    """Poll ``retrieve`` until the response's status is one of ``statuses``."""
    while (got := await client.responses.retrieve(response_id)).status not in statuses:
        assert got.status in ("queued", "in_progress"), got
        await trio.sleep(0.05)
    return got


async def wait_idle(app) -> None:
    while app.background.statistics().running:
        await trio.sleep(0.05)


async def scrape(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(url + "/metrics")).text


def metric(exposition: str, name: str) -> float:
    """The one sample of ``trio_llm:background_responses_<name>``."""
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
                if line.startswith(f"trio_llm:background_responses_{name}{{")]
    return value


def texts(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def test_polled_to_its_end_and_its_stream_resumed(store_options):
    async with running_server(LONG_SIM, **store_options) as url:
        client = client_of(url)
        with trio.fail_after(TIMEOUT_S):
            queued = await client.responses.create(model="sim", input="Hello there",
                                                   background=True, max_output_tokens=40)
            assert (queued.status, queued.background, queued.output) == ("queued", True, [])
            done = await wait_status(client, queued.id, ("incomplete", "completed"))
            assert done.background and done.output_text and done.usage.output_tokens == 40
            replayed = [e async for e in await client.responses.retrieve(queued.id, stream=True)]
            assert [e.sequence_number for e in replayed] == list(range(len(replayed)))
            assert replayed[-1].type == "response.incomplete"
            assert replayed[-1].response.model_dump() == done.model_dump()
            assert texts(replayed) == done.output_text
            assert [e async for e in await client.responses.retrieve(  # (nothing after the end)
                queued.id, stream=True, starting_after=replayed[-1].sequence_number)] == []

            # a background stream: read a few events, leave; the response runs on
            stream = await client.responses.create(model="sim", input="Stream it",
                                                   background=True, stream=True,
                                                   max_output_tokens=300)
            seen = []
            async for event in stream:
                seen.append(event)
                if len(seen) == 5:
                    break
            await stream.close()
            rid = seen[0].response.id
            assert seen[0].type == "response.created" and seen[0].response.background
            tail = [e async for e in await client.responses.retrieve(
                rid, stream=True, starting_after=seen[-1].sequence_number)]
            events = seen + tail
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert events[-1].type == "response.incomplete"
            final = await client.responses.retrieve(rid)
            assert final.status == "incomplete" and texts(events) == final.output_text
            assert final.usage.output_tokens == 300


def item_texts(response) -> list[str]:
    """Each output item's text (or a call's arguments), from a dict or the SDK's model."""
    output = response["output"] if isinstance(response, dict) else [
        o.model_dump() for o in response.output]
    return [o["arguments"] if o["type"] == "function_call" else
            "".join(p["text"] for p in o["content"]) for o in output]


async def test_a_poll_shows_the_output_so_far():
    """``retrieve`` of a running background response shows its output as far as it got, as
    OpenAI's in-progress Response does: each poll's text a prefix of the next's, and of the
    final output_text."""
    async with running_server(LONG_SIM) as url:
        client = client_of(url)
        with trio.fail_after(TIMEOUT_S):
            r = await client.responses.create(model="sim", input="Tell me", background=True,
                                              max_output_tokens=5000)
            seen: list[str] = []
            while len(seen) < 3:
                got = await client.responses.retrieve(r.id)
                assert got.status in ("queued", "in_progress"), "it ended: poll sooner"
                if got.output_text and got.output_text not in seen:
                    assert [o.status for o in got.output] == ["in_progress"]
                    assert got.usage is None
                    seen.append(got.output_text)
                await trio.sleep(0.05)
            done = await wait_status(client, r.id, ("incomplete",))
            # each stored event was folded once, not once a poll (it had many polls)
            streamed = [e async for e in await client.responses.retrieve(r.id, stream=True)]
            assert url.app.background.statistics().events_folded <= len(streamed)
            texts_seen = seen + [done.output_text]
            assert all(b.startswith(a) and b != a for a, b in zip(texts_seen, texts_seen[1:]))
            assert done.output[0].status == "incomplete" and done.usage.output_tokens == 5000


def test_the_output_so_far_of_every_kind_of_item():
    """The fold of a response's events, after each piece of text: every item's text a
    prefix of its final text; after the last item's done events, the final items; with the
    terminal event, the final Response object."""
    weather = {"type": "function", "name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    req = parse_responses(json.dumps({"input": "hi", "tools": [weather]}).encode(), Limits(),
                          "m", {"engine": "transformers", "sampling": ["tools"]}, "hermes")
    events = ResponseEvents(new_response("resp_1", 0, "m", req.echo),
                            reasoning_parser="qwen3", tools=req.chat.tools)
    text = ('<think>Let me look.</think>It is: <tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    stored = split_events(events.start())
    start = json.loads(json.dumps(events.response))
    folds = []
    for i in range(0, len(text), 3):
        stored += split_events(events.feed(text[i:i + 3]))
        folds.append(response_so_far(start, stored))
    stored += split_events(events.feed("", last=True))
    tail = split_events(events.end("stop", response_usage(1, 1, None)))
    final = json.loads(json.dumps(events.response))
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    for fold in folds:
        assert fold["status"] == "in_progress" and fold["usage"] is None
        assert all(f.startswith(p) for p, f in zip(item_texts(fold), item_texts(final)))
    assert len({json.dumps(fold["output"]) for fold in folds}) > 10  # (growing)
    assert response_so_far(start, stored + tail[:-1])["output"] == final["output"]
    assert response_so_far(start, stored + tail) == final
    # A frontend's polls fold only the events since its last one, as if all at once
    # (ProgressCache); a fold leaves what it started from as it was.
    cache, everything = ProgressCache(), stored + tail
    for cut in [*range(1, len(stored), 4), len(stored), len(stored) + len(tail) - 1]:
        begin, count = cache.start("alice", "resp_1", start)
        before = json.dumps(begin)
        fold = response_so_far(begin, everything[count:cut])
        assert json.dumps(begin) == before
        assert fold == response_so_far(start, everything[:cut])
        cache.keep("alice", "resp_1", cut, fold, ended(everything[count:cut]), cache.ticket())
    cache.keep("alice", "resp_1", 3, response_so_far(start, everything[:3]), False, 0)
    assert cache.start("alice", "resp_1", start)[1] == cut  # (an older poll's is not kept)
    assert cache.start("bob", "resp_1", start) == (start, 0)  # (by owner)
    begin, count = cache.start("alice", "resp_1", start)
    fold = response_so_far(begin, everything[count:])
    cache.keep("alice", "resp_1", len(everything), fold, ended(everything[count:]), 0)
    assert fold == final and cache.start("alice", "resp_1", start) == (start, 0)  # (ended)


def test_a_poll_that_keeps_after_the_end_keeps_nothing():
    """A poll reads the record while it runs, folds slowly, and keeps its fold after the
    response ended (another poll folded the terminal event), was cancelled or deleted:
    nothing is kept, or the fold of a response that no poll will end would stay."""
    cache, response = ProgressCache(size=2), {"output": []}
    folded = {"output": [{"type": "message", "content": []}]}
    for end in ("terminal", "cancel"):
        ticket = cache.ticket()  # (the slow poll reads the record: running)
        cache.start("alice", end, response)
        if end == "terminal":  # (a faster poll folds to the terminal event)
            cache.keep("alice", end, 9, folded, True, cache.ticket())
        else:  # (a cancel or a delete, after its write to the store)
            cache.end("alice", end)
        assert cache.statistics().entries == 0
        cache.keep("alice", end, 4, folded, False, ticket)  # (the slow poll's fold)
        assert cache.statistics().entries == 0
        assert cache.start("alice", end, response) == (response, 0)
    # Past the ends remembered (4 * size), a ticket older than the last one forgotten
    # adds no entry; a poll that read its record since does.
    old = cache.ticket()  # (a slow poll reads the record: running)
    cache.end("alice", "slow")  # (deleted)
    for n in range(8):  # (and more ends than are remembered)
        cache.end("bob", f"other_{n}")
    assert cache.statistics() == ProgressStatistics(entries=0, ended=8)
    cache.keep("alice", "slow", 4, folded, False, old)
    assert cache.statistics().entries == 0
    cache.keep("alice", "running", 4, folded, False, cache.ticket())
    assert cache.start("alice", "running", response) == (folded, 4)
    cache.keep("alice", "running", 6, folded, False, old)  # (an entry there: polled on)
    assert cache.start("alice", "running", response)[1] == 6


async def test_a_followed_stream_is_not_cut_by_quarts_response_timeout():
    async with running_server(LONG_SIM) as url:
        url.app.config["RESPONSE_TIMEOUT"] = 0  # (Quart's, 60 s: a stream past it is cut)
        client = client_of(url)
        with trio.fail_after(TIMEOUT_S):
            r = await client.responses.create(model="sim", input="x", background=True,
                                              max_output_tokens=50)
            followed = [e async for e in await client.responses.retrieve(r.id, stream=True)]
            assert followed[-1].type == "response.incomplete"
            assert [e.sequence_number for e in followed] == list(range(len(followed)))


async def test_cancel_aborts_the_engine_request_once(store_options):
    async with running_server(LONG_SIM, **store_options) as url:
        client = client_of(url)
        app = url.app
        with trio.fail_after(TIMEOUT_S):
            r = await client.responses.create(model="sim", input="Go on", background=True,
                                              max_output_tokens=LONG)
            await wait_status(client, r.id, ("in_progress",))
            assert metric(await scrape(url), "running") == 1
            # a follower sees it end when it is cancelled
            async with trio.open_nursery() as nursery:
                followed: list = []

                async def follow() -> None:
                    async for e in await client.responses.retrieve(r.id, stream=True):
                        followed.append(e)

                nursery.start_soon(follow)
                while not any(e.type == "response.output_text.delta" for e in followed):
                    await trio.sleep(0.01)
                cancels = []

                async def cancel() -> None:
                    cancels.append(await client.responses.cancel(r.id))

                for _ in range(3):  # (at once: one of them stops it)
                    nursery.start_soon(cancel)
            assert [c.status for c in cancels] == ["cancelled"] * 3
            assert followed[0].type == "response.created"
            await wait_idle(app)
            assert app.background.statistics().aborted == 1
            exposition = await scrape(url)
            assert (metric(exposition, "running"), metric(exposition, "aborted_total")) == (0, 1)
            got = await client.responses.retrieve(r.id)
            assert (got.status, got.background) == ("cancelled", True)
            # what it generated is kept, as far as the cancel saw it, its item incomplete
            streamed = "".join(e.delta for e in followed if e.type == "response.output_text.delta")
            assert got.output_text and streamed.startswith(got.output_text)
            assert [o.status for o in got.output] == ["incomplete"]
            assert {c.output_text for c in cancels} == {got.output_text}
            assert (await client.responses.cancel(r.id)).output_text == got.output_text
            # only a queued or running background response can be cancelled
            stored = await client.responses.create(model="sim", input="x", max_output_tokens=2)
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.cancel(stored.id)
            assert caught.value.body["code"] == "not_background"
            ended = await client.responses.create(model="sim", input="x", background=True,
                                                  max_output_tokens=2)
            await wait_status(client, ended.id, ("incomplete",))
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.cancel(ended.id)
            assert caught.value.body["code"] == "response_already_ended"
            assert app.background.statistics().aborted == 1
        # (running_server's end checks that the engine is idle: the request was aborted)


async def test_a_follower_sends_every_event_its_cancel_kept():
    """A follower that found no new event, then reads the response ``cancelled``, first
    sends the events stored between its two reads: the cancel kept their text, so the
    stream must hold it too. The follower's empty read is held here until the cancel is
    done, with one more event stored meanwhile: the order a busy server makes now and then
    (the store's reads and writes wait for one thread in turn)."""
    async with running_server(LONG_SIM) as url:
        client = client_of(url)
        store = url.app.state_store
        read_events = store.read_events
        held, go = trio.Event(), trio.Event()
        armed = False

        async def holding(*args, **kw):
            nonlocal armed
            events = await read_events(*args, **kw)
            if armed and not events:  # (the follower's: nothing new)
                armed = False
                held.set()
                await go.wait()
            return events

        store.read_events = holding
        followed: list = []

        async def follow(response_id: str) -> None:
            async for e in await client.responses.retrieve(response_id, stream=True):
                followed.append(e)

        with trio.fail_after(TIMEOUT_S):
            r = await client.responses.create(model="sim", input="Go on", background=True,
                                              max_output_tokens=LONG)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow, r.id)
                while not texts(followed):
                    await trio.sleep(0.01)
                armed = True
                await held.wait()
                stored = len(await read_events(KIND, "", r.id))
                while len(await read_events(KIND, "", r.id)) == stored:
                    await trio.sleep(0.01)
                cancelled = await client.responses.cancel(r.id)
                go.set()
            await wait_idle(url.app)
        assert cancelled.status == "cancelled"
        assert texts(followed).startswith(cancelled.output_text), (
            len(texts(followed)), len(cancelled.output_text))


async def test_two_servers_on_one_store_follow_and_cancel_each_others(store_options):
    async with running_server(LONG_SIM, **store_options) as a_url, \
            running_server(LONG_SIM, **store_options) as b_url:
        a, b = client_of(a_url), client_of(b_url)
        with trio.fail_after(TIMEOUT_S):
            r = await a.responses.create(model="sim", input="Far away", background=True,
                                         max_output_tokens=LONG)
            # b follows a's events through the store
            stream = await b.responses.retrieve(r.id, stream=True)
            seen = []
            async for event in stream:
                seen.append(event)
                if len(seen) == 10:
                    break
            await stream.close()
            assert [e.sequence_number for e in seen] == list(range(10))
            # b's cancel reaches a's job through the store: a aborts it
            assert (await b.responses.cancel(r.id)).status == "cancelled"
            await wait_idle(a_url.app)
            assert a_url.app.background.statistics().aborted == 1
            assert b_url.app.background.statistics().aborted == 0
            assert (await a.responses.retrieve(r.id)).status == "cancelled"


async def test_a_delete_drops_the_frontends_fold(store_options):
    """The fold a frontend keeps of a running response goes with the response: here on a
    frontend that does not run it (a frontend's end of its own job drops it too)."""
    async with running_server(LONG_SIM, **store_options) as a_url, \
            running_server(LONG_SIM, **store_options) as b_url:
        a, b = client_of(a_url), client_of(b_url)
        progress = b_url.app.background.progress
        with trio.fail_after(TIMEOUT_S):
            r = await a.responses.create(model="sim", input="Far away", background=True,
                                         max_output_tokens=LONG)
            while not (await b.responses.retrieve(r.id)).output_text:
                await trio.sleep(0.05)
            assert progress.statistics().entries == 1
            await b.responses.delete(r.id)
            assert progress.statistics().entries == 0
            await wait_idle(a_url.app)  # (its lease renewal finds it gone)


async def test_a_deleted_running_response_is_aborted():
    async with running_server(LONG_SIM) as url:
        client = client_of(url)
        with trio.fail_after(TIMEOUT_S):
            r = await client.responses.create(model="sim", input="x", background=True,
                                              max_output_tokens=LONG)
            await wait_status(client, r.id, ("in_progress",))
            await client.responses.delete(r.id)
            await wait_idle(url.app)  # (its next lease renewal finds it gone)
            assert url.app.background.statistics().aborted == 1
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(r.id)


async def test_another_keys_background_response_is_a_404():
    async with running_server(LONG_SIM, api_keys=("key-a", "key-b")) as url:
        a, b = client_of(url, "key-a"), client_of(url, "key-b")
        with trio.fail_after(TIMEOUT_S):
            r = await a.responses.create(model="sim", input="mine", background=True,
                                         max_output_tokens=LONG)
            for call in (b.responses.retrieve(r.id), b.responses.cancel(r.id),
                         b.responses.retrieve(r.id, stream=True)):
                with pytest.raises(openai.NotFoundError):
                    await call
            assert (await a.responses.cancel(r.id)).status == "cancelled"
            await wait_idle(url.app)


async def test_refusals_name_the_field():
    async with running_server(LONG_SIM, max_background_responses=1) as url:
        client = client_of(url)
        async with httpx.AsyncClient(base_url=url) as http:
            for body in ({"background": True, "store": False}, {"background": "yes"}):
                r = await http.post("/v1/responses", json={"input": "x", **body})
                assert r.status_code == 400 and r.json()["error"]["param"] == "background"
            # one at a time here: the second is a 503 saying so
            first = await client.responses.create(model="sim", input="x", background=True,
                                                  max_output_tokens=LONG)
            r = await http.post("/v1/responses", json={"input": "x", "background": True})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "too_many_background_responses"
            await client.responses.cancel(first.id)
            await wait_idle(url.app)
    async with running_server(state_store=False) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/responses", json={"input": "x", "background": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "background"


async def test_a_draining_server_marks_what_it_did_not_finish_failed(tmp_path):
    """The drain (shutdown_timeout) lets a short response finish and aborts a long one:
    that one is ``failed``, saying the server stopped, never left in progress."""
    state = {"state_dir": str(tmp_path / "state")}
    cfg = ServerConfig(engine=LONG_SIM, host="127.0.0.1", port=0, shutdown_timeout=1.0,
                       close_timeout=0.2, **state)
    app = create_app(cfg)
    shutdown = trio.Event()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, cfg, app=app,
                                                          shutdown_trigger=shutdown))
            url = ServerURL(binds[0])
            await wait_http_ok(url + "/health")
            client = client_of(url)
            long = await client.responses.create(model="sim", input="x", background=True,
                                                 max_output_tokens=LONG)
            await wait_status(client, long.id, ("in_progress",))
            short = await client.responses.create(model="sim", input="x", background=True,
                                                  max_output_tokens=5)
            await wait_status(client, short.id, ("in_progress", "incomplete"))
            shutdown.set()
    async with running_server(**state) as url:
        client = client_of(url)
        assert (await client.responses.retrieve(short.id)).status == "incomplete"
        got = await client.responses.retrieve(long.id)
        assert got.status == "failed" and got.error.code == "shutting_down"
        replayed = [e async for e in await client.responses.retrieve(long.id, stream=True)]
        assert replayed[-1].type == "response.failed"
        assert [e.sequence_number for e in replayed] == list(range(len(replayed)))


async def test_a_killed_server_leaves_its_response_failed_after_a_restart(tmp_path,
                                                                          store_options):
    (option, value), = store_options.items()
    async with supervised(tmp_path, "--" + option.replace("_", "-"), value) as sup:
        client = client_of(sup.url)  # (two frontends: either may take each request)
        r = await client.responses.create(model="sim", input="x", background=True,
                                          max_output_tokens=8000)
        with trio.fail_after(TIMEOUT_S):
            while not (await client.responses.retrieve(r.id)).output_text:  # (some output)
                await trio.sleep(0.05)
            before = (await client.responses.retrieve(r.id)).output_text
        frontends, workers = sup.children()
        sup.proc.kill()  # (the supervisor, its frontends and workers: nothing stops cleanly)
        for pid in [*frontends.values(), *workers]:
            os.kill(pid, signal.SIGKILL)
        await sup.proc.wait()
    async with running_server(**store_options) as url:
        client = client_of(url)
        with trio.fail_after(TIMEOUT_S + LEASE_S + SWEEP_S):
            got = await wait_status(client, r.id, ("failed",))
        assert got.error.code == "server_stopped"
        assert "stopped before it finished" in got.error.message
        assert got.output_text.startswith(before) and got.output[0].status == "incomplete"
        replayed = [e async for e in await client.responses.retrieve(r.id, stream=True)]
        assert [e.sequence_number for e in replayed] == list(range(len(replayed)))
        assert replayed[-1].type == "response.failed"
        assert replayed[-1].response.status == "failed"
        body = json.loads((await httpx.AsyncClient().get(
            f"{url}/v1/responses/{r.id}")).content)
        assert body["status"] == "failed"


async def test_on_the_transformers_engine(transformers_url):
    """The same machine on a real model: a background stream, left after its first events
    and resumed to its end; the text of the events is the stored response's."""
    client = client_of(transformers_url)
    with trio.fail_after(120):
        stream = await client.responses.create(model="tiny-llama", input="Hello",
                                               background=True, stream=True,
                                               max_output_tokens=12, temperature=0)
        seen = []
        async for event in stream:
            seen.append(event)
            if len(seen) == 3:
                break
        await stream.close()
        rid = seen[0].response.id
        tail = [e async for e in await client.responses.retrieve(
            rid, stream=True, starting_after=seen[-1].sequence_number)]
        events = seen + tail
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = await client.responses.retrieve(rid)
        assert final.status in ("completed", "incomplete") and final.background
        assert events[-1].type == f"response.{final.status}"
        assert texts(events) == final.output_text


async def test_the_sdk_end_to_end_on_the_transformers_engine(transformers_url):
    """Issue 44's other showings on a real model, on the server the test above starts: a
    stored turn continued by ``previous_response_id``, a background response polled to
    its end and one cancelled, a batch made with ``files.create`` and ``batches.create``
    and its output read by ``custom_id``. Greedy (temperature 0): each answer is what the
    same request answers interactively."""
    client = client_of(transformers_url)
    model = {"model": "tiny-llama", "temperature": 0}
    with trio.fail_after(180):
        first = await client.responses.create(input="Hello", max_output_tokens=4, **model)
        second = await client.responses.create(input="Again", previous_response_id=first.id,
                                               max_output_tokens=4, **model)
        alone = await client.responses.create(input="Again", store=False,
                                              max_output_tokens=4, **model)
        assert first.store and second.previous_response_id == first.id
        assert second.usage.input_tokens > alone.usage.input_tokens  # (the first turn)
        items = [i async for i in client.responses.input_items.list(second.id)]
        assert [i.role for i in items] == ["user", "assistant", "user"]
        assert items[1].content[0].text == first.output_text

        queued = await client.responses.create(input="Poll me", background=True,
                                               max_output_tokens=6, **model)
        assert queued.status == "queued"
        done = await wait_status(client, queued.id, ("completed", "incomplete"))
        asked = await client.responses.create(input="Poll me", store=False,
                                              max_output_tokens=6, **model)
        assert done.output_text == asked.output_text
        long = await client.responses.create(input="Go on", background=True,
                                             max_output_tokens=240, **model)
        cancelled = await client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert (await client.responses.retrieve(long.id)).status == "cancelled"

        body = {"model": "tiny-llama", "temperature": 0, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {**body, "messages": [{"role": "user", "content": f"say {i}"}]}}
                 for i in range(3)]
        lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                      "body": {**body, "model": "no-such-model"}})
        text = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        file = await client.files.create(file=("in.jsonl", text), purpose="batch")
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        while (batch := await client.batches.retrieve(batch.id)).status != "completed":
            assert batch.status in ("validating", "in_progress", "finalizing"), batch
            await trio.sleep(0.05)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
        out = [json.loads(x) for x in
               (await client.files.content(batch.output_file_id)).text.splitlines()]
        errors = [json.loads(x) for x in
                  (await client.files.content(batch.error_file_id)).text.splitlines()]
        assert [x["custom_id"] for x in out] == ["c0", "c1", "c2"]
        assert [(x["custom_id"], x["response"]["status_code"]) for x in errors] == [
            ("bad", 404)]
        for line, answer in zip(lines, out):
            interactive = await client.chat.completions.create(**line["body"])
            assert answer["response"]["body"]["choices"][0]["message"]["content"] \
                == interactive.choices[0].message.content
