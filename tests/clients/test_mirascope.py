"""mirascope 2 (``mirascope.llm``): its OpenAI provider registered with our base URL (a
model it does not know goes to chat completions), called with its defaults (no
``max_tokens``, issue 41), with a format in strict mode (``response_format``
``json_schema``), parsed, and in JSON mode (``json_object``: any object, which mirascope
finds by its braces; the model is not held to the schema, so the format takes any
object)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from .conftest import ASK, ENGINES, MODEL, in_thread, served
from tests.client_models import Booking

llm = pytest.importorskip("mirascope.llm")


class Anything(BaseModel):
    """Any JSON object."""

    model_config = ConfigDict(extra="allow")


def drive(url: str) -> None:
    llm.reset_provider_registry()
    llm.register_provider("openai", scope="openai/", base_url=url + "/v1", api_key="x")
    model = llm.Model("openai/" + MODEL)
    assert isinstance(model.call(ASK).text(), str)
    strict = model.call(ASK, format=llm.format(Booking, mode="strict"))
    assert isinstance(strict.parse(), Booking)
    json_mode = model.call(ASK, format=llm.format(Anything, mode="json"))
    assert isinstance(json_mode.parse(), Anything)


@pytest.mark.parametrize("engine", ENGINES)
async def test_mirascope(request, engine):
    async with served(request, engine) as url:
        await in_thread(drive, url)
