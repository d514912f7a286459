"""haystack (``haystack-ai``): ``OpenAIChatGenerator`` with its defaults (no generation
arguments: no ``max_tokens``, issue 41), a pydantic ``response_format`` (``json_schema``)
and a tool it must call (``tool_choice: required``)."""

from __future__ import annotations

import pytest

from .conftest import ASK, ENGINES, MODEL, in_thread, served
from tests.client_models import Booking, Guest

chat = pytest.importorskip("haystack.components.generators.chat")
dataclasses = pytest.importorskip("haystack.dataclasses")
tools = pytest.importorskip("haystack.tools")
utils = pytest.importorskip("haystack.utils")


def check_in(guest: Guest) -> str:
    """Check a guest in."""
    return "checked in"


def drive(url: str) -> None:
    generator = chat.OpenAIChatGenerator(api_key=utils.Secret.from_token("x"), model=MODEL,
                                         api_base_url=url + "/v1")
    ask = [dataclasses.ChatMessage.from_user(ASK)]
    (reply,) = generator.run(ask)["replies"]
    assert isinstance(reply.text, str)
    (reply,) = generator.run(ask, generation_kwargs={"response_format": Booking})["replies"]
    Booking.model_validate_json(reply.text)
    tool = tools.create_tool_from_function(check_in)
    (reply,) = generator.run(ask, tools=[tool],
                             generation_kwargs={"tool_choice": "required"})["replies"]
    assert reply.tool_calls  # one or more (parallel calls are the model's choice)
    for call in reply.tool_calls:
        assert call.tool_name == "check_in"
        Guest.model_validate(call.arguments["guest"])


@pytest.mark.parametrize("engine", ENGINES)
async def test_haystack(request, engine):
    async with served(request, engine) as url:
        await in_thread(drive, url)
