"""outlines (https://dottxt-ai.github.io/outlines): its OpenAI model (``from_openai``)
called with its defaults (no ``max_tokens``, issue 41) and with a pydantic output type
(``response_format`` ``json_schema``); and its vLLM server model (``from_vllm``, the same
openai client), whose regex and context-free grammar (Lark, as outlines writes them) go
in vLLM's ``structured_outputs`` field."""

from __future__ import annotations

import re

import pytest

from .conftest import ASK, MODEL, in_thread, serving

outlines = pytest.importorskip("outlines")
openai = pytest.importorskip("openai")
types = pytest.importorskip("outlines.types")

from tests.client_models import Booking  # noqa: E402

DIGITS = r"[0-9]{2,4}"
GRAMMAR = '?start: "a" "b"+'


def drive(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    model = outlines.from_openai(client, MODEL)
    assert isinstance(model(ASK), str)
    Booking.model_validate_json(model(ASK, Booking))
    served = outlines.from_vllm(client, MODEL)
    assert re.fullmatch(DIGITS, served(ASK, types.Regex(DIGITS)))
    assert re.fullmatch("ab+", served(ASK, types.CFG(GRAMMAR), max_tokens=20))


async def test_outlines(model_dir):
    async with serving(model_dir) as url:
        await in_thread(drive, url)
