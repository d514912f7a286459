"""What client libraries send by default (issue 41): only ``model`` and the input, on every
endpoint and every engine. dspy, llama-index, haystack, smolagents, autogen, mirascope,
``llm`` and the bare openai SDK send no ``max_tokens``, no temperature, nothing tuned; every
other test sets ``max_tokens``, so none of them saw that such a body was a 400 on the
transformers engine. The vllm engine runs :func:`assert_minimal_bodies_served` on its
module's server (tests/test_vllm_engine.py); the embedding models' minimal bodies are in
tests/test_embeddings.py."""

from __future__ import annotations

import json

import httpx
import trio

from tests.conftest import running_server

#: Seconds for a test: a transformers worker's start and a few generations that run to
#: the tiny model's context. A bound on failing, not on speed.
LIMIT = 600

def _bodies(text: str) -> dict[str, dict]:
    """Each generation endpoint's minimal body, less ``model``: what a client sends with
    nothing tuned."""
    return {
        "/v1/completions": {"prompt": text},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": text}]},
        "/v1/responses": {"input": text},
    }


TOKENIZER = {
    "/tokenize": {"prompt": "Once upon a time"},
    "/detokenize": {"tokens": [1, 2, 3]},
}


def _generated(path: str, answer: dict) -> int:
    """The tokens an answer says it generated, checking it ended as an answer should."""
    if path == "/v1/responses":
        assert answer["status"] in ("completed", "incomplete"), answer
        assert answer["output"], answer
        return answer["usage"]["output_tokens"]
    (choice,) = answer["choices"]
    assert choice["finish_reason"] in ("stop", "length"), answer
    return answer["usage"]["completion_tokens"]


async def assert_minimal_bodies_served(url: str, model: str, *, text: str = "Say hi.",
                                       tokenizer: bool = True, embeddings: bool = False) -> None:
    """Every endpoint answers its minimal body with a 200 and a whole answer; streamed too
    (``stream: true`` is the one field a streaming client adds). Without ``max_tokens`` a
    chat answer may run to the end of the context: a long ``text`` leaves less of it."""
    generation = _bodies(text)
    bodies = {**generation, **(TOKENIZER if tokenizer else {}),
              **({"/v1/embeddings": {"input": "hi"}} if embeddings else {})}
    async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
        for path, body in bodies.items():
            r = await http.post(path, json={"model": model, **body})
            assert r.status_code == 200, (path, r.text)
            if path in generation:
                assert _generated(path, r.json()) >= 1, (path, r.text)
        for path, body in generation.items():
            async with http.stream("POST", path, json={"model": model, "stream": True, **body}) as r:
                assert r.status_code == 200, (path, await r.aread())
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            last = lines[-2] if lines[-1] == "data: [DONE]" else lines[-1]
            if path == "/v1/responses":
                assert json.loads(last[6:])["type"] in ("response.completed",
                                                        "response.incomplete"), last
            else:
                assert lines[-1] == "data: [DONE]", lines[-3:]
                assert json.loads(last[6:])["choices"] or json.loads(last[6:])["usage"], last
            assert not any(json.loads(line[6:]).get("error") for line in lines
                           if line != "data: [DONE]"), lines


async def test_sim_engine_serves_minimal_bodies():
    with trio.fail_after(LIMIT):
        async with running_server() as url:
            await assert_minimal_bodies_served(url, "sim", tokenizer=False, embeddings=True)


async def test_transformers_engine_serves_minimal_bodies(transformers_url):
    with trio.fail_after(LIMIT):
        await assert_minimal_bodies_served(transformers_url, "tiny-llama")

