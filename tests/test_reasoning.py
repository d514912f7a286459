"""The reasoning splitter (sans-IO): every way of cutting an output into pieces gives the
same reasoning and content as the whole text at once."""

from __future__ import annotations

import random

import pytest

from server.openai.reasoning import ReasoningSplitter

#: (parser, model output, expected reasoning, expected content)
CASES = [
    ("qwen3", "<think>Let me see: 2+2.</think>It is 4.", "Let me see: 2+2.", "It is 4."),
    ("qwen3", "\n<think>\nhmm 日本 🙂\n</think>\n\nAnswer ✨", "\nhmm 日本 🙂\n", "\n\nAnswer ✨"),
    ("qwen3", "No thinking here, <think> is just text.", "", "No thinking here, <think> is just text."),
    ("qwen3", "<think></think>Direct.", "", "Direct."),
    ("qwen3", "<think>never closed </thi", "never closed </thi", ""),
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "a < b and </think> c", "", "a < b and </think> c"),
    ("deepseek_r1", "First, think.</think>Done.", "First, think.", "Done."),
    ("deepseek_r1", "<think>Again.</think> Done </think>", "Again.", " Done </think>"),
    ("deepseek_r1", "All reasoning, no end", "All reasoning, no end", ""),
    ("deepseek_r1", "</think>", "", ""),
]


def split(parser: str, pieces: list[str]) -> tuple[str, str]:
    s = ReasoningSplitter.for_parser(parser)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = s.feed(piece)
        reasoning += r
        content += c
    r, c = s.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_every_split_gives_the_whole_texts_parse(parser, text, reasoning, content):
    assert split(parser, [text]) == (reasoning, content)
    assert split(parser, list(text)) == (reasoning, content)  # character by character
    for cut in range(len(text) + 1):
        assert split(parser, [text[:cut], text[cut:]]) == (reasoning, content), cut
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert split(parser, pieces) == (reasoning, content), pieces


def test_nothing_is_released_that_might_be_a_tag():
    s = ReasoningSplitter.for_parser("qwen3")
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>ok </th") == ("ok ", "")
    assert s.feed("ink>yes") == ("", "yes")


async def test_reasoning_content_over_http_streaming_and_not():
    import openai

    from server.config import EngineConfig
    from tests.conftest import FAST_SIM, running_server

    config = EngineConfig(engine_options={**FAST_SIM, "reasoning_tokens": 3})
    async with running_server(config, reasoning_parser="qwen3") as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chat = [{"role": "user", "content": "why"}]
        r = await client.chat.completions.create(model="sim", messages=chat, max_tokens=8, seed=1)
        message = r.choices[0].message
        assert len(message.reasoning_content.split()) == 3  # the sim's three thinking words
        assert message.reasoning == message.reasoning_content  # vLLM 0.32's name, the old one
        assert "<think>" not in message.content and "</think>" not in message.content
        assert len(message.content.split()) == 3  # 8 tokens: 2 tags, 3 thinking, 3 answer
        stream = await client.chat.completions.create(
            model="sim", messages=chat, max_tokens=8, seed=1, stream=True
        )
        thought, said = "", ""
        async for chunk in stream:
            for choice in chunk.choices:
                thought += getattr(choice.delta, "reasoning", None) or ""
                assert getattr(choice.delta, "reasoning", None) == getattr(
                    choice.delta, "reasoning_content", None)
                said += choice.delta.content or ""
        assert (thought, said) == (message.reasoning_content, message.content)
        # The completions route is not a chat: its text is the model's, tags and all.
        r = await client.completions.create(model="sim", prompt="why", max_tokens=8, seed=1)
        assert r.choices[0].text.startswith("<think>")


async def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_answer():
    import openai

    from server.config import EngineConfig
    from tests.conftest import FAST_SIM, running_server

    config = EngineConfig(engine_options={**FAST_SIM, "reasoning_tokens": 3})
    async with running_server(config, reasoning_parser="qwen3") as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chat = {"model": "sim", "messages": [{"role": "user", "content": "why"}],
                "max_tokens": 8, "seed": 1}
        full = (await client.chat.completions.create(**chat)).choices[0].message
        r = await client.chat.completions.create(**chat, extra_body={"include_reasoning": False})
        message = r.choices[0].message
        assert full.reasoning and not message.reasoning and not message.reasoning_content
        assert message.content == full.content
        stream = await client.chat.completions.create(
            **chat, stream=True, extra_body={"include_reasoning": False})
        thought, said = "", ""
        async for chunk in stream:
            for choice in chunk.choices:
                thought += getattr(choice.delta, "reasoning", None) or ""
                said += choice.delta.content or ""
        assert (thought, said) == ("", full.content)
        with pytest.raises(openai.BadRequestError, match="include_reasoning"):
            await client.chat.completions.create(**chat, extra_body={"include_reasoning": "no"})
