"""llama-index's OpenAI-like LLM (``llama-index-llms-openai-like``): its defaults (a
completion model: ``complete`` on /v1/completions; no ``max_tokens``, issue 41), ``chat``
as a chat model, and ``structured_predict``, which for a model that llama-index does not
know to take a JSON schema forces a call (``tool_choice: required``) to a tool whose
arguments are the output."""

from __future__ import annotations

import pytest

from .conftest import ASK, ENGINES, MODEL, in_thread, served
from tests.client_models import Booking

openai_like = pytest.importorskip("llama_index.llms.openai_like")
llms = pytest.importorskip("llama_index.core.llms")
prompts = pytest.importorskip("llama_index.core.prompts")


def drive(url: str) -> None:
    plain = openai_like.OpenAILike(model=MODEL, api_base=url + "/v1", api_key="x")
    assert isinstance(plain.complete(ASK).text, str)
    chat = openai_like.OpenAILike(model=MODEL, api_base=url + "/v1", api_key="x",
                                  is_chat_model=True, is_function_calling_model=True)
    said = chat.chat([llms.ChatMessage(role="user", content=ASK)])
    assert isinstance(said.message.content, str)
    booking = chat.structured_predict(Booking, prompts.PromptTemplate("{ask}"), ask=ASK)
    assert isinstance(booking, Booking)


@pytest.mark.parametrize("engine", ENGINES)
async def test_llama_index(request, engine):
    async with served(request, engine) as url:
        await in_thread(drive, url)
