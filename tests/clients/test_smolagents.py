"""smolagents (https://huggingface.co/docs/smolagents): ``OpenAIServerModel`` called with
its defaults (no ``max_tokens``, issue 41), and a ``ToolCallingAgent``, which sends
``tool_choice: required`` over its tools and ``final_answer`` every step: which one the
random model calls is its choice, so the run ends with a final answer or at the step
limit (then smolagents asks for the answer without tools); either way each step's call
parsed. (Its prompts are long: ~3,500 tokens before the first step.)"""

from __future__ import annotations

import pytest

from .conftest import ASK, ENGINES, MODEL, in_thread, served

smolagents = pytest.importorskip("smolagents")


@smolagents.tool
def check_in(vip: bool) -> str:
    """Check a guest in (a flag: a random model's free strings run long).

    Args:
        vip: Whether the guest is a VIP.
    """
    return "checked in"


def drive(url: str) -> None:
    model = smolagents.OpenAIServerModel(model_id=MODEL, api_base=url + "/v1", api_key="x")
    said = model.generate([smolagents.ChatMessage(role="user", content=ASK)])
    assert isinstance(said.content, str)
    agent = smolagents.ToolCallingAgent(tools=[check_in], model=model, max_steps=1)
    agent.run(ASK)
    steps = [s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep)]
    calls = [c for s in steps for c in s.tool_calls or ()]
    assert calls
    for call in calls:
        assert call.name in ("check_in", "final_answer")
        assert isinstance(call.arguments, dict)


@pytest.mark.parametrize("engine", ENGINES)
async def test_smolagents(request, engine):
    async with served(request, engine) as url:
        await in_thread(drive, url)
