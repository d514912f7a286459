"""pydantic-ai (https://ai.pydantic.dev): agents over the openai chat and Responses models,
with structured output in its tool mode (its default: a forced ``final_result`` call) and
its native mode (``response_format``), streamed, and a function tool.

With a function tool and a tool output, pydantic-ai sends ``tool_choice: required`` over
both tools: which one the random model calls is its choice, so the run ends with the output
or, after calling the tool every turn, at the request limit; either way each call was valid
and served. An agent with no model settings (no ``max_tokens``: issue 41) answers in
text."""

from __future__ import annotations

import pytest

from .conftest import ASK, MODEL, in_asyncio, serving
from tests.client_models import Booking, Guest

pydantic_ai = pytest.importorskip("pydantic_ai")
pytest.importorskip("pydantic_ai.models.openai")


async def run_agents(url: str) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    provider = OpenAIProvider(base_url=url + "/v1", api_key="x")
    settings = {"max_tokens": 300, "temperature": 0}
    calls: list[Guest] = []
    for cls in (OpenAIChatModel, OpenAIResponsesModel):
        model = cls(MODEL, provider=provider)
        assert isinstance((await Agent(model).run(ASK)).output, str)
        for output in (Booking, NativeOutput(Booking)):
            result = await Agent(model, output_type=output, model_settings=settings).run(ASK)
            assert isinstance(result.output, Booking), (cls, output)
            assert result.usage.output_tokens > 0
        async with Agent(model, output_type=Guest, model_settings=settings).run_stream(
                ASK) as streamed:
            partial = [g async for g in streamed.stream_output()]
        assert isinstance(partial[-1], Guest)
        text = await Agent(model, model_settings={**settings, "max_tokens": 10}).run(ASK)
        assert isinstance(text.output, str)

        calls.clear()
        agent = Agent(model, output_type=Booking, model_settings=settings)

        @agent.tool_plain
        def check_guest(guest: Guest) -> str:
            """Check a guest in."""
            calls.append(guest)
            return "checked in"

        try:
            result = await agent.run(ASK, usage_limits=UsageLimits(request_limit=3))
        except UsageLimitExceeded:
            assert calls  # (see the module's docstring)
        else:
            assert isinstance(result.output, Booking)
        assert all(isinstance(c, Guest) for c in calls)


async def test_pydantic_ai_agents(model_dir):
    async with serving(model_dir) as url:
        await in_asyncio(run_agents, url)
