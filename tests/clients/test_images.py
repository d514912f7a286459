"""Images from the client libraries (issue 46), with nothing tuned: langchain-openai's
``ChatOpenAI`` (OpenAI's ``image_url`` parts and LangChain's own image blocks),
pydantic-ai's ``BinaryContent`` and ``ImageUrl`` over chat completions and the Responses
API, and openai-agents' ``input_image`` over the Responses API (its default).

The sim engine with ``--sim-image-tokens`` serves them: it counts each image as that many
prompt tokens and checks its bytes against their digest, so a library's image that
reached the worker shows in the usage the library reports. An http URL is served by the
test on loopback (listed, and private addresses let through)."""

from __future__ import annotations

import base64
import contextlib

import pytest
import trio

from .conftest import MODEL, in_asyncio, in_thread
from tests.test_images import RED, ImageServer, data_url

#: Prompt tokens the sim counts per image.
IMAGE_TOKENS = 7
ASK = "What is in the picture?"


@contextlib.asynccontextmanager
async def serving_images():
    """The sim serving :data:`MODEL` with images, and a loopback image server; yields
    ``(base URL, the image's http URL)``."""
    from server.config import EngineConfig
    from tests.conftest import FAST_SIM, running_server

    images = ImageServer(RED)
    config = EngineConfig(model=MODEL, engine_options={**FAST_SIM,
                                                       "image_tokens": IMAGE_TOKENS})
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(images.run)
            async with running_server(config, allowed_media_domains=("127.0.0.1",),
                                      allow_private_media_addresses=True) as url:
                yield url, images.url()
            nursery.cancel_scope.cancel()


def _langchain(url: str, image_url: str) -> list[int]:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage

    llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="x", model=MODEL,
                                      max_retries=0)
    b64 = base64.b64encode(RED).decode()
    contents = [
        ASK,
        [{"type": "text", "text": ASK}, {"type": "image_url", "image_url": {"url": data_url(RED)}}],
        [{"type": "text", "text": ASK}, {"type": "image", "base64": b64, "mime_type": "image/png"}],
        [{"type": "text", "text": ASK}, {"type": "image", "url": image_url}],
    ]
    return [llm.invoke([HumanMessage(content=c)]).usage_metadata["input_tokens"]
            for c in contents]


async def test_langchain_sends_images():
    pytest.importorskip("langchain_openai")
    async with serving_images() as (url, image_url):
        plain, *with_image = await in_thread(_langchain, url, image_url)
    assert with_image == [plain + IMAGE_TOKENS] * 3


async def _pydantic_ai(url: str, image_url: str) -> list[int]:
    from pydantic_ai import Agent, BinaryContent, ImageUrl
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=url + "/v1", api_key="x")
    counts = []
    for cls in (OpenAIChatModel, OpenAIResponsesModel):
        agent = Agent(cls(MODEL, provider=provider))
        for prompt in (ASK, [ASK, BinaryContent(data=RED, media_type="image/png")],
                       [ASK, ImageUrl(url=image_url)]):
            counts.append((await agent.run(prompt)).usage.input_tokens)
    return counts


async def test_pydantic_ai_sends_images():
    pytest.importorskip("pydantic_ai.models.openai")
    async with serving_images() as (url, image_url):
        chat_plain, *chat, responses_plain, r1, r2 = await in_asyncio(_pydantic_ai, url,
                                                                      image_url)
    assert chat == [chat_plain + IMAGE_TOKENS] * 2
    assert [r1, r2] == [responses_plain + IMAGE_TOKENS] * 2


async def _openai_agents(url: str, image_url: str) -> list[int]:
    import agents
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(name="look", model=agents.OpenAIResponsesModel(
        model=MODEL, openai_client=client))
    config = agents.RunConfig(tracing_disabled=True)
    counts = []
    for image in (None, data_url(RED), image_url):
        content: list = [{"type": "input_text", "text": ASK}]
        if image is not None:
            content.append({"type": "input_image", "image_url": image, "detail": "auto"})
        result = await agents.Runner.run(agent, [{"role": "user", "content": content}],
                                         run_config=config)
        counts.append(result.context_wrapper.usage.input_tokens)
    return counts


async def test_openai_agents_sends_images():
    pytest.importorskip("agents")
    async with serving_images() as (url, image_url):
        plain, *with_image = await in_asyncio(_openai_agents, url, image_url)
    assert with_image == [plain + IMAGE_TOKENS] * 2
