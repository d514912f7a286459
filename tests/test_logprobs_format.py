"""Logprobs: what a request asks for (sans-IO schema) and OpenAI's shapes (sans-IO). The
engines' values are tested with the engines (test_transformers_engine, test_vllm_engine)."""

from __future__ import annotations

import json

import pytest

from server.config import Limits
from server.errors import ClientError
from server.openai import schema
from server.openai.logprobs import LogprobsFormatter

HF = {"engine": "transformers", "logprobs": 20}
SIM = {"engine": "sim"}
CHAT = [{"role": "user", "content": "hi"}]


def completion(body: dict, info=HF):
    return schema.parse_completion(json.dumps({"prompt": "hi", **body}).encode(), Limits(), "m", info)


def chat(body: dict, info=HF):
    return schema.parse_chat(json.dumps({"messages": CHAT, **body}).encode(), Limits(), "m", info)


VLLM_50 = {"engine": "vllm", "logprobs": 50, "vocab_size": 1000}  # --max-logprobs 50


def test_the_engines_most_and_the_whole_vocabulary():
    # The vllm engine's --max-logprobs is the limit (vLLM's default 20), and -1 asks for
    # the whole vocabulary where that limit covers it, as in vLLM.
    assert completion({"logprobs": 50, "max_tokens": 8}, VLLM_50).logprobs == 50
    assert chat({"logprobs": True, "top_logprobs": 30, "max_tokens": 8}, VLLM_50).logprobs == 30
    whole = {"engine": "vllm", "logprobs": 1000, "vocab_size": 1000}
    assert completion({"logprobs": -1, "max_tokens": 8}, whole).logprobs == 1000
    assert chat({"logprobs": True, "top_logprobs": -1, "max_tokens": 8}, whole).logprobs == 1000


def test_what_a_request_asks_for():
    assert completion({}).logprobs is None
    assert completion({"logprobs": None}).logprobs is None
    req = completion({"logprobs": 0})
    assert req.logprobs == 0 and req.params.to_wire()["logprobs"] == 0
    req = completion({"logprobs": 3, "echo": True})
    assert req.params.to_wire()["prompt_logprobs"] == 3
    assert "prompt_logprobs" not in completion({"logprobs": 3}).params.to_wire()
    assert chat({"logprobs": True}).logprobs == 0
    assert chat({"logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert chat({"logprobs": False, "top_logprobs": 0}).logprobs is None
    assert "logprobs" not in chat({}).params.to_wire()


@pytest.mark.parametrize(
    "parse, body, info, words",
    [
        (completion, {"logprobs": 1}, SIM, "not supported by the sim engine"),
        (chat, {"logprobs": True}, SIM, "not supported by the sim engine"),
        (chat, {"top_logprobs": 2}, HF, "needs 'logprobs': true"),
        (completion, {"logprobs": 21}, HF, "between 0 and 20"),
        (completion, {"logprobs": 2}, {"engine": "x", "logprobs": 1}, "between 0 and 1"),
        (completion, {"logprobs": 51}, VLLM_50, "between 0 and 50"),
        (chat, {"logprobs": True, "top_logprobs": -1}, VLLM_50,
         "-1 \\(the whole vocabulary, 1000 tokens\\) is more than the 50"),
        (completion, {"logprobs": -1}, HF, "the whole vocabulary\\) is more than the 20"),
        (completion, {"logprobs": -2}, VLLM_50, "between 0 and 50"),
    ],
)
def test_refusals(parse, body, info, words):
    with pytest.raises(ClientError, match=words):
        parse(body, info)


ENTRIES = [["Hel", -0.5, [["Hel", -0.5], ["He", -1.5]]], ["lo", -0.25, [["lo", -0.25]]]]


def test_completion_shape_with_offsets_across_chunks_and_the_prompt():
    f = LogprobsFormatter(chat=False)
    prompt = [["Say", None, []], [" hi", -3.0, [["!", -1.0]]]]
    first = f.format(ENTRIES[:1], prompt)
    assert first == {
        "tokens": ["Say", " hi", "Hel"],
        "token_logprobs": [None, -3.0, -0.5],
        "top_logprobs": [None, {"!": -1.0, " hi": -3.0}, {"Hel": -0.5, "He": -1.5}],
        "text_offset": [0, 3, 6],
    }
    assert f.format(ENTRIES[1:])["text_offset"] == [9]
    assert f.format(None) is None


def test_chat_shape():
    got = LogprobsFormatter(chat=True).format(ENTRIES)
    assert got["content"][0] == {
        "token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
        "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                         {"token": "He", "logprob": -1.5, "bytes": [72, 101]}],
    }
    assert len(got["content"]) == 2


def test_prompt_logprobs_zero_streamed_asks_the_engine_for_nothing():
    """``prompt_logprobs: 0`` with ``stream`` is accepted as vLLM accepts it; a stream has
    no place for prompt logprobs, so the engine is not asked to compute them (a forward
    pass over the prompt, a note of every prompt token), except for a completion's echoed
    prompt with ``logprobs``, where 0 says how many alternatives it carries."""
    info = {**HF, "sampling": ["prompt_logprobs"]}

    def asked(parse, body):
        return parse(body, info).params.to_wire().get("prompt_logprobs")

    assert asked(completion, {"prompt_logprobs": 0}) == 0  # (whole answers carry them)
    assert asked(chat, {"prompt_logprobs": 0}) == 0
    assert asked(completion, {"prompt_logprobs": 0, "stream": True}) is None
    assert asked(chat, {"prompt_logprobs": 0, "stream": True}) is None
    assert asked(completion, {"prompt_logprobs": 0, "stream": True, "echo": True,
                              "logprobs": 2}) == 0
