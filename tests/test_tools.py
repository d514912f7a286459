"""Tool calling end to end: the request side (refusals are 400s naming the field, history
rendered), the sim engine's Hermes calls parsed over HTTP (streaming equals non-streaming,
nothing leaks into content), and on the tiny random transformers model ``tool_choice``
``required`` and named calls forced by the grammar, always valid for their schemas, read by
the openai SDK sync and async, streaming and not."""

from __future__ import annotations

import json

import pytest

from server.config import EngineConfig, Limits
from server.errors import ClientError
from server.openai import schema
from server.openai.tool_parsers import accumulate, parse_text
from tests.conftest import FAST_SIM, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object", "additionalProperties": False, "required": ["city", "unit"],
            "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                           "unit": {"enum": ["C", "F"]}},
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object", "additionalProperties": False, "required": ["nights", "guests"],
            "properties": {
                "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                "guests": {"type": "array", "minItems": 1, "maxItems": 3,
                           "items": {"type": "object", "additionalProperties": False,
                                     "required": ["name", "vip"],
                                     "properties": {"name": {"enum": ["Ann", "Bob", "日本"]},
                                                    "vip": {"type": "boolean"}}}},
            },
        },
    },
}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHAT = [{"role": "user", "content": "What is the weather in Paris? 🙂"}]
HISTORY = [
    *CHAT,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
]
HF_INFO = {"engine": "transformers", "sampling": ["response_format", "tools"]}


def parse(body: dict, info=HF_INFO, parser: str | None = "hermes"):
    return schema.parse_chat(json.dumps(body).encode(), Limits(), "m", info, parser)


def refused(body: dict, info=HF_INFO, parser: str | None = "hermes") -> ClientError:
    with pytest.raises(ClientError) as caught:
        parse({"messages": CHAT, **body}, info, parser)
    assert caught.value.status == 400
    return caught.value


def check_calls(calls, n=None) -> None:
    """Each call names a tool and its arguments validate against that tool's schema."""
    import jsonschema

    assert calls and (n is None or len(calls) == n)
    for call in calls:
        fn = call["function"] if isinstance(call, dict) else call.function.model_dump()
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


# -- the request side ----------------------------------------------------------------------------


def test_refusals_name_the_field():
    e = refused({"tools": TOOLS}, parser=None)
    assert e.param == "tools" and "--tool-call-parser" in str(e)
    e = refused({"tools": TOOLS, "tool_choice": "auto"}, parser=None)
    assert e.param == "tool_choice" and "--tool-call-parser" in str(e)
    # (required, named, none and the history need no parser: see test_clients.py)
    e = refused({"tools": TOOLS}, info={"engine": "x", "sampling": []})
    assert e.param == "tools" and "by the x engine" in str(e)
    assert refused({"tools": TOOLS, "tool_choice": {"type": "function",
                    "function": {"name": "nope"}}}).param == "tool_choice"
    assert refused({"tools": TOOLS, "tool_choice": "sometimes"}).param == "tool_choice"
    assert refused({"tool_choice": "required"}).param == "tool_choice"  # no tools
    assert refused({"tools": TOOLS, "parallel_tool_calls": "yes"}).param == "parallel_tool_calls"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    assert refused({"tools": [bad_tool]}).param == "tools[0].function.parameters"
    assert refused({"tools": [{"type": "function", "function": {"name": "a b"}}]}
                   ).param == "tools[0].function.name"
    assert refused({"tools": [WEATHER, WEATHER]}).param == "tools[1].function.name"
    assert refused({"tools": [{"type": "code"}]}).param == "tools[0]"
    e = refused({"tools": TOOLS, "tool_choice": "required"},
                info={"engine": "x", "sampling": ["tools"]})
    assert e.param == "tool_choice" and "x engine" in str(e)
    # tool calls in the history: only with an engine that renders tools, and arguments
    # must be a JSON object
    with pytest.raises(ClientError) as caught:
        parse({"messages": HISTORY}, info={"engine": "x", "sampling": []})
    assert caught.value.param == "messages[1].tool_calls" and "renders tools" in str(
        caught.value)
    broken = json.loads(json.dumps(HISTORY))
    broken[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ClientError) as caught:
        parse({"messages": broken})
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
    # the completions route has no tools
    with pytest.raises(ClientError) as caught:
        schema.parse_completion(json.dumps({"prompt": "x", "tools": TOOLS}).encode(),
                                Limits(), "m", HF_INFO)
    assert caught.value.param == "tools"


def test_tool_choice_modes_and_history():
    req = parse({"messages": HISTORY, "tools": TOOLS})
    assert req.tools.parse == "hermes" and req.tools.grammar is None
    wire = req.params.to_wire()
    assert wire["tools"][0]["function"]["name"] == "get_weather"
    assert "response_format" not in wire
    messages = req.prompts[0]["messages"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "C"}
    assert messages[2] == {"role": "tool", "content": "sunny, 21", "tool_call_id": "call_1"}
    assert parse({"messages": CHAT, "tools": TOOLS, "tool_choice": "none"}).tools.parse is None
    assert parse({"messages": CHAT, "tool_choice": "auto"}).tools is None
    req = parse({"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                 "parallel_tool_calls": False})
    assert req.tools.parse == "forced" and req.tools.grammar["maxItems"] == 1
    assert req.params.to_wire()["response_format"] == {
        "type": "json_schema", "schema": req.tools.grammar, "origin": "tool_choice"}
    named = parse({"messages": CHAT, "tools": TOOLS,
                   "tool_choice": {"type": "function", "function": {"name": "book"}}})
    assert named.tools.grammar["items"]["properties"]["name"] == {"enum": ["book"]}


# -- the sim engine's Hermes calls over HTTP -----------------------------------------------------


async def test_sim_tool_calls_over_http_streaming_and_not():
    import openai

    async with running_server(tool_call_parser="hermes") as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = await client.chat.completions.create(
            model="sim", messages=CHAT, tools=TOOLS, max_tokens=30, seed=3)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert list(arguments) == ["city"] and len(arguments["city"].split()) == 20
        stream = await client.chat.completions.create(  # two choices: a parser each
            model="sim", messages=CHAT, tools=TOOLS, max_tokens=30, seed=3, stream=True, n=2)
        content, calls, finish = ["", ""], [[], []], [None, None]
        async for chunk in stream:
            for c in chunk.choices:
                content[c.index] += c.delta.content or ""
                for d in c.delta.tool_calls or ():
                    assert d.index == 0
                    if d.id is not None:
                        assert d.function.arguments == "" and d.type == "function"
                        calls[c.index].append([d.function.name, ""])
                    else:
                        assert d.function.name is None
                        calls[c.index][d.index][1] += d.function.arguments
                finish[c.index] = c.finish_reason or finish[c.index]
        assert content == ["", ""] and finish == ["tool_calls", "tool_calls"]
        assert calls[0] == [[call.function.name, call.function.arguments]]
        assert calls[1][0][0] == "get_weather" and calls[1] != calls[0]
        # truncated by max_tokens: a call with the arguments so far, finish_reason length
        r = await client.chat.completions.create(
            model="sim", messages=CHAT, tools=TOOLS, max_tokens=8, seed=3)
        assert r.choices[0].finish_reason == "length"
        arguments = r.choices[0].message.tool_calls[0].function.arguments
        assert arguments.startswith('{"city": "') and len(arguments.split()) == 2  # one word
        # tool_choice none: rendered, never parsed; the call is content
        r = await client.chat.completions.create(
            model="sim", messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=30, seed=3)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content.startswith("<tool_call>")
        # required: the sim writes a call as a grammar forces one (get_weather's 'pattern'
        # it cannot build: book's smallest arguments; tests/test_tools_defaults.py has more)
        r = await client.chat.completions.create(
            model="sim", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=60)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls, 1)


async def test_auto_without_a_parser_is_refused_over_http():
    import openai

    config = EngineConfig(engine_options=dict(FAST_SIM))
    async with running_server(config) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as caught:
            await client.chat.completions.create(
                model="sim", messages=CHAT, tools=TOOLS, max_tokens=4)
        assert caught.value.body["param"] == "tools"
        # none, and the history, need no parser (the sim renders tools)
        r = await client.chat.completions.create(
            model="sim", messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert r.choices[0].message.tool_calls is None


# -- the transformers engine: grammar-forced calls on a random model -----------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tools") / "tiny-tools",
                            max_position_embeddings=4096)  # tools take ~800-1800 tokens


def test_forced_calls_are_always_valid_in_the_engine(model_dir):
    from server.openai.tools import read_tools
    from server.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine(model_path=str(model_dir), max_batch=8)
    rid = 0
    for choice in ("required", {"type": "function", "function": {"name": "book"}},
                   {"type": "function", "function": {"name": "get_weather"}}):
        for parallel in (True, False):
            tools = read_tools({"tools": TOOLS, "tool_choice": choice,
                                "parallel_tool_calls": parallel}, "hermes")
            fmt = {"type": "json_schema", "schema": tools.grammar}
            for seed in range(3):
                rid += 1
                engine.add(rid, {"messages": CHAT}, {
                    "max_tokens": 200, "temperature": 1.0, "seed": seed, "tools": TOOLS,
                    "response_format": fmt})
                text, finish = "", None
                while engine.next_deadline() is not None:
                    for out in engine.step(0.0):
                        text += out[1]
                        finish = out[3] or finish
                assert finish == "stop", text
                content, calls = parse_text("forced", text, parallel=parallel)
                assert content is None, text
                check_calls(calls, 1 if isinstance(choice, dict) or not parallel else None)
                if isinstance(choice, dict):
                    assert calls[0]["function"]["name"] == choice["function"]["name"]
    # the history renders through the model's template: calls as Hermes tags, results too
    ids = engine.encode({"messages": parse({"messages": HISTORY}).prompts[0]["messages"]},
                        None, TOOLS)
    text = engine.tokenizer.decode(ids)
    assert '"name": "book"' in text  # the tools, in the system line
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
            "</tool_call>") in text
    assert "<tool_response>sunny, 21</tool_response>" in text


async def test_forced_calls_over_http_with_the_sdk(tools_url):
    import openai
    import trio
    from openai.lib.streaming.chat import ChatCompletionStreamState

    named = {"type": "function", "function": {"name": "book"}}
    with trio.fail_after(60):
        url = tools_url  # (tests/conftest.py's shared server: this model, hermes)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for choice in ("required", named):
            r = await client.chat.completions.create(
                model="tiny-tools", messages=CHAT, tools=TOOLS, tool_choice=choice,
                max_tokens=200, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls"
            assert r.choices[0].message.content is None
            check_calls(r.choices[0].message.tool_calls)
            full = [(c.function.name, c.function.arguments)
                    for c in r.choices[0].message.tool_calls]
            # streaming: the SDK's own accumulation gives the same calls
            state = ChatCompletionStreamState()
            stream = await client.chat.completions.create(
                model="tiny-tools", messages=CHAT, tools=TOOLS, tool_choice=choice,
                max_tokens=200, temperature=0, stream=True)
            async for chunk in stream:
                state.handle_chunk(chunk)
            done = state.get_final_completion().choices[0]
            assert done.finish_reason == "tool_calls" and not done.message.content
            assert [(c.function.name, c.function.arguments)
                    for c in done.message.tool_calls] == full
        # the history with calls and results renders: more prompt tokens than without
        r1 = await client.chat.completions.create(
            model="tiny-tools", messages=CHAT, tools=TOOLS, max_tokens=1)
        r2 = await client.chat.completions.create(
            model="tiny-tools", messages=HISTORY, tools=TOOLS, max_tokens=1)
        assert r2.usage.prompt_tokens > r1.usage.prompt_tokens

        def sync_client() -> list:
            sync = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            r = sync.chat.completions.create(
                model="tiny-tools", messages=CHAT, tools=TOOLS, tool_choice=named,
                max_tokens=200, temperature=0.8, seed=4)
            calls: list = []
            for chunk in sync.chat.completions.create(
                    model="tiny-tools", messages=CHAT, tools=TOOLS, tool_choice=named,
                    max_tokens=200, temperature=0.8, seed=4, stream=True):
                for c in chunk.choices:
                    accumulate(calls, [d.model_dump(exclude_none=True)
                                       for d in c.delta.tool_calls or ()])
            return [r.choices[0].message.tool_calls, calls]

        whole, streamed = await trio.to_thread.run_sync(sync_client)
        check_calls(whole, 1)
        assert [c["function"]["arguments"] for c in streamed] == [
            c.function.arguments for c in whole]
