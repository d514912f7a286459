"""/tokenize and /detokenize: request parsing (sans-IO) and the sim engine's answer. The
transformers and vllm engines' answers are tested with them (their modules)."""

from __future__ import annotations

import json

import httpx
import pytest

from server.errors import ClientError, NotFound
from server.http.tokenize import parse_detokenize, parse_tokenize
from tests.conftest import JSON


def tok(body: dict) -> dict:
    return parse_tokenize(json.dumps(body).encode(), "m")


def test_tokenize_requests():
    assert tok({"prompt": "hi"}) == {"op": "tokenize", "prompt": "hi", "add_special_tokens": True}
    assert tok({"model": "m", "prompt": "hi", "add_special_tokens": False})["add_special_tokens"] \
        is False
    chat = tok({"messages": [{"role": "user", "content": [{"type": "text", "text": "yo"}]}],
                "add_generation_prompt": True, "return_token_strs": False})
    assert chat == {"op": "tokenize", "prompt": {"messages": [{"role": "user", "content": "yo"}]}}
    assert parse_detokenize(b'{"tokens": [1, 2]}', "m") == {"op": "detokenize", "tokens": [1, 2]}
    tool = {"type": "function", "function": {"name": "f"}}
    with_tools = tok({"messages": [{"role": "user", "content": "a"}], "tools": [tool],
                      "chat_template_kwargs": {"enable_thinking": False}})
    assert with_tools["tools"][0]["function"]["name"] == "f"
    assert with_tools["template_kwargs"] == {"enable_thinking": False}
    # vLLM's options: the template's, the tokenizer's special tokens, the token strings
    options = tok({"messages": [{"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}],
                   "continue_final_message": True, "add_generation_prompt": False,
                   "add_special_tokens": True, "return_token_strs": True})
    assert options["prompt"]["continue_final_message"] is True
    assert options["prompt"]["add_generation_prompt"] is False
    assert options["add_special_tokens"] is True and options["token_strs"] is True
    assert tok({"prompt": "a", "return_token_strs": True})["token_strs"] is True


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": []}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
        ({"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
         "continue_final_message"),
        ({"messages": [{"role": "user", "content": "a"}], "mm_processor_kwargs": {"a": 1}},
         "mm_processor_kwargs"),
        ({"messages": [{"role": "user", "content": "a"}], "media_io_kwargs": {"a": {}}},
         "media_io_kwargs"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template": "{{x}}"},
         "chat_template"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"prompt": "a", "model": 3}, "model"),
        ({"prompt": "a", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "x"}]},
         "tools[0]"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": []},
         "chat_template_kwargs"),
    ],
)
def test_bad_tokenize_requests(body, param):
    with pytest.raises(ClientError) as info:
        tok(body)
    assert info.value.param == param


def test_bad_detokenize_requests():
    for body in (b'{}', b'{"tokens": "12"}', b'{"tokens": [1, -1]}', b'{"tokens": [true]}'):
        with pytest.raises(ClientError) as info:
            parse_detokenize(body, "m")
        assert info.value.param == "tokens"
    with pytest.raises(NotFound):
        parse_detokenize(b'{"model": "other", "tokens": []}', "m")


async def test_the_sim_engine_has_no_tokenizer(server_url):
    async with httpx.AsyncClient(base_url=server_url, timeout=10) as http:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            r = await http.post(path, json=body)
            assert r.status_code == 400
            assert "not supported by the sim engine" in r.json()["error"]["message"]
        r = await http.post("/tokenize", content=b'{"prompt": 1}', headers=JSON)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await http.get("/tokenize")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        r = await http.post("/detokenize", content=b'{"tokens": []}')
        assert r.status_code == 415
