"""vLLM's ``return_token_ids``, ``prompt_logprobs`` and ``return_tokens_as_token_ids`` on
the transformers engine: a real server with a real worker process and the tiny model
(tests/tiny_model.py), driven with the openai SDK's ``extra_body``. The server is
tests/conftest.py's shared ``transformers_server``, or ``running_server`` for a test with a
server option. The reference is the model's own tokenizer, and the model run directly in
transformers (for logprobs, within a tolerance)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from server import EngineConfig  # noqa: E402
from tests.conftest import FAST_SIM, JSON, running_server  # noqa: E402

torch.set_num_threads(1)

MODEL = "tiny-llama"  # (tests/conftest.py's transformers_server serves it)
LIMIT = 120  # seconds: a worker process imports torch and loads the model on busy cores
PROMPT = "the cat sat on the mat and"
CHAT = [{"role": "user", "content": "tell me about the mat"}]


@pytest.fixture(scope="module")
def model_dir(transformers_server):
    """The shared transformers server's model (tests/conftest.py): the tests that need no
    server options of their own talk to that server."""
    return transformers_server.model_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def chat_ids_of(tokenizer) -> list[int]:
    """CHAT's ids as the worker renders it (the template's text, no special tokens added)."""
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_config(model_dir) -> EngineConfig:
    return EngineConfig(engine="transformers", drain_timeout=5.0,
                        engine_options={"model_path": str(model_dir), "num_threads": 1})


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


async def test_return_token_ids_completions_and_chat(transformers_url, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    chat_ids = chat_ids_of(tokenizer)
    asked = {"return_token_ids": True}
    with trio.fail_after(LIMIT):
        url = transformers_url
        client = client_of(url)
        # a whole completion: the prompt's ids and the answer's, in the choice
        done = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=asked)
        choice = done.choices[0]
        assert choice.prompt_token_ids == prompt_ids
        assert len(choice.token_ids) == done.usage.completion_tokens
        assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text

        # not asked: vLLM's fields are there, null (raw JSON: the SDK hides absence)
        async with httpx.AsyncClient() as http:
            raw = (await http.post(url + "/v1/completions", headers=JSON, content=json.dumps(
                {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}))).json()
            body = (await http.post(url + "/v1/chat/completions", headers=JSON,
                                    content=json.dumps({"model": MODEL, "messages": CHAT,
                                                        "max_tokens": 3}))).json()
        assert raw["choices"][0]["token_ids"] is None
        assert raw["choices"][0]["prompt_token_ids"] is None
        assert body["prompt_token_ids"] is None and body["choices"][0]["token_ids"] is None

        # streamed: the first chunk has the prompt's ids, every chunk its tokens' ids
        chunks = [c async for c in await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
            extra_body=asked)]
        dumps = [c.model_dump() for c in chunks]
        assert dumps[0]["choices"][0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in d["choices"][0] for d in dumps[1:])
        streamed = [t for c in chunks for t in c.choices[0].token_ids]
        assert streamed == choice.token_ids
        assert "".join(c.choices[0].text for c in chunks) == choice.text

        # not asked, streamed: no ids at all
        plain = [c.model_dump() async for c in await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, stream=True)]
        assert all("token_ids" not in d["choices"][0] for d in plain)

        # chat: the prompt's ids (the template's) on the response, the answer's per choice
        answer = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=10, temperature=0, n=2,
            extra_body=asked)
        assert answer.prompt_token_ids == chat_ids
        for c in answer.choices:
            assert tokenizer.decode(c.token_ids, skip_special_tokens=True) \
                == c.message.content
        # streamed: each choice's role chunk has them, on the chunk
        events = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=10, temperature=0, n=2, stream=True,
            extra_body=asked)]
        firsts = [e for e in events if e.choices and e.choices[0].delta.role]
        assert len(firsts) == 2 and all(e.prompt_token_ids == chat_ids for e in firsts)
        for index in (0, 1):
            ids = [t for e in events if e.choices and e.choices[0].index == index
                   for t in (e.choices[0].model_dump().get("token_ids") or ())]
            assert ids == answer.choices[index].token_ids
        assert all("prompt_token_ids" not in e.model_dump()
                   for e in events if e not in firsts)


def reference_rows(model_dir, ids: list[int]):
    """Each position's log-probabilities, the tiny model run directly in transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def check_prompt_logprobs(got: list, ids: list[int], rows, k: int) -> None:
    """vLLM's shape: the first null, then {id: {logprob, rank, decoded_token}}: the
    prompt's token and the k most likely, against the model's own values."""
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row = rows[i - 1]
        position = got[i]
        chosen = position[str(ids[i])]
        assert chosen["logprob"] == pytest.approx(float(row[ids[i]]), abs=1e-3)
        assert chosen["rank"] == int((row > row[ids[i]]).sum()) + 1
        values, top = row.topk(k)
        for rank, (value, token) in enumerate(zip(values.tolist(), top.tolist()), 1):
            assert position[str(token)]["logprob"] == pytest.approx(value, abs=1e-3)
            assert position[str(token)]["rank"] == rank
        assert len(position) in (k, k + 1)


async def test_prompt_logprobs_are_the_models_own(transformers_url, model_dir, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    chat_ids = chat_ids_of(tokenizer)
    with trio.fail_after(LIMIT):
        url = transformers_url
        client = client_of(url)
        done = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2})
        check_prompt_logprobs(done.choices[0].model_dump()["prompt_logprobs"], prompt_ids,
                              reference_rows(model_dir, prompt_ids), 2)
        assert done.choices[0].logprobs is None  # (not asked)
        # chat: on the response; 0: the prompt's tokens alone
        answer = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 0})
        check_prompt_logprobs(answer.model_dump()["prompt_logprobs"], chat_ids,
                              reference_rows(model_dir, chat_ids), 0)
        # with echo and logprobs: both shapes, from the same entries
        both = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1,
            extra_body={"prompt_logprobs": 1})
        got = both.choices[0].model_dump()["prompt_logprobs"]
        assert [p and p[str(t)]["logprob"] for p, t in zip(got, prompt_ids)] \
            == both.choices[0].logprobs.token_logprobs[:len(prompt_ids)]
        await check_tokens_as_ids(client, prompt_ids)
        await check_streamed_prompt_logprobs_zero(client)
        # vLLM's refusals: streamed, the whole vocabulary
        for body, stream in (({"prompt_logprobs": 1}, True), ({"prompt_logprobs": -1}, False)):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                stream=stream, extra_body=body)
            assert info.value.body["param"] == "prompt_logprobs"


async def check_streamed_prompt_logprobs_zero(client) -> None:
    """``prompt_logprobs: 0`` streamed is served as vLLM serves it (its check refuses only
    more, or -1): the same stream as without, no prompt logprobs in any chunk (vLLM's chunks
    have no place for them), completions and chat."""
    for extra in ({"prompt_logprobs": 0}, {}):
        chunks = [c.model_dump() async for c in await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
            extra_body=extra)]
        events = [c.model_dump() async for c in await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True,
            extra_body=extra)]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        content = "".join(e["choices"][0]["delta"]["content"] or "" for e in events
                          if e["choices"])
        if extra:
            with_zero = (text, content)
            assert not any("prompt_logprobs" in c or "prompt_logprobs" in c["choices"][0]
                           for c in chunks + events if c["choices"])
    assert with_zero == (text, content)


async def check_tokens_as_ids(client, prompt_ids: list[int], model: str = MODEL) -> None:
    """return_tokens_as_token_ids: logprobs' tokens are ``token_id:N``, the ids of the
    prompt (echo) and of the answer (as vLLM's test_return_token_ids checks them)."""
    body = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    done = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2,
        extra_body={**body, "prompt_logprobs": 1})
    choice = done.choices[0]
    spelled = [f"token_id:{t}" for t in choice.prompt_token_ids + choice.token_ids]
    assert choice.prompt_token_ids == prompt_ids and choice.logprobs.tokens == spelled
    for token, top in zip(spelled[1:], choice.logprobs.top_logprobs[1:]):
        # the chosen token's key first, as vLLM's (its test_return_tokens_as_ids reads it)
        assert next(iter(top)) == token and all(key.startswith("token_id:") for key in top)
    chunks = [c async for c in await client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=1, stream=True, extra_body=body)]
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_dump().get("token_ids")
                                                    or ())]
    content = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert ids and [e.token for e in content] == [f"token_id:{t}" for t in ids]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert all(a.token.startswith("token_id:") for e in content for a in e.top_logprobs)
    plain = await client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                            logprobs=0)
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


async def test_the_server_option_spells_tokens_as_ids_unless_a_request_says(model_dir):
    """vLLM's --return-tokens-as-token-ids: the default for a request that does not send
    ``return_tokens_as_token_ids`` (vLLM's test_return_tokens_as_ids runs both ways)."""
    from server.cli import build_parser, config_from_args

    args = build_parser().parse_args(["--return-tokens-as-token-ids"])
    with trio.fail_after(LIMIT):
        async with running_server(hf_config(model_dir),
                                  limits=config_from_args(args).limits) as url:
            client = client_of(url)
            done = await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                logprobs=1, extra_body={"return_token_ids": True})
            choice = done.choices[0]
            assert choice.logprobs.tokens == [
                f"token_id:{t}" for t in choice.prompt_token_ids + choice.token_ids]
            chat = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
            assert chat.choices[0].logprobs.content
            assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)
            plain = await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                extra_body={"return_tokens_as_token_ids": False})
            assert plain.choices[0].logprobs.tokens
            assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


async def test_the_sim_refuses_return_token_ids_by_name():
    async with running_server(EngineConfig(engine_options=dict(FAST_SIM))) as url:
        with pytest.raises(openai.BadRequestError) as info:
            await client_of(url).completions.create(
                model="sim", prompt="hi", max_tokens=2, extra_body={"return_token_ids": True})
    assert info.value.body["param"] == "return_token_ids"


async def test_truncate_prompt_tokens_keeps_the_side_asked(transformers_url, model_dir, tokenizer):
    # vLLM's test_completion_truncation_side_controls_prompt_truncation, and its chat
    ids = list(range(5, 13))
    chat_ids = chat_ids_of(tokenizer)
    with trio.fail_after(LIMIT):
        url = transformers_url
        client = client_of(url)
        for side, expected in ((None, ids[-4:]), ("left", ids[-4:]), ("right", ids[:4])):
            extra = {"return_token_ids": True, "truncate_prompt_tokens": 4}
            if side is not None:
                extra["truncation_side"] = side
            done = await client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                                   temperature=0, extra_body=extra)
            assert done.choices[0].prompt_token_ids == expected, side
            assert done.usage.prompt_tokens == 4
        chat = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=1, temperature=0,
            extra_body={"return_token_ids": True, "truncate_prompt_tokens": 3})
        assert chat.prompt_token_ids == chat_ids[-3:]
        # -1: the context less one token for the output, even for a prompt past it
        context = json.loads((model_dir / "config.json").read_text())[
            "max_position_embeddings"]
        done = await client.completions.create(
            model=MODEL, prompt=[7] * (context + 50), max_tokens=1, temperature=0,
            extra_body={"truncate_prompt_tokens": -1})
        assert done.usage.prompt_tokens == context - 1
        for extra, param in (({"truncate_prompt_tokens": context + 1},
                              "truncate_prompt_tokens"),
                             ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                             ({"truncate_prompt_tokens": 2, "truncation_side": "middle"},
                              "truncation_side")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                                extra_body=extra)
            error = refused.value.body
            assert error["param"] == param, error
            if extra["truncate_prompt_tokens"] == context + 1:  # (the worker's refusal)
                assert "cannot be greater than" in error["message"]
