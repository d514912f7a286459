"""``POST /invocations`` (SageMaker's endpoint, as vLLM serves it): the dispatch rule
(sans-IO), and each dispatched kind end to end through hypercorn on the sim engine, its
answer the same as the route's it dispatches to."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from server.errors import ClientError
from server.http.invocations import invocation_route
from tests.conftest import JSON, running_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("body, route", [
    ({"messages": []}, CHAT),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x", "input": "y"}, CHAT),
    ({"prompt": "hi", "input": "y"}, COMPLETIONS),
    ({"prompt": [1, 2]}, COMPLETIONS),
    ({"prompt_embeds": "AAAA"}, COMPLETIONS),  # (completions refuses it by name)
    ({"input": "hi", "model": "m"}, EMBEDDINGS),
    # a key given as null is absent (a client that sends every field), as vLLM judges it
    ({"prompt": "hi", "messages": None}, COMPLETIONS),
    ({"input": "hi", "messages": None, "prompt": None}, EMBEDDINGS),
    ({"messages": [], "prompt": None, "x": float("nan")}, CHAT),  # (the slower parse)
])
def test_the_dispatch_rule(body, route):
    assert invocation_route(json.dumps(body).encode()) == route


@pytest.mark.parametrize("body, words", [
    (b'{"model": "m"}', "Cannot find suitable handler"),
    (b"{}", "Cannot find suitable handler"),
    (b'{"messages": null}', "Cannot find suitable handler"),
    (b'{"query": "q", "documents": ["a"]}', "rerank"),
    (b'{"text_1": "a", "text_2": "b"}', "score"),
    (b'{"queries": ["a"], "items": ["b"]}', "score"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages": ', "not valid JSON"),
])
def test_a_body_of_no_served_kind_is_a_400(body, words):
    with pytest.raises(ClientError) as info:
        invocation_route(body)
    assert info.value.status == 400 and words in info.value.message


async def test_chat_through_invocations_with_the_sdk(server_url):
    body = {"model": "sim", "messages": [{"role": "user", "content": "one two"}],
            "max_tokens": 6, "seed": 3}
    client = sdk(server_url)
    direct = await client.post(CHAT, cast_to=ChatCompletion, body=body)
    got = await client.post("/invocations", cast_to=ChatCompletion, body=body)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.content == direct.choices[0].message.content
    assert got.usage == direct.usage
    stream = await client.post(
        "/invocations", cast_to=ChatCompletionChunk, stream=True,
        stream_cls=openai.AsyncStream[ChatCompletionChunk],
        body={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert chunks[-1].usage == direct.usage
    # the chat route's own validation, and its words
    with pytest.raises(openai.BadRequestError) as info:
        await client.post("/invocations", cast_to=ChatCompletion,
                          body={**body, "temperature": "hot"})
    assert info.value.body["param"] == "temperature"


async def test_completions_through_invocations(server_url):
    body = {"model": "sim", "prompt": "a b c", "max_tokens": 5, "seed": 7}
    async with httpx.AsyncClient(base_url=server_url) as http:
        direct = (await http.post(COMPLETIONS, json=body)).json()
        r = await http.post("/invocations", json=body, headers={"X-Request-Id": "sm-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "sm-1"
        got = Completion.model_validate(r.json())
        assert got.id == "cmpl-sm-1" and got.choices[0].text == direct["choices"][0]["text"]
        async with http.stream("POST", "/invocations", json={**body, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1])
        assert text == direct["choices"][0]["text"]


async def test_embeddings_through_invocations(server_url):
    body = {"model": "sim", "input": ["a cat", "a dog"], "encoding_format": "float"}
    async with httpx.AsyncClient(base_url=server_url) as http:
        direct = (await http.post(EMBEDDINGS, json=body)).json()
        r = await http.post("/invocations", json=body)
        assert r.status_code == 200 and r.json() == direct
        r = await http.post("/invocations", json={"input": ""})  # the route's 400
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"


async def test_refusals_and_api_keys():
    async with running_server(api_keys=("k",)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            body = {"prompt": "a", "max_tokens": 1}
            r = await http.post("/invocations", json=body)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            auth = {"Authorization": "Bearer k"}
            r = await http.post("/invocations", json=body, headers=auth)
            assert r.status_code == 200 and r.json()["object"] == "text_completion"
            r = await http.post("/invocations", json={"query": "q", "documents": ["d"]},
                                headers=auth)
            assert r.status_code == 400 and "rerank" in r.json()["error"]["message"]
            r = await http.post("/invocations", json={"model": "sim"}, headers=auth)
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == "unsupported_request_type"
            r = await http.post("/invocations", content=b'{"prompt": "a"}',
                                headers={**auth, "Content-Type": "text/plain"})
            assert r.status_code == 415
            r = await http.get("/invocations", headers=auth)
            assert r.status_code == 405
            r = await http.post("/invocations", content=b"{", headers={**auth, **JSON})
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
