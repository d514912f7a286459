"""dspy (https://dspy.ai): our server declared to dspy as a vLLM-compatible provider
(``dspy.lm15.register_provider``, stating that its models take JSON schemas and tools, as
for any model dspy's catalogue does not list); ``dspy.LM`` called with dspy's defaults (no
``max_tokens``, no ``temperature``: issue 41); a ``Predict`` with its default adapter
(ChatAdapter, which falls back to the JSONAdapter when the random model's text has no
field markers) gets a parsed answer; a typed output through the JSONAdapter
(``response_format`` ``json_schema``); and native function calling through the
JSONAdapter, which sends ``tools`` (auto) with a ``response_format``: the model may call a
tool or write the document (issue 41, item 5), either parses."""

from __future__ import annotations

import os

import pytest

from .conftest import ASK, ENGINES, MODEL, in_thread, served
from tests.client_models import Booking, Guest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
dspy = pytest.importorskip("dspy")


class Book(dspy.Signature):
    """Book a room."""

    request: str = dspy.InputField()
    booking: Booking = dspy.OutputField()


class Act(dspy.Signature):
    """Book a room, with the tools or by answering."""

    request: str = dspy.InputField()
    tools: list[dspy.Tool] = dspy.InputField()
    tool_calls: dspy.ToolCalls = dspy.OutputField()


def check_in(guest: Guest) -> str:
    """Check a guest in."""
    return "checked in"


def drive(url: str) -> None:
    from dspy import lm15

    # (the vllm preset's own address, which the LM's api_base overrides)
    access = lm15.AccessPolicy(provider="trio-llm", env_keys=(),
                               base_url="http://localhost:8000/v1")
    lm15.register_provider(lm15.ProviderDefinition.chat(access, compat="vllm"),
                           supports=lm15.ModelSupport(function_calling=True,
                                                      response_schema=True))
    lm = dspy.LM("trio-llm/" + MODEL, api_base=url + "/v1", api_key="x", cache=False)
    (said,) = lm(ASK)
    assert isinstance(said, str)
    with dspy.context(lm=lm):
        answer = dspy.Predict("question -> answer")(question=ASK)
        assert isinstance(answer.answer, str)
        with dspy.context(adapter=dspy.JSONAdapter()):
            assert isinstance(dspy.Predict(Book)(request=ASK).booking, Booking)
            acted = dspy.Predict(Act)(request=ASK, tools=[dspy.Tool(check_in)])
        for call in acted.tool_calls.tool_calls if acted.tool_calls else ():  # or the document
            assert call.name == "check_in"
            Guest.model_validate(call.args["guest"])


@pytest.mark.parametrize("engine", ENGINES)
async def test_dspy(request, engine):
    async with served(request, engine) as url:
        await in_thread(drive, url)
