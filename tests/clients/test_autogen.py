"""autogen (``autogen-agentchat`` and ``autogen-ext[openai]``): an ``AssistantAgent`` on
``OpenAIChatCompletionClient`` with the client's defaults (no ``max_tokens``, issue 41),
``model_info`` given as for any model OpenAI does not list; and the client's structured
output (``json_output`` with a pydantic model: ``response_format`` ``json_schema``)."""

from __future__ import annotations

import pytest

from .conftest import ASK, ENGINES, MODEL, in_asyncio, served
from tests.client_models import Booking

agentchat = pytest.importorskip("autogen_agentchat.agents")
core_models = pytest.importorskip("autogen_core.models")
ext_openai = pytest.importorskip("autogen_ext.models.openai")

INFO = {"vision": False, "function_calling": True, "json_output": True,
        "structured_output": True, "family": "unknown"}


async def drive(url: str) -> None:
    client = ext_openai.OpenAIChatCompletionClient(model=MODEL, base_url=url + "/v1",
                                                   api_key="x", model_info=INFO)
    try:
        result = await agentchat.AssistantAgent("booker", model_client=client).run(task=ASK)
        assert isinstance(result.messages[-1].content, str)
        ask = [core_models.UserMessage(content=ASK, source="user")]
        created = await client.create(ask, json_output=Booking)
        Booking.model_validate_json(created.content)
    finally:
        await client.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_autogen(request, engine):
    async with served(request, engine) as url:
        await in_asyncio(drive, url)
