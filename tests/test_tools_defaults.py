"""What agent libraries send by default with tools (issue 41, items 5 and 8): ``tools``
with ``tool_choice: auto`` and a ``response_format`` (dspy's JSONAdapter) lets the model
choose a call or the document on chat as on Responses, on the sim and the transformers
engine; the sim forces calls for ``required`` and named functions (smolagents'
ToolCallingAgent) and ends an answer without ``max_tokens`` as a model does; Responses
echoes ``tool_choice: "auto"`` when no tools were sent."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import trio

from server.config import Limits
from server.errors import ClientError
from server.openai import schema
from server.openai.responses import parse_responses
from server.openai.tool_parsers import CALLS_OR_DOCUMENT
from server.workers.base import Rejected
from server.engines.sim.engine import SimEngine
from server.engines.sim.structured import Unbuildable, instance
from tests.client_models import Booking
from tests.conftest import running_server

#: The document of the tests: a bounded object (a random model always completes it).
ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"enum": ["yes", "no"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
#: A smolagents-style tool: plain typed parameters.
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "required": ["query", "limit"],
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
                   "lang": {"type": "string"}}}}}
#: A tool whose arguments the sim cannot build (a 'pattern'), and one it can.
CITY = {"type": "function", "function": {"name": "city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}}}}}
BOOK = openai.pydantic_function_tool(Booking)  # nested: $defs, $ref, anyOf with null
TOOLS = [CITY, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in [SEARCH, *TOOLS]}
CHAT = [{"role": "user", "content": "Book a room in Paris 🙂"}]
HF_INFO = {"engine": "transformers", "sampling": ["response_format", "tools"]}
#: Enough seeds that the sim draws both branches (its draws are a fixed function of the
#: seed: the outcome does not vary between runs).
SEEDS = range(12)


def _parse(body: dict):
    return schema.parse_chat(json.dumps({"messages": CHAT, **body}).encode(), Limits(), "m",
                             HF_INFO, "hermes")


def check_calls(calls) -> None:
    """Each call names a tool and its arguments validate against that tool's schema."""
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _check_call_or_document(message, finish: str | None) -> str:
    """A chat answer under tools + response_format is calls valid for their tools, or a
    document valid for ANSWER, never anything else; which one it is."""
    if message.tool_calls:
        assert finish == "tool_calls" and not message.content, message
        check_calls(message.tool_calls)
        return "call"
    assert finish == "stop", message
    jsonschema.validate(json.loads(message.content), ANSWER)
    return "document"


# -- the request side --------------------------------------------------------------------------


def test_auto_with_a_json_format_is_the_union_of_calls_and_document():
    req = _parse({"tools": TOOLS, "response_format": FORMAT})
    assert req.tools.parse == CALLS_OR_DOCUMENT and req.tools.grammar is None
    union = req.params.extra["response_format"]
    assert union["type"] == "json_schema"
    for branch in union["schema"]["anyOf"]:
        assert branch.get("type") == "array" or branch == {"$ref": "#/$defs/document.format"}
    assert union["schema"]["$defs"]["document.format"] == ANSWER
    assert set(union["schema"]["$defs"]) == {"document.format", "city", "Booking"}
    ann = {"name": "Ann", "vip": True}
    call = {"name": "Booking", "arguments": {"nights": 2, "lead": ann, "guests": [ann],
                                             "extra": None}}
    jsonschema.validate([call], union["schema"])
    jsonschema.validate({"answer": "no"}, union["schema"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"answer": "maybe"}, union["schema"])
    # json_object: any object is the document; parallel_tool_calls false: one call at most
    req = _parse({"tools": TOOLS, "response_format": {"type": "json_object"},
                  "parallel_tool_calls": False})
    union = req.params.extra["response_format"]["schema"]
    assert union["$defs"]["document.format"] == {"type": "object"}
    assert union["anyOf"][0]["maxItems"] == 1
    # vLLM's spelling too (its origin kept, for the engine's errors); a regex holds over
    # the whole answer, as in vLLM
    req = _parse({"tools": TOOLS, "structured_outputs": {"json": ANSWER}})
    assert req.tools.parse == CALLS_OR_DOCUMENT
    assert req.params.extra["response_format"]["origin"] == "structured_outputs"
    req = _parse({"tools": TOOLS, "structured_outputs": {"regex": "a+"}})
    assert req.tools.parse == "hermes" and req.params.extra["response_format"]["type"] == "regex"
    # required, named and none are as they were
    assert _parse({"tools": TOOLS, "tool_choice": "required",
                   "response_format": FORMAT}).tools.parse == "forced"
    none = _parse({"tools": TOOLS, "tool_choice": "none", "response_format": FORMAT})
    assert none.tools.parse is None
    assert none.params.extra["response_format"]["schema"] == ANSWER


#: Documents whose root may be an array: with tools (auto) an array answer would start as the
#: calls do ('[') and be read as calls, its content lost.
ARRAYS = [{"type": "array", "items": {"type": "string"}}, {}, {"properties": {}},
          {"anyOf": [{"type": "object"}, {"type": "array"}]}, {"type": ["array", "null"]},
          {"$ref": "#/$defs/L", "$defs": {"L": {"type": "array"}}},
          {"enum": [["a"], "b"]}, {"oneOf": [{"$ref": "#"}, {"type": "string"}]}]


def _array_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "list", "schema": schema}}


def test_a_document_that_may_be_an_array_is_refused_with_tools():
    """The calls and the document are told apart by the first character ('[': calls), so
    with tools (auto) a document whose root may be an array is a 400 naming the format
    (parse_text would read ``["a","b"]`` as calls and lose it), whatever spells it; an
    array root with tool_choice none or required, or without tools, is as it was, and so
    are roots that are never arrays."""
    for document in ARRAYS:
        with pytest.raises(ClientError, match="may be a JSON array") as caught:
            _parse({"tools": TOOLS, "response_format": _array_format(document)})
        assert caught.value.param == "response_format"
    with pytest.raises(ClientError) as caught:
        _parse({"tools": TOOLS, "structured_outputs": {"json": {"type": "array"}}})
    assert caught.value.param == "structured_outputs"
    for body in ({"tool_choice": "none", "tools": TOOLS}, {"tool_choice": "required",
                                                            "tools": TOOLS}, {}):
        _parse({"response_format": _array_format(ARRAYS[0]), **body})
    for document in ({"type": "string"}, {"const": {"a": 1}}, {"enum": ["a", None]},
                     {"anyOf": [{"type": "object"}, {"$ref": "#/$defs/S"}],
                      "$defs": {"S": {"type": ["string", "null"]}}},
                     {"allOf": [{}, {"type": "object"}]}):
        _parse({"tools": TOOLS, "response_format": _array_format(document)})


def test_responses_echoes_auto_without_tools():
    """OpenAI echoes ``tool_choice: "auto"`` whether or not tools were sent."""
    for body in ({"input": "hi"}, {"input": "hi", "tools": [{"type": "function", "name": "f"}]}):
        req = parse_responses(json.dumps(body).encode(), Limits(), "m", HF_INFO, "hermes")
        assert req.echo["tool_choice"] == "auto"
    req = parse_responses(b'{"input": "hi", "tool_choice": "none"}', Limits(), "m", HF_INFO)
    assert req.echo["tool_choice"] == "none"


# -- the sim's instances of a schema -----------------------------------------------------------


def _first(n: int) -> int:
    return 0


def _counter(start: int):
    """A ``pick`` that counts up from ``start``."""
    state = [start]

    def pick(n: int) -> int:
        state[0] += 1
        return state[0] % n

    return pick


def test_the_sims_instances_validate():
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        name: str = Field(min_length=2, max_length=5)
        tags: list[str] = Field(min_length=2)
        price: float = Field(gt=1.5, le=9)
        count: int = Field(ge=3, multiple_of=2)
        note: str | None = None

    class Order(BaseModel):
        items: list[Item] = Field(min_length=1)
        kind: str = Field(json_schema_extra={"enum": ["a", "b"]})
        when: str = Field(json_schema_extra={"format": "date-time"})
        flag: bool

    schemas = [Order.model_json_schema(), ANSWER, {}, {"type": ["null", "string"]},
               {"type": "number", "exclusiveMaximum": -2.5}, {"const": [1, 2]},
               {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2,
                "items": {"type": "boolean"}},
               {"type": "object", "minProperties": 2, "properties": {"a": {}, "b": {}}},
               {"anyOf": [{"type": "string", "pattern": "x"}, {"type": "integer"}]}]
    for s in schemas:
        for seed in range(4):
            jsonschema.validate(instance(s, _counter(seed)), s)
    assert instance(SEARCH["function"]["parameters"], _first) == {"query": "", "limit": 1}
    for bad, word in [({"type": "string", "pattern": "^a$"}, "pattern"),
                      ({"type": "string", "format": "ipv5"}, "ipv5"),
                      ({"not": {}}, "not"),
                      ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems"),
                      ({"type": "integer", "minimum": 1, "maximum": 0}, "bounds"),
                      ({"$ref": "#"}, "deeper"),
                      ({"type": "array", "minItems": 2, "uniqueItems": True}, "uniqueItems")]:
        with pytest.raises(Unbuildable, match=word):
            instance(bad, _first)


# -- the sim engine: formats, forced calls, an end of sequence ------------------------------------


def _run(engine: SimEngine, rid: int, params: dict, prompt=None) -> tuple[str, str, int]:
    engine.add(rid, prompt or {"messages": CHAT}, params)
    text, finish, tokens = "", None, 0
    while engine.next_deadline() is not None:
        for out in engine.step(1e9):
            text, finish, tokens = text + out[1], out[3] or finish, tokens + out[2]
    return text, finish, tokens


def test_the_sim_ends_an_answer_without_max_tokens_as_a_model_does():
    engine = SimEngine(itl_ms=0, ttft_ms=0, prefill_us_per_token=0)
    lengths = set()
    for seed in range(8):
        text, finish, n = _run(engine, seed, {"max_tokens": None, "seed": seed})
        assert finish == "stop" and 32 <= n < 32 + 225, (finish, n)
        assert _run(engine, 100 + seed, {"max_tokens": None, "seed": seed}) == (text, finish, n)
        lengths.add(n)
    assert len(lengths) > 1  # drawn per seed
    # greedy: the prompt decides; a limit is an exact length, ignore_eos runs to the context
    greedy = _run(engine, 20, {"max_tokens": None, "temperature": 0})
    assert greedy == _run(engine, 21, {"max_tokens": None, "temperature": 0})
    assert greedy[1] == "stop"
    assert _run(engine, 22, {"max_tokens": 300, "seed": 1})[1:] == ("length", 300)
    text, finish, n = _run(engine, 23, {"max_tokens": None, "seed": 1, "ignore_eos": True})
    assert finish == "length" and n == engine.max_model_len - len(
        "<|user|> Book a room in Paris 🙂\n<|assistant|>".split())
    # a Hermes call without max_tokens ends there too, closed
    text, finish, n = _run(engine, 24, {"max_tokens": None, "seed": 1, "tools": TOOLS})
    assert finish == "stop" and text.endswith("</tool_call>") and 32 <= n < 32 + 225


def test_the_sim_answers_formats_and_refuses_what_it_cannot_build():
    engine = SimEngine(itl_ms=0, ttft_ms=0, prefill_us_per_token=0)
    text, finish, _ = _run(engine, 1, {"max_tokens": None,
                                       "response_format": {"type": "json_object"}})
    assert (text, finish) == ("{}", "stop")
    fmt = {"type": "json_schema", "schema": SEARCH["function"]["parameters"]}
    assert _run(engine, 2, {"max_tokens": None, "response_format": fmt})[:2] == (
        '{"query":"","limit":1}', "stop")
    text, finish, n = _run(engine, 3, {"max_tokens": 2, "response_format": fmt})
    assert (text, finish, n) == ('{"query"', "length", 2)
    text, _, _ = _run(engine, 4, {"response_format": {"type": "choice", "choice": ["x", "y"]}})
    assert text in ("x", "y")
    for bad, word in [({"type": "regex", "regex": "a+", "origin": "structured_outputs"},
                       "structured_outputs: .* not a regex"),
                      ({"type": "json_schema", "schema": {"type": "string", "pattern": "a"},
                        "origin": "tool_choice"}, "tool_choice .*'pattern'")]:
        with pytest.raises(Rejected, match=word):
            engine.add(5, {"messages": CHAT}, {"response_format": bad})
    assert engine.next_deadline() is None


async def test_the_sim_forces_calls_and_chooses_with_a_format_over_http():
    """The sim with tools: required and named calls valid for their tools (smolagents
    sends required on every step); auto with a response_format gives calls for some seeds
    and the document for others, never anything else, streaming as not."""
    with trio.fail_after(120):
        async with running_server(tool_call_parser="hermes") as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            tools = [SEARCH, *TOOLS]
            for choice, name in [("required", None),
                                 ({"type": "function", "function": {"name": "Booking"}}, "Booking"),
                                 ({"type": "function", "function": {"name": "search"}},
                                  "search")]:
                for seed in range(3):
                    r = await client.chat.completions.create(
                        model="sim", messages=CHAT, tools=tools, tool_choice=choice, seed=seed)
                    assert r.choices[0].finish_reason == "tool_calls"
                    assert r.choices[0].message.content is None
                    check_calls(r.choices[0].message.tool_calls)
                    assert name in (None, r.choices[0].message.tool_calls[0].function.name)
            # city's 'pattern' the sim cannot build: a 400 naming the forced call
            with pytest.raises(openai.BadRequestError, match="tool_choice.*'pattern'"):
                await client.chat.completions.create(
                    model="sim", messages=CHAT, tools=TOOLS, tool_choice={
                        "type": "function", "function": {"name": "city"}})
            seen = set()
            for seed in SEEDS:
                r = await client.chat.completions.create(
                    model="sim", messages=CHAT, tools=TOOLS, response_format=FORMAT, seed=seed)
                kind = _check_call_or_document(r.choices[0].message, r.choices[0].finish_reason)
                seen.add(kind)
                stream = await client.chat.completions.create(
                    model="sim", messages=CHAT, tools=TOOLS, response_format=FORMAT, seed=seed,
                    stream=True)
                content, calls, finish = "", [], None
                async for chunk in stream:
                    for c in chunk.choices:
                        content += c.delta.content or ""
                        for d in c.delta.tool_calls or ():
                            if d.id is not None:
                                calls.append([d.function.name, ""])
                            calls[d.index][1] += d.function.arguments or ""
                        finish = c.finish_reason or finish
                assert finish == r.choices[0].finish_reason
                assert (content or None) == r.choices[0].message.content
                assert calls == [[c.function.name, c.function.arguments]
                                 for c in r.choices[0].message.tool_calls or ()]
            assert seen == {"call", "document"}
            # Responses: the same choice (its own path before; now chat's)
            r = await client.responses.create(
                model="sim", input="hi", tools=[{"type": "function", **SEARCH["function"]}],
                text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER}})
            assert r.output[0].type in ("function_call", "message")
            r = await client.responses.create(model="sim", input="hi")
            assert r.tool_choice == "auto" and r.status == "completed"


async def test_an_array_document_with_tools_is_a_400_over_http():
    """Tools (auto) and a document that may be an array: a 400 naming the format, on chat
    streaming and not and on Responses (before, the sim's array answer was read as calls:
    an empty answer); without tools the sim writes the array."""
    fmt = _array_format(ARRAYS[0])
    with trio.fail_after(120):
        async with running_server(tool_call_parser="hermes") as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError, match="may be a JSON array") as bad:
                    await client.chat.completions.create(
                        model="sim", messages=CHAT, tools=TOOLS, response_format=fmt,
                        seed=1, stream=stream)
                assert bad.value.body["param"] == "response_format"
            with pytest.raises(openai.BadRequestError, match="may be a JSON array") as bad:
                await client.responses.create(
                    model="sim", input="hi", tools=[{"type": "function", **SEARCH["function"]}],
                    text={"format": {"type": "json_schema", "name": "a", "schema": {}}})
            assert bad.value.body["param"] == "text.format"
            r = await client.chat.completions.create(model="sim", messages=CHAT,
                                                     response_format=fmt, seed=1)
            jsonschema.validate(json.loads(r.choices[0].message.content), ARRAYS[0])


# -- the transformers engine: the grammar's union, on a random model ----------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")


async def test_tools_and_a_format_let_the_model_call_or_answer(tools_server, tools_url):
    """On the transformers engine, tools + response_format: a logit bias on '[' makes the
    calls branch certain (a valid call, parsed into tool_calls), one on '{' the document;
    sampled across seeds, every answer is one or the other. On tests/conftest.py's
    ``tools_server`` (tests/test_tools.py's model, the hermes parser)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tools_server.model_dir))
    (bracket,) = tok.encode("[", add_special_tokens=False)
    (brace,) = tok.encode("{", add_special_tokens=False)
    body = {"model": "tiny-tools", "messages": CHAT, "tools": TOOLS, "response_format": FORMAT,
            "parallel_tool_calls": False, "max_tokens": 300}
    with trio.fail_after(600):
        url = tools_url  # (tests/conftest.py's shared server: this model, hermes)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for bias, kind in ((bracket, "call"), (brace, "document")):
            for seed in range(2):
                r = await client.chat.completions.create(
                    **body, seed=seed, logit_bias={str(bias): 100})
                assert _check_call_or_document(
                    r.choices[0].message, r.choices[0].finish_reason) == kind
                if kind == "call":
                    assert len(r.choices[0].message.tool_calls) == 1
        for seed in range(4):
            r = await client.chat.completions.create(**body, seed=seed, temperature=1.0)
            _check_call_or_document(r.choices[0].message, r.choices[0].finish_reason)
