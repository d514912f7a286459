"""The transformers engine's second grammar backend (server.engines.transformers.guidance): a JSON
schema with a keyword xgrammar would drop but llguidance enforces (pydantic's ``HttpUrl``:
``format: uri`` beside ``maxLength``) is served, on every path a schema reaches the grammar,
and every answer parses strictly and validates; one that neither enforces (pydantic's
``set[...]``: ``uniqueItems``) stays a 400 naming the keyword. Real worker processes on the
tiny model, through the HTTP server. (Resuming through an llguidance matcher:
tests/test_resume_engines.py.)"""

from __future__ import annotations

import json
import re
from typing import Annotated

import pytest

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

# Not skipped without it: the transformers extra installs llguidance (issue 41: it did not,
# and these tests skipped where the README's install had put transformers).
import llguidance  # noqa: E402, F401
import httpx  # noqa: E402
import trio  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, UrlConstraints  # noqa: E402

from server.engines.transformers.schema_check import unenforced  # noqa: E402
from tests.conftest import running_server  # noqa: E402
from tests.test_transformers_engine import LIMIT, MODEL, hf_config  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

SEEDS = range(3)
#: RFC 3986's scheme, then anything: jsonschema has no "uri" check without rfc3987 installed
URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:\S*")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a longer context than the default 256: a forced tool's schema is in the prompt
    return build_tiny_model(tmp_path_factory.mktemp("hf") / MODEL, max_position_embeddings=1024)


class Link(BaseModel):
    # HttpUrl's schema bounded to 40 characters, so the random model's URL ends in time (a
    # bare HttpUrl's 2083 runs to max_tokens): {"format": "uri", "maxLength": 40, ...}; the
    # other fields bounded for the same reason, and no other property (llguidance allows
    # any where the schema does not say, as JSON Schema does; xgrammar's path none)
    model_config = ConfigDict(extra="forbid")

    url: Annotated[HttpUrl, UrlConstraints(max_length=40)]
    title: str = Field(max_length=12)
    clicks: int = Field(ge=0, le=9999)


class Tagged(BaseModel):
    tags: set[str]


def requests_for(schema: dict) -> list[tuple[str, dict]]:
    """``(where the answer is, body)`` for each path a schema reaches the grammar."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a link"}],
            "max_tokens": 160, "temperature": 1.0}
    tool = {"type": "function", "function": {"name": "save", "parameters": schema,
                                             "strict": True}}
    return [
        ("content", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "link", "schema": schema, "strict": True}}}),
        ("content", {**chat, "structured_outputs": {"json": schema}}),
        ("arguments", {**chat, "tools": [tool], "tool_choice": {
            "type": "function", "function": {"name": "save"}}}),
    ]


def answer_of(choice: dict, where: str) -> str:
    if where == "content":
        assert choice["finish_reason"] == "stop", choice
        return choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "tool_calls"), choice
    return choice["message"]["tool_calls"][0]["function"]["arguments"]


async def test_schemas_xgrammar_would_drop_are_served_by_llguidance(model_dir):
    schema = Link.model_json_schema()
    assert "maxLength" in unenforced(schema)  # (xgrammar alone would refuse it)
    validator = jsonschema.Draft202012Validator(schema)
    answers = []
    with trio.fail_after(6 * LIMIT):  # a server, nine answers of up to 160 tokens
        async with running_server(hf_config(model_dir)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=3 * LIMIT) as http:
                for where, body in requests_for(schema):
                    for seed in SEEDS:
                        r = await http.post("/v1/chat/completions", json={**body, "seed": seed})
                        assert r.status_code == 200, r.text
                        answers.append(answer_of(r.json()["choices"][0], where))
    for text in answers:
        value = json.loads(text)  # strict: no raw control characters
        validator.validate(value)  # maxLength, types, required
        assert URI.fullmatch(value["url"]), value
    # the random model writes long strings: the URL's bound was reached, not just met
    assert max(len(json.loads(t)["url"]) for t in answers) > 20


async def test_a_keyword_neither_backend_enforces_stays_a_400_naming_it(model_dir):
    schema = Tagged.model_json_schema()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with trio.fail_after(3 * LIMIT):
        async with running_server(hf_config(model_dir)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
                for _, body in requests_for(schema):
                    r = await http.post("/v1/chat/completions", json={**chat, **{
                        k: v for k, v in body.items() if k not in chat}})
                    assert r.status_code == 400, r.text
                    message = r.json()["error"]["message"]
                    assert re.search(r"'uniqueItems' at #\S*/properties/tags is not enforced",
                                     message), message  # (a tool's is under #/$defs/save)
                    assert "llguidance" in message and "uniqueItems" in message.split(
                        "llguidance")[-1], message
                # a schema's own x-guidance cannot make llguidance lenient
                lenient = {**schema, "x-guidance": {"lenient": True}}
                r = await http.post("/v1/chat/completions", json={**chat, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "t", "schema": lenient}}})
                assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
