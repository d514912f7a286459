"""smolagents (https://huggingface.co/docs/smolagents): ``OpenAIServerModel`` called with
its defaults (no ``max_tokens``, issue 41), and a ``ToolCallingAgent``, which sends
``tool_choice: required`` over its tools and ``final_answer`` every step. (Its prompts are
long: ~3,500 tokens before the first step.)

The agent's requests carry a seed (:data:`SEED`), so that a run takes one path: it calls
``check_in``, reaches its step limit and then asks for the answer without tools, in ~50
tokens. Unseeded, the path was the random model's (CI failed on it): a ``final_answer``
whose answer (any JSON) ran for up to ~3,800 tokens (85 s on a loaded machine), or a final
answer beside other calls (6 runs in 40), which smolagents rightly refuses as the model's
error before it records the step's calls. The checks hold on every path (another torch
may take another): the step's answer holds ``tool_calls``, each, as smolagents parsed it,
one of the tools with valid arguments, and the step ends as smolagents' rules say for
those calls."""

from __future__ import annotations

import pytest

from .conftest import ASK, ENGINES, MODEL, in_thread, served

smolagents = pytest.importorskip("smolagents")

#: The agent's sampling seed: the path above on this test's model.
SEED = 0


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
    seeded = smolagents.OpenAIServerModel(model_id=MODEL, api_base=url + "/v1", api_key="x",
                                          seed=SEED)
    agent = smolagents.ToolCallingAgent(tools=[check_in], model=seeded, max_steps=1)
    answer = agent.run(ASK)
    step, *rest = [s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep)]
    # the server's calls (in tool_calls: smolagents would dig them out of the content too),
    # as smolagents parsed them (before it judged them)
    message = step.model_output_message
    assert message.raw.choices[0].message.tool_calls, (step.error, message)
    calls = message.tool_calls
    for call in calls:
        assert call.function.name in ("check_in", "final_answer"), call
        assert isinstance(call.function.arguments, dict), call  # JSON (else left a string)
        if call.function.name == "check_in":
            assert isinstance(call.function.arguments["vip"], bool), call
        else:
            assert list(call.function.arguments) == ["answer"], call
    names = [call.function.name for call in calls]
    if "final_answer" in names and len(calls) > 1:  # refused: "do not perform any other..."
        assert type(step.error) is smolagents.AgentExecutionError, step.error
    else:
        assert step.error is None, step.error
        assert [c.name for c in step.tool_calls] == names
        assert step.is_final_answer == (names == ["final_answer"])
    if step.is_final_answer:
        assert not rest
    else:  # the step limit: the answer asked for without tools
        (last,) = rest
        assert isinstance(last.error, smolagents.AgentMaxStepsError) and isinstance(answer, str)


@pytest.mark.parametrize("engine", ENGINES)
async def test_smolagents(request, engine):
    async with served(request, engine) as url:
        await in_thread(drive, url)
