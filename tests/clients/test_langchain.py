"""langchain-openai's ``ChatOpenAI``: ``invoke``, ``stream`` (with usage), ``bind_tools``
with a forced call and the call sent back on the next turn, ``with_structured_output`` in
its methods, and the default ``invoke`` (no ``max_tokens`` or ``temperature``: issue 41);
over chat completions and over the Responses API (``use_responses_api``)."""

from __future__ import annotations

import pytest

from .conftest import ASK, MODEL, in_thread, serving
from tests.client_models import Booking, Guest

langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")

BIG = 2**70 + 1  # the model may write integers of any length (issue 29, item 2)


def chat_model(url: str, **kw):
    return langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="x", model=MODEL,
                                       max_tokens=300, temperature=0, max_retries=0, **kw)


def drive(url: str, responses: bool) -> None:
    default = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="x", model=MODEL,
                                          use_responses_api=responses)
    assert isinstance(default.invoke(ASK).text, str)

    llm = chat_model(url, use_responses_api=responses)
    said = llm.invoke(ASK)
    assert isinstance(said.content, (str, list)) and said.usage_metadata["output_tokens"] > 0
    chunks = list(chat_model(url, use_responses_api=responses, stream_usage=True).stream(ASK))
    assert len(chunks) > 1
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert whole.text == said.text  # greedy: the same answer, streamed
    assert whole.usage_metadata["output_tokens"] == said.usage_metadata["output_tokens"]

    for choice in ("Booking", "any"):
        tooled = llm.bind_tools([Booking, Guest], tool_choice=choice)
        first = tooled.invoke([messages.HumanMessage(ASK)])
        (call,) = first.tool_calls[:1]
        assert call["name"] in ("Booking", "Guest")
        if call["name"] == "Booking":
            Booking.model_validate(call["args"])
            call["args"]["nights"] = BIG  # as if the model had written it (item 2)
        again = tooled.invoke([messages.HumanMessage(ASK), first,
                               messages.ToolMessage("booked", tool_call_id=call["id"])])
        assert again.tool_calls
    # a streamed forced call: the chunks' arguments add up to the call
    streamed = None
    for c in llm.bind_tools([Booking], tool_choice="Booking").stream(ASK):
        streamed = c if streamed is None else streamed + c
    Booking.model_validate(streamed.tool_calls[0]["args"])

    methods = ["json_schema", "function_calling"]
    for method in methods:
        out = llm.with_structured_output(Booking, method=method).invoke(ASK)
        assert isinstance(out, Booking), method
    raw = llm.with_structured_output(Booking, method="json_mode", include_raw=True).invoke(ASK)
    assert raw["raw"].content  # any JSON object (the model is not told the schema)


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
async def test_chat_openai(model_dir, responses):
    async with serving(model_dir) as url:
        await in_thread(drive, url, responses)
