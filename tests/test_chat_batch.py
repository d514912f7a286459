"""``POST /v1/chat/completions/batch`` (vLLM's): a choice per conversation, each the answer
the conversation gets alone; what vLLM's batch endpoint does not take is refused by name."""

from __future__ import annotations

import pytest

import server
from server.testing import open_in_memory_engine
from server.testing.asgi import open_asgi_client

CONVERSATIONS = [
    [{"role": "user", "content": "Reply with exactly the word: alpha"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "beta gamma"}],
    [{"role": "user", "content": "delta"}],
]


async def test_each_conversation_gets_the_answer_it_gets_alone(autojump_clock):
    common = {"max_tokens": 7, "temperature": 0, "seed": 3}
    async with open_in_memory_engine() as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            alone = []
            for conversation in CONVERSATIONS:
                r = await client.post("/v1/chat/completions",
                                      json={**common, "messages": conversation})
                assert r.status == 200, r.body
                alone.append(r.json())
            r = await client.post("/v1/chat/completions/batch",
                                  json={**common, "messages": CONVERSATIONS})
    assert r.status == 200, r.body
    batch = r.json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for choice, single in zip(batch["choices"], alone):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in alone)


@pytest.mark.parametrize("field, value", [
    ("stream", True), ("n", 2), ("use_beam_search", True),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
])
async def test_what_a_batch_does_not_take_is_refused_by_name(autojump_clock, field, value):
    async with open_in_memory_engine() as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            r = await client.post("/v1/chat/completions/batch",
                                  json={"messages": CONVERSATIONS, field: value})
    assert r.status == 400 and r.json()["error"]["param"] == field, r.body


@pytest.mark.parametrize("messages", [
    [], "hi", [{"role": "user", "content": "a"}], [[]], [[{"role": "user", "content": "a"}], []],
])
async def test_messages_must_be_conversations(autojump_clock, messages):
    async with open_in_memory_engine() as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            r = await client.post("/v1/chat/completions/batch", json={"messages": messages})
    assert r.status == 400 and r.json()["error"]["param"] == "messages", r.body


async def test_a_bad_conversation_is_named(autojump_clock):
    bad = [CONVERSATIONS[0], [{"role": "user"}]]
    async with open_in_memory_engine() as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            r = await client.post("/v1/chat/completions/batch", json={"messages": bad})
    assert r.status == 400 and r.json()["error"]["message"].startswith("Conversation 1: "), r.body
