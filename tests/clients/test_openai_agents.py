"""openai-agents (https://openai.github.io/openai-agents-python): an agent with a function
tool and a structured ``output_type``, run and streamed, over the Responses API (its
default) and over chat completions.

The first turn forces the tool (``ModelSettings(tool_choice=...)``, the grammar writes a
valid call), the SDK runs it and sends the call and its output back; it then resets the
tool choice to ``auto`` and the model answers with the output type. With ``auto`` and a
format, the grammar lets the model call again or write the document (docs/api.md; on chat
completions too since issue 41, item 5), which the random model decides: the run ends with
the document or with too many turns, and either way every turn was served.

An agent with the SDK's defaults (no model settings: no ``max_tokens``, issue 41) answers
in text."""

from __future__ import annotations

import pytest

from .conftest import ASK, MODEL, in_asyncio, serving
from tests.client_models import Booking, Guest

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")


async def run_agent(url: str, api: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    if api == "responses":
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    config = agents.RunConfig(tracing_disabled=True)
    default = await agents.Runner.run(agents.Agent(name="talk", model=model), ASK,
                                      run_config=config)
    assert isinstance(default.final_output, str)

    calls: list[Booking] = []

    @agents.function_tool
    def book(booking: Booking) -> str:
        """Book a room."""
        calls.append(booking)
        return "booked"

    settings = agents.ModelSettings(tool_choice="book", max_tokens=300, temperature=0)
    agent = agents.Agent(name="booker", instructions="You book rooms.", model=model,
                         tools=[book], output_type=Guest, model_settings=settings)
    for streamed in (False, True):
        calls.clear()
        try:
            if streamed:
                result = agents.Runner.run_streamed(agent, ASK, max_turns=3, run_config=config)
                events = [e.type async for e in result.stream_events()]
                assert "raw_response_event" in events
            else:
                result = await agents.Runner.run(agent, ASK, max_turns=3, run_config=config)
        except agents.MaxTurnsExceeded:
            pass  # (see the module's docstring)
        else:
            assert isinstance(result.final_output, Guest)
        assert calls and all(isinstance(c, Booking) for c in calls)
    # no tools: the output type alone, forced by the format
    plain = agents.Agent(name="guest", model=model, output_type=Guest,
                         model_settings=agents.ModelSettings(max_tokens=100, temperature=0))
    result = await agents.Runner.run(plain, ASK, run_config=config)
    assert isinstance(result.final_output, Guest)
    # plain text, streamed: cut at max_tokens (the random model writes no end), which the
    # SDK reports on Responses as a model behaviour error (response.incomplete)
    text = agents.Agent(name="talk", model=model,
                        model_settings=agents.ModelSettings(max_tokens=20, temperature=0))
    result = agents.Runner.run_streamed(text, ASK, run_config=config)
    deltas: list[str] = []
    try:
        async for e in result.stream_events():
            if e.type == "raw_response_event" and e.data.type == "response.output_text.delta":
                deltas.append(e.data.delta)
    except agents.ModelBehaviorError as exc:
        assert api == "responses" and "max_output_tokens" in str(exc)
    else:
        assert "".join(deltas) == result.final_output
    assert deltas


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_agent_with_a_tool_and_an_output_type(model_dir, api):
    async with serving(model_dir) as url:
        await in_asyncio(run_agent, url, api)
