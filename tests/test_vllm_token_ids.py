"""vLLM's ``return_token_ids``, ``prompt_logprobs`` and ``return_tokens_as_token_ids`` on
the vllm engine: tests/test_vllm_engine.py's server (``python -m server --engine vllm``,
started once for both: tests/conftest.py's ``vllm_server``), the openai SDK with
``extra_body``; the references are the model's tokenizer and the model run directly in
transformers (logprobs within a tolerance).

Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import openai  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tests.test_vllm_engine import MODEL, SHAPE  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)

PROMPT = "the cat sat on the mat and"
CHAT = [{"role": "user", "content": "tell me about the mat"}]


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir):
    return vllm_model_dir


@pytest.fixture(scope="module")
def server(vllm_server):
    vllm_server.wait_ready(1200)  # (test_vllm_engine.py's last test restarts its worker)
    return vllm_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_return_token_ids(client, tokenizer):
    asked = {"return_token_ids": True}
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body=asked)
    choice = done.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert len(choice.token_ids) == done.usage.completion_tokens
    assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].token_ids is None and plain.choices[0].prompt_token_ids is None

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True, extra_body=asked))
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids

    chat_ids = tokenizer(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                       tokenize=False),
                         add_special_tokens=False)["input_ids"]
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                            temperature=0, extra_body=asked)
    assert answer.prompt_token_ids == chat_ids
    ids = answer.choices[0].token_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == answer.choices[0].message.content
    events = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                 temperature=0, stream=True, extra_body=asked))
    assert events[0].prompt_token_ids == chat_ids
    assert [t for e in events if e.choices
            for t in (e.choices[0].model_dump().get("token_ids") or ())] == ids


def test_prompt_logprobs(client, tokenizer, model_dir):
    from tests.test_token_ids import check_prompt_logprobs, reference_rows

    ids = tokenizer(PROMPT)["input_ids"]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                     extra_body={"prompt_logprobs": 2})
    check_prompt_logprobs(done.choices[0].model_dump()["prompt_logprobs"], ids,
                          reference_rows(model_dir, ids), 2)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].model_dump()["prompt_logprobs"] is None
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"
    # 0, streamed: served as vLLM serves it, the same stream as without, no prompt logprobs
    streams = [[c.model_dump() for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
        extra_body=extra)] for extra in ({"prompt_logprobs": 0}, {})]
    texts = ["".join(c["choices"][0]["text"] for c in s if c["choices"]) for s in streams]
    assert texts[0] == texts[1]  # (the text, not its chunks: pacing may merge events)
    assert not any("prompt_logprobs" in c["choices"][0] for c in streams[0] if c["choices"])


def test_prompt_logprobs_up_to_max_logprobs(client, tokenizer, model_dir):
    """Past 20, and -1 (the whole vocabulary), when --max-logprobs covers it, as vLLM
    serves them (vLLM's test_chat_echo test_prompt_logprobs); past it, a 400."""
    from tests.test_token_ids import check_prompt_logprobs, reference_rows

    ids = tokenizer(PROMPT)["input_ids"]
    rows = reference_rows(model_dir, ids)
    vocab = rows.shape[-1]  # (the model's; --max-logprobs, SHAPE's, is at least that)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                     extra_body={"prompt_logprobs": 25})
    check_prompt_logprobs(done.choices[0].model_dump()["prompt_logprobs"], ids, rows, 25)
    # -1: every token of the vocabulary, each with the model's own logprob (ranks of
    # near-ties in the tail may differ from transformers' order: not compared)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                     extra_body={"prompt_logprobs": -1})
    got = done.choices[0].model_dump()["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for row, position in zip(rows, got[1:]):
        assert sorted(map(int, position)) == list(range(vocab))
        assert [position[str(t)]["logprob"] for t in range(vocab)] == pytest.approx(
            row.tolist(), abs=1e-3)
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                            extra_body={"prompt_logprobs": -1})
    got = answer.model_dump()["prompt_logprobs"]
    assert len(got) == answer.usage.prompt_tokens and got[0] is None
    assert all(len(p) == vocab for p in got[1:])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": SHAPE["vocab_size"] + 1})
    assert info.value.body["param"] == "prompt_logprobs"


async def test_return_tokens_as_token_ids(server, tokenizer):
    from tests.test_token_ids import check_tokens_as_ids

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    await check_tokens_as_ids(client, tokenizer(PROMPT)["input_ids"], MODEL)
