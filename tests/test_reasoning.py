"""The reasoning splitter (sans-IO): every way of cutting an output into pieces gives the
same reasoning and content as the whole text at once."""

from __future__ import annotations

import random

import pytest

from server.openai.reasoning import ReasoningSplitter

#: (parser, model output, expected reasoning, expected content); "qwen3:off": the request
#: turned thinking off (chat_template_kwargs.enable_thinking: false).
CASES = [
    ("qwen3", "<think>Let me see: 2+2.</think>It is 4.", "Let me see: 2+2.", "It is 4."),
    ("qwen3", "\n<think>\nhmm 日本 🙂\n</think>\n\nAnswer ✨", "\nhmm 日本 🙂\n", "\n\nAnswer ✨"),
    # vLLM 0.32's qwen3: the output starts in reasoning (the template may open <think>)
    ("qwen3", "No end tag, <think> is just text.", "No end tag, <think> is just text.", ""),
    ("qwen3", "opened by the template</think>Answer", "opened by the template", "Answer"),
    ("qwen3", "<think></think>Direct.", "", "Direct."),
    ("qwen3", "<think>never closed </thi", "never closed </thi", ""),
    ("qwen3", "<thin", "<thin", ""),
    ("qwen3", "a < b and </think> c", "a < b and ", " c"),
    # a tool call ends the thinking, and stays in the content for the tool parser
    ("qwen3", "I will call.<tool_call>{}</tool_call>", "I will call.", "<tool_call>{}</tool_call>"),
    ("qwen3", "<think>a</think>b<tool_call>x", "a", "b<tool_call>x"),
    ("qwen3", "<think>a <tool_call> is mentioned</think>b", "a <tool_call> is mentioned", "b"),
    ("qwen3", "a <tool_cal", "a <tool_cal", ""),
    ("qwen3:off", "No <think> here</think>", "", "No <think> here</think>"),
    ("qwen3:off", "<tool_call>{}</tool_call>", "", "<tool_call>{}</tool_call>"),
    ("deepseek_r1", "First, think.</think>Done.", "First, think.", "Done."),
    ("deepseek_r1", "<think>Again.</think> Done </think>", "Again.", " Done </think>"),
    ("deepseek_r1", "All reasoning, no end", "All reasoning, no end", ""),
    ("deepseek_r1", "</think>", "", ""),
    ("deepseek_r1", "x<tool_call>y", "x<tool_call>y", ""),
]


def split(parser: str, pieces: list[str]) -> tuple[str, str]:
    name, _, off = parser.partition(":")
    s = ReasoningSplitter.for_parser(name, thinking=not off)
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("reasoning") / "tiny")


async def test_qwen3_output_starts_in_reasoning_unless_the_request_turns_thinking_off(model_dir):
    # vLLM 0.32's qwen3 parser: an answer without </think> is all reasoning (the template
    # may have opened <think> in the prompt); with enable_thinking: false, all content.
    # The tiny model writes no tags, so its whole answer lands on one side or the other.
    import openai
    import trio

    from server.config import EngineConfig
    from tests.conftest import running_server

    config = EngineConfig(engine="transformers", drain_timeout=5.0,
                          engine_options={"model_path": str(model_dir), "num_threads": 1})
    with trio.fail_after(120):
        async with running_server(config, reasoning_parser="qwen3") as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            model = (await client.models.list()).data[0].id
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 6, "temperature": 0}
            off = {"chat_template_kwargs": {"enable_thinking": False}}
            on = (await client.chat.completions.create(**chat)).choices[0].message
            said = (await client.chat.completions.create(**chat, extra_body=off)).choices[0]
            assert on.reasoning and not on.content
            assert said.message.content == on.reasoning and not said.message.reasoning
            for extra, want in (({}, (on.reasoning, "")), (off, ("", on.reasoning))):
                stream = await client.chat.completions.create(**chat, stream=True,
                                                              extra_body=extra)
                thought, text = "", ""
                async for chunk in stream:
                    for choice in chunk.choices:
                        thought += getattr(choice.delta, "reasoning", None) or ""
                        text += choice.delta.content or ""
                assert (thought, text) == want, extra
