"""What real clients send (issue 29), each case as the client library sends it: the openai
SDK's ``pydantic_function_tool`` and ``.parse`` helpers (as instructor, pydantic-ai and
openai-agents build their requests), on the tiny random transformers model, whose output
the grammar forces.

The request-side checks run without a model; the end-to-end ones start one server each."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from server.config import Limits
from server.errors import ClientError
from server.openai import schema
from server.openai.tools import read_tools
from tests.client_models import Booking, Guest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

CHAT = [{"role": "user", "content": "Book a room for Ann."}]
#: Seconds for one end-to-end test: a transformers worker's start (torch, the grammar
#: setup) and a few forced calls of up to 300 tokens on one thread. A bound on failing, not
#: on speed (it was 120 s, and four of these failed in a suite run at a load average of 25).
LIMIT = 600
HF_INFO = {"engine": "transformers", "sampling": ["response_format", "tools"]}


class Node(BaseModel):
    """A recursive model: ``$ref: "#/$defs/Node"`` inside ``$defs.Node``."""

    label: Literal["x", "y"]
    children: list[Node] = Field(max_length=1)


def parse(body: dict, parser: str | None = "hermes"):
    return schema.parse_chat(json.dumps({"messages": CHAT, **body}).encode(), Limits(), "m",
                             HF_INFO, parser)


def refused(body: dict, parser: str | None = "hermes") -> ClientError:
    with pytest.raises(ClientError) as caught:
        parse(body, parser)
    assert caught.value.status == 400
    return caught.value


# -- 1. nested models in forced tool calls ---------------------------------------------------

OLD_STYLE = {"type": "function", "function": {"name": "old", "parameters": {
    "type": "object", "required": ["x", "next"],
    "properties": {"x": {"$ref": "#/definitions/X"},                    # a chain of refs,
                   "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},  # recursion to root
    "definitions": {"X": {"$ref": "#/definitions/Y"}, "Y": {"type": "integer"}}}}}


def test_forced_grammar_keeps_every_reference_resolvable():
    """Whatever the tool_choice, a call valid for the tool's own schema is valid for the
    grammar (jsonschema resolves the grammar's references as the engine does)."""
    tools = [openai.pydantic_function_tool(Booking), openai.pydantic_function_tool(Node),
             OLD_STYLE]
    lead = {"name": "Ann", "vip": True}
    calls = {
        "Booking": {"nights": 2, "lead": lead, "guests": [lead], "extra": None},
        "Node": {"label": "x", "children": [{"label": "y", "children": []}]},
        "old": {"x": 3, "next": {"x": 4, "next": None}},
    }
    for choice in ("required", *({"type": "function", "function": {"name": n}} for n in calls)):
        grammar = read_tools({"tools": tools, "tool_choice": choice}, "hermes").grammar
        for name, arguments in calls.items():
            call = [{"name": name, "arguments": arguments}]
            if choice == "required" or choice["function"]["name"] == name:
                jsonschema.validate(call, grammar)
            else:
                assert not jsonschema.Draft202012Validator(grammar).is_valid(call)
        bad = [{"name": "Booking", "arguments": {**calls["Booking"], "lead": {"name": "Eve"}}}]
        assert not jsonschema.Draft202012Validator(grammar).is_valid(bad)


@pytest.mark.parametrize("ref, why", [
    ("https://example.com/s.json", "another document"),
    ("#Anchor", "anchor"),
    ("#/$defs/Missing", "points to nothing"),
    ("#/anyOf/0", "points into a list"),
])
def test_references_the_grammar_cannot_follow_are_400s_naming_them(ref, why):
    params = {"type": "object", "properties": {"a": {"$ref": ref}}, "anyOf": [{}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    e = refused({"tools": tools, "tool_choice": "required"})
    assert e.param == "tools[0].function.parameters" and why in str(e) and ref in str(e)
    assert parse({"tools": tools}).tools.parse == "hermes"  # auto: rendered, not compiled
    e = refused({"response_format": {"type": "json_schema",
                                     "json_schema": {"name": "r", "schema": params}}})
    assert e.param == "response_format" and why in str(e)


# -- 3. response_format with a forced tool call --------------------------------------------


def test_a_forced_call_takes_precedence_over_response_format():
    """openai-agents sends ``response_format`` (its ``output_type``) with ``tools`` on every
    turn; with ``required`` or a named function, the call's grammar wins (as in vLLM)."""
    tool = openai.pydantic_function_tool(Node)
    fmt = {"type": "json_schema", "json_schema": {"name": "g", "schema": Guest.model_json_schema()}}
    for choice in ("required", {"type": "function", "function": {"name": "Node"}}):
        req = parse({"tools": [tool], "tool_choice": choice, "response_format": fmt})
        assert req.params.extra["response_format"] == {
            "type": "json_schema", "schema": req.tools.grammar, "origin": "tool_choice"}
    req = parse({"tools": [tool], "response_format": fmt})  # auto: calls or the document
    union = req.params.extra["response_format"]["schema"]
    assert union["anyOf"][1] == {"$ref": "#/$defs/document.format"}
    assert union["$defs"]["document.format"]["properties"] == Guest.model_json_schema()[
        "properties"]


torch = pytest.importorskip("torch")
# (a fixture: the tiny model, its template with tools)
from tests.test_tools import model_dir  # noqa: E402,F401


def hf_config(path):
    from server.config import EngineConfig

    return EngineConfig(engine="transformers", drain_timeout=5.0,
                        engine_options={"model_path": str(path), "num_threads": 1})


async def test_pydantic_tools_with_the_sdk_parse_helper(tools_url):
    """openai's ``pydantic_function_tool`` with a named choice and ``required`` (instructor's
    TOOLS mode, openai-agents' tools): the SDK parses the forced call into the model."""
    import trio


    tools = [openai.pydantic_function_tool(Booking), openai.pydantic_function_tool(Node)]
    with trio.fail_after(LIMIT):
        url = tools_url  # (tests/conftest.py's shared server: this model, hermes)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for choice in ({"type": "function", "function": {"name": "Booking"}}, "required"):
            r = await client.chat.completions.parse(
                model="tiny-tools", messages=CHAT, tools=tools, tool_choice=choice,
                max_tokens=300, temperature=0, parallel_tool_calls=False)
            assert r.choices[0].finish_reason == "tool_calls"
            (call,) = r.choices[0].message.tool_calls
            assert isinstance(call.function.parsed_arguments, (Booking, Node))


# -- 2. integers beyond 64 bits ----------------------------------------------------------------

BIG = 2**70 + 1  # legal JSON; msgpack packs 64 bits


async def test_integers_beyond_64_bits_pass_through_to_the_engine(tools_url):
    """The model may write integers of any length in a call's arguments, and agent clients
    (LangChain) send its call back on the next turn; schemas and template variables may
    hold them too. They reach the worker intact: the template renders them digit for digit
    (the prompt grows with them), and none is a 500."""
    import trio


    big_tool = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"enum": [BIG, 1]}}, "required": ["n"]}}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "count", "arguments": json.dumps({"n": BIG})}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    small = json.loads(json.dumps(history))
    small[1]["tool_calls"][0]["function"]["arguments"] = '{"n": 1}'
    with trio.fail_after(LIMIT):
        url = tools_url  # (tests/conftest.py's shared server: this model, hermes)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        usage = []
        for messages in (history, small):
            r = await client.chat.completions.create(
                model="tiny-tools", messages=messages, tools=[big_tool], max_tokens=1)
            usage.append(r.usage.prompt_tokens)
        assert usage[0] > usage[1]  # 22 digits against 1, both in the tools and history
        # forced, the schema becomes a grammar: xgrammar holds such integers as doubles
        with pytest.raises(openai.BadRequestError, match="64 bits") as caught:
            await client.chat.completions.create(
                model="tiny-tools", messages=CHAT, tools=[big_tool], tool_choice="required",
                max_tokens=60)
        assert caught.value.body["param"] == "tools[0].function.parameters"
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"const": BIG}}, "required": ["n"]}}}
        with pytest.raises(openai.BadRequestError, match="64 bits") as caught:
            await client.chat.completions.create(
                model="tiny-tools", messages=CHAT, response_format=fmt, max_tokens=60)
        assert caught.value.body["param"] == "response_format"
        fmt["json_schema"]["schema"]["properties"]["n"] = {"type": "integer", "default": BIG}
        r = await client.chat.completions.create(  # (a default is not compiled)
            model="tiny-tools", messages=CHAT, response_format=fmt, max_tokens=1,
            extra_body={"chat_template_kwargs": {"seed_like": BIG}})
        assert r.choices[0].finish_reason == "length"
        # hundreds of digits pass through to the worker intact too (the JSON parser's
        # 4,300-digit limit is tested in test_hostile_bodies)
        r = await client.chat.completions.create(
            model="tiny-tools", messages=CHAT, max_tokens=1,
            extra_body={"chat_template_kwargs": {"x": 10**400}})
        assert r.choices[0].finish_reason == "length"


async def test_agents_first_turn_without_a_tool_call_parser(model_dir):  # noqa: F811
    """openai-agents' first turn with a tool and an ``output_type``: ``tools``, a named
    ``tool_choice`` and ``response_format`` together, through the SDK's ``.parse`` (item 3),
    on a server without ``--tool-call-parser``: a forced call and the history need none,
    only ``auto`` does (item 4)."""
    import trio

    from tests.conftest import running_server

    tools = [openai.pydantic_function_tool(Booking)]
    named = {"type": "function", "function": {"name": "Booking"}}
    with trio.fail_after(LIMIT):
        async with running_server(hf_config(model_dir)) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            r = await client.chat.completions.parse(
                model="tiny-tools", messages=CHAT, response_format=Guest, tools=tools,
                tool_choice=named, max_tokens=300, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls"
            (call,) = r.choices[0].message.tool_calls
            assert isinstance(call.function.parsed_arguments, Booking)
            # the next turn: the call and its result in the history, the answer forced
            history = [*CHAT, r.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "booked"}]
            history[1].pop("parsed", None)
            for c in history[1]["tool_calls"]:
                c["function"].pop("parsed_arguments", None)
            r = await client.chat.completions.parse(
                model="tiny-tools", messages=history, response_format=Guest, tools=tools,
                tool_choice="none", max_tokens=100, temperature=0)
            assert isinstance(r.choices[0].message.parsed, Guest)
            assert r.usage.prompt_tokens > 1000  # the tools and the call were rendered
            r = await client.chat.completions.create(
                model="tiny-tools", messages=CHAT, tools=tools, tool_choice="required",
                max_tokens=300, temperature=0)
            assert Booking.model_validate_json(
                r.choices[0].message.tool_calls[0].function.arguments)
            with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as caught:
                await client.chat.completions.create(
                    model="tiny-tools", messages=CHAT, tools=tools, max_tokens=1)
            assert caught.value.body["param"] == "tools"


# -- 5. echo with token-id prompts (lm-eval's local-completions), GET /tokenizer_info ------------


async def test_lm_eval_loglikelihood_with_token_ids_and_tokenizer_info(model_dir):  # noqa: F811
    """lm-eval's ``local-completions`` asks for loglikelihoods with token-id prompts, ``echo``
    and ``logprobs: 1`` (its default ``tokenized_requests=True``): answered as the same
    prompt as text is, echo included; ``GET /tokenizer_info`` (behind its option) gives the
    chat template and special tokens it fetches."""
    import httpx
    import trio

    from tests.conftest import running_server
    from tests.tiny_model import CHAT_TEMPLATE, EOS

    text = "the quick brown fox jumps over the lazy dog"
    with trio.fail_after(LIMIT):
        async with running_server(hf_config(model_dir), enable_tokenizer_info=True) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            async with httpx.AsyncClient(base_url=url) as http:
                ids = (await http.post("/tokenize", json={"prompt": text})).json()["tokens"]
                info = (await http.get("/tokenizer_info")).json()
            assert info["chat_template"] == CHAT_TEMPLATE and info["eos_token"] == EOS
            assert isinstance(info["tokenizer_class"], str) and "vocab_file" not in info
            lm_eval = {"max_tokens": 1, "logprobs": 1, "temperature": 0, "seed": 1234,
                       "echo": True}
            by_text = await client.completions.create(model="tiny-tools", prompt=text, **lm_eval)
            by_ids = await client.completions.create(
                model="tiny-tools", prompt=[ids, ids[:3]], **lm_eval)
            first, short = by_ids.choices
            assert first.text == by_text.choices[0].text and first.text.startswith(text)
            assert first.logprobs.tokens == by_text.choices[0].logprobs.tokens
            # (batched with another prompt: float rounding differs in the last digits)
            assert first.logprobs.token_logprobs == pytest.approx(
                by_text.choices[0].logprobs.token_logprobs, abs=1e-3)
            assert len(first.logprobs.token_logprobs) == len(ids) + 1
            assert first.logprobs.token_logprobs[0] is None
            assert short.text.startswith(" ".join(text.split()[:1])) and len(
                short.logprobs.tokens) == 4
            # streaming, and echo without logprobs: the prompt's text first
            stream = await client.completions.create(
                model="tiny-tools", prompt=ids, **{**lm_eval, "logprobs": None}, stream=True)
            streamed = "".join([c.choices[0].text async for c in stream])
            assert streamed == first.text


async def test_tokenizer_info_is_off_by_default(server_url):
    import httpx

    async with httpx.AsyncClient(base_url=server_url) as http:
        assert (await http.get("/tokenizer_info")).status_code == 404


# The client libraries themselves (instructor, LangChain, ...): tests/clients.
