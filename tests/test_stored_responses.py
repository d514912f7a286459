"""Stored responses end to end with the openai SDK on the sim (issue 44 items 2 and 5):
``store`` (the default) then ``previous_response_id`` (the earlier turns become the prompt:
checked by its token count, which the sim counts in words of its chat template),
``responses.retrieve`` (the object, and its events replayed byte for byte, from
``starting_after``), ``input_items.list`` paging, ``delete`` then 404, ``store: false``
never kept, another key's response a 404 like a missing one; and the refusals. Over HTTP
on SQLite and PostgreSQL."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio

from server.config import Limits
from server.engines.sim.engine import render_chat
from server.errors import ClientError
from server.openai.responses_events import split_events
from server.openai.responses import parse_responses, read_responses, translate_responses
from server.openai.responses_items import context_of, input_items, items_page, record_body
from tests.conftest import running_server
from tests.postgres_server import STORES, state_database, state_options

KEYS = ("key-a", "key-b")


def client_of(url: str, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def prompt_tokens(*messages: tuple[str, str]) -> int:
    """What the sim counts for a chat of these (role, content) messages."""
    return len(render_chat([{"role": r, "content": c} for r, c in messages]).split())


@pytest.fixture(params=STORES)
def store_options(request, tmp_path) -> dict:
    """Where a test's server keeps its state: SQLite, or PostgreSQL (tests/postgres_server.py)."""
    return state_options(request, tmp_path, "sr")


# -- sans-IO -------------------------------------------------------------------------------


def test_input_items_take_openai_shapes_with_ids():
    items = input_items([
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "id": "msg_kept",
         "content": [{"type": "output_text", "text": "yo"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ])
    assert [i["type"] for i in items] == ["message", "message", "function_call",
                                          "function_call_output"]
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[1]["id"] == "msg_kept" and items[0]["id"].startswith("msg_")
    assert items[2]["id"].startswith("fc_") and items[3]["id"].startswith("fco_")
    assert {i["status"] for i in items} == {"completed"}
    (only,) = input_items("hello")
    assert only["role"] == "user" and only["content"][0]["text"] == "hello"


def test_a_context_goes_before_the_input_and_instructions_stay_the_requests():
    response = {"output": [{"id": "msg_o", "type": "message", "role": "assistant",
                            "status": "completed", "content": [
                                {"type": "output_text", "text": "answer", "annotations": []}]}]}
    context = context_of(record_body(response, input_items("question")))
    data = read_responses(json.dumps({"input": "next", "instructions": "Be kind.",
                                      "previous_response_id": "resp_1"}).encode(), True)
    req = translate_responses(data, Limits(), "m", None, None, context)
    assert req.prompts[0]["messages"] == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "question"},
        {"role": "assistant", "content": "answer"}, {"role": "user", "content": "next"}]
    assert req.store and [i["id"] for i in req.items[:2]] == [context[0]["id"], "msg_o"]
    assert req.echo["previous_response_id"] == "resp_1" and req.echo["store"] is True
    # store: as sent, else the server's (true with a store); false keeps no items
    assert read_responses(b'{"input": "x"}', False)["store"] is False
    data = read_responses(b'{"input": "x", "store": false}', True)
    assert not translate_responses(data, Limits(), "m").items
    for body, param in [({"store": "yes"}, "store"), ({"previous_response_id": ""},
                                                      "previous_response_id")]:
        with pytest.raises(ClientError) as caught:
            read_responses(json.dumps({"input": "x", **body}).encode(), True)
        assert caught.value.param == param
    with pytest.raises(ClientError) as caught:  # a server without a store
        parse_responses(b'{"input": "x", "store": true}', Limits(), "m")
    assert caught.value.param == "store"


def test_input_item_pages():
    items = [{"id": f"i{n}"} for n in range(5)]
    page = items_page(items, after=None, limit=None, order=None)  # desc: the last first
    assert [i["id"] for i in page["data"]] == ["i4", "i3", "i2", "i1", "i0"]
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("i4", "i0", False)
    page = items_page(items, after="i1", limit="2", order="asc")
    assert [i["id"] for i in page["data"]] == ["i2", "i3"] and page["has_more"]
    page = items_page(items, after="i3", limit="2", order="asc")
    assert [i["id"] for i in page["data"]] == ["i4"] and not page["has_more"]
    for kwargs, param in [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
                          ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "nope"}, "after")]:
        with pytest.raises(ClientError) as caught:
            items_page(items, **{"after": None, "limit": None, "order": None, **kwargs})
        assert caught.value.param == param


# -- over HTTP -----------------------------------------------------------------------------


async def test_a_chain_of_turns_retrieved_listed_and_deleted_with_the_sdk(store_options):
    async with running_server(**store_options) as url:
        client = client_of(url)
        first = await client.responses.create(model="sim", input="Hello there",
                                              instructions="Be brief.", max_output_tokens=8,
                                              temperature=0)
        assert first.store and first.previous_response_id is None  # stored by default
        said = first.output_text
        assert first.usage.input_tokens == prompt_tokens(("system", "Be brief."),
                                                         ("user", "Hello there"))
        second = await client.responses.create(model="sim", input="And then?",
                                               previous_response_id=first.id,
                                               max_output_tokens=4, temperature=0)
        assert second.previous_response_id == first.id and second.instructions is None
        # the first turn's input and output are the context; its instructions are not
        assert second.usage.input_tokens == prompt_tokens(
            ("user", "Hello there"), ("assistant", said), ("user", "And then?"))
        third = await client.responses.create(model="sim", input="Why?", store=False,
                                              previous_response_id=second.id,
                                              max_output_tokens=2)
        assert third.usage.input_tokens == prompt_tokens(
            ("user", "Hello there"), ("assistant", said), ("user", "And then?"),
            ("assistant", second.output_text), ("user", "Why?"))
        assert not third.store

        # retrieve: the object as created
        got = await client.responses.retrieve(second.id)
        assert got.model_dump() == second.model_dump()
        # input_items: the whole context, each with an id, the last first by default
        items = [i async for i in client.responses.input_items.list(second.id)]
        assert [(i.type, i.role) for i in items] == [("message", "user"),
                                                     ("message", "assistant"),
                                                     ("message", "user")]
        assert items[0].content[0].text == "And then?" and items[1].id == first.output[0].id
        paged = [i async for i in client.responses.input_items.list(second.id, limit=1,
                                                                    order="asc")]
        assert [i.id for i in paged] == [i.id for i in reversed(items)]
        async with httpx.AsyncClient(base_url=url) as http:
            page = (await http.get(f"/v1/responses/{second.id}/input_items",
                                   params={"limit": 2, "order": "asc"})).json()
        assert page["object"] == "list" and page["has_more"] is True
        assert (page["first_id"], page["last_id"]) == (items[2].id, items[1].id)

        # store: false is never kept: a 404, and no turn can continue it
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(third.id)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(model="sim", input="x", previous_response_id=third.id)
        assert caught.value.body["param"] == "previous_response_id"
        assert third.id in caught.value.body["message"]

        # delete: OpenAI's deletion object, then 404 everywhere; the later turn stands
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.delete(f"/v1/responses/{first.id}")
        assert r.json() == {"id": first.id, "object": "response", "deleted": True}
        for call in (client.responses.retrieve(first.id), client.responses.delete(first.id),
                     client.responses.input_items.list(first.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        await client.responses.delete(second.id)  # the SDK's delete
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(second.id)


async def test_a_stored_stream_replays_byte_for_byte(store_options):
    async with running_server(**store_options) as url:
        client = client_of(url)
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/responses", json={"input": "stream me", "stream": True,
                                                       "max_output_tokens": 6})
            wire = r.content
            created = json.loads(wire.split(b"\n", 2)[1].removeprefix(b"data: "))
            response_id = created["response"]["id"]
            replay = await http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
            assert replay.headers["content-type"].startswith("text/event-stream")
            assert replay.content == wire
            events = wire.split(b"\n\n")[:-1]
            after = await http.get(f"/v1/responses/{response_id}",
                                   params={"stream": "true", "starting_after": 3})
            assert after.content == b"".join(e + b"\n\n" for e in events[4:])
        # the SDK's view: the same events, and the object the last one carries
        replayed = [e async for e in await client.responses.retrieve(response_id, stream=True)]
        assert [e.sequence_number for e in replayed] == list(range(len(events)))
        assert replayed[-1].type == "response.incomplete"
        got = await client.responses.retrieve(response_id)
        assert got.model_dump() == replayed[-1].response.model_dump()
        tail = [e async for e in await client.responses.retrieve(response_id, stream=True,
                                                                   starting_after=5)]
        assert [e.model_dump() for e in tail] == [e.model_dump() for e in replayed[6:]]
        # a non-streaming answer is kept with the events a stream of it would have had
        whole = await client.responses.create(model="sim", input="whole", max_output_tokens=3)
        replayed = [e async for e in await client.responses.retrieve(whole.id, stream=True)]
        assert [e.type for e in replayed][:2] == ["response.created", "response.in_progress"]
        assert replayed[-1].response.model_dump() == whole.model_dump()
        text = "".join(e.delta for e in replayed if e.type == "response.output_text.delta")
        assert text == whole.output_text


async def test_a_stream_stored_as_rows_by_an_older_server_replays_the_same(store_options):
    """A store written before ``trio_llm_streams`` kept a response's events one row each:
    the same response moved to that form replays the same bytes, from any point."""
    async with running_server(**store_options) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/responses", json={"input": "stream me", "stream": True,
                                                       "max_output_tokens": 6})
            wire = r.content
            response_id = json.loads(wire.split(b"\n", 2)[1].removeprefix(b"data: "))[
                "response"]["id"]

            def as_rows() -> None:
                db = state_database(store_options.get("state_dir"),
                                    store_options.get("state_url"))
                try:
                    with db.write():
                        [(data,)] = db.execute("SELECT data FROM trio_llm_streams WHERE id = ?",
                                               (response_id,))
                        db.execute_many(
                            "INSERT INTO trio_llm_events(kind, owner, id, n, data) "
                            "VALUES (?, ?, ?, ?, ?)",
                            [("response", "", response_id, n, event)
                             for n, event in enumerate(split_events(bytes(data)))])
                        db.execute("DELETE FROM trio_llm_streams WHERE id = ?", (response_id,))
                finally:
                    db.close()

            await trio.to_thread.run_sync(as_rows)
            replay = await http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
            assert replay.content == wire
            events = split_events(wire)
            for after in (0, 3, len(events) - 2):
                tail = await http.get(f"/v1/responses/{response_id}",
                                      params={"stream": "true", "starting_after": after})
                assert tail.content == b"".join(events[after + 1:])


async def test_another_keys_response_is_a_404_like_a_missing_one(store_options):
    async with running_server(api_keys=KEYS, **store_options) as url:
        a, b = client_of(url, "key-a"), client_of(url, "key-b")
        mine = await a.responses.create(model="sim", input="secret", max_output_tokens=2)
        missing = "resp_" + "0" * 24
        for client, rid in ((b, mine.id), (a, missing)):
            for call in (client.responses.retrieve(rid), client.responses.delete(rid),
                         client.responses.input_items.list(rid)):
                with pytest.raises(openai.NotFoundError) as caught:
                    await call
                body = caught.value.body
                assert body["code"] == "not_found" and rid in body["message"]
                assert body["message"].replace(rid, "ID") == "No response with id 'ID' was found."
            with pytest.raises(openai.NotFoundError) as caught:
                await client.responses.create(model="sim", input="x", previous_response_id=rid)
            assert caught.value.body["param"] == "previous_response_id"
        # still there for its owner, after the other key's delete
        assert (await a.responses.retrieve(mine.id)).output_text == mine.output_text
        # the routes need a key like every other
        async with httpx.AsyncClient(base_url=url) as http:
            for r in (await http.get(f"/v1/responses/{mine.id}"),
                      await http.delete(f"/v1/responses/{mine.id}"),
                      await http.get(f"/v1/responses/{mine.id}/input_items")):
                assert r.status_code == 401


async def test_refusals_name_the_field():
    async with running_server() as url:
        client = client_of(url)
        r = await client.responses.create(model="sim", input="x", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as caught:  # (background needs store)
            await client.responses.create(model="sim", input="x", background=True,
                                          store=False)
        assert caught.value.body["param"] == "background"
        async with httpx.AsyncClient(base_url=url) as http:
            for path, params, param in [
                (r.id, {"starting_after": "1"}, "starting_after"),  # without stream
                (r.id, {"stream": "true", "starting_after": "-1"}, "starting_after"),
                # (digits str.isdigit takes and int() does not; past sqlite's integers)
                (r.id, {"stream": "true", "starting_after": "\u00b2"}, "starting_after"),
                (r.id, {"stream": "true", "starting_after": "9" * 30}, "starting_after"),
                (r.id, {"stream": "yes"}, "stream"),
                (r.id, {"include[]": "message.output_text.logprobs"}, "include"),
                (r.id, {"include_obfuscation": "true"}, "include_obfuscation"),
                (r.id, {"nope": "1"}, "nope"),
                (f"{r.id}/input_items", {"limit": "0"}, "limit"),
                (f"{r.id}/input_items", {"after": "msg_nope"}, "after"),
                (f"{r.id}/input_items", {"order": "up"}, "order"),
            ]:
                got = await http.get(f"/v1/responses/{path}", params=params)
                assert got.status_code == 400, (path, params, got.text)
                assert got.json()["error"]["param"] == param, (path, params)
        assert (await client.responses.retrieve(r.id)).id == r.id


@pytest.mark.parametrize("bound, status, code", [
    ("state_max_bytes_per_key", 413, "storage_quota_exceeded"),
    ("state_max_bytes", 507, "storage_full"),
])
async def test_a_response_the_store_refuses_is_answered_and_not_kept(bound, status, code,
                                                                     store_options):
    # (a bound smaller than any response)
    async with running_server(**{bound: 200}, **store_options) as url:
        client = client_of(url)
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2})
            assert r.status_code == status and r.json()["error"]["code"] == code
            r = await http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2,
                                                       "stream": True})
        # the stream had its answer, then an error event: not kept
        *events, last = [json.loads(line.removeprefix(b"data: "))
                         for line in r.content.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1]["type"] == "response.incomplete"
        assert last["type"] == "error" and last["code"] == code
        assert last["sequence_number"] == events[-1]["sequence_number"] + 1
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(events[-1]["response"]["id"])
        # store: false needs no room
        kept_nothing = await client.responses.create(model="sim", input="x", store=False,
                                                     max_output_tokens=2)
        assert kept_nothing.status == "incomplete" and not kept_nothing.store
