"""instructor (https://python.useinstructor.com): structured outputs through the openai
SDK, in the modes that need no model cooperation beyond the grammar: TOOLS (a named forced
call), TOOLS_STRICT, JSON_SCHEMA-style ``response_format`` (instructor's JSON_SCHEMA mode
sends OpenAI's ``json_schema``), ``create_partial`` (streaming) and
``create_with_completion``; and its default call (no ``max_tokens``, no ``temperature``,
no retries set: issue 41). (``create_iterable`` is served too, but its wrapper's ``tasks``
is optional: the random model may answer ``{}``, which instructor's stream parser then reads
as one empty item.)"""

from __future__ import annotations

import pytest

from .conftest import ASK, MODEL, in_thread, serving
from tests.client_models import Booking

instructor = pytest.importorskip("instructor")
openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": ASK}]
ARGS = {"model": MODEL, "messages": CHAT, "max_tokens": 300, "temperature": 0, "max_retries": 0}


def drive(url: str) -> None:
    default = instructor.from_openai(openai.OpenAI(base_url=url + "/v1", api_key="x"))
    booking = default.chat.completions.create(model=MODEL, messages=CHAT, response_model=Booking)
    assert isinstance(booking, Booking)

    raw = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(raw, mode=mode)
        booking, completion = client.chat.completions.create_with_completion(
            response_model=Booking, **ARGS)
        assert isinstance(booking, Booking), mode
        assert completion.choices[0].finish_reason in ("stop", "tool_calls"), mode
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(response_model=Booking, **ARGS))
    # the arguments as they grow: a partial an event (one, when the frontend read every
    # step at once on a busy machine)
    assert partials
    assert Booking.model_validate(partials[-1].model_dump())


async def test_instructor_modes(model_dir):
    async with serving(model_dir) as url:
        await in_thread(drive, url)
