"""``POST /v1/responses`` end to end with the openai SDK: text, function calls (the sim's
Hermes calls; on the tiny transformers model, calls forced by tool_choice and json_schema
output by text.format), streaming and not, the event sequence, the refusals (400s naming
the Responses field), an engine failure after the first byte (``response.failed``), and a
client that goes away mid-stream (the worker's request aborted, nothing left)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import trio

from server.config import EngineConfig, Limits
from server.errors import ClientError
from server.openai.responses import parse_responses
from server.openai.tool_parsers import CALLS_OR_DOCUMENT
from server.openai.responses_events import ResponseEvents, new_response, response_usage
from tests.conftest import FAST_SIM, assert_engine_idle, running_server
from tests.test_http_cancellation import open_request, read_until

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                       "unit": {"enum": ["C", "F"]}},
    },
}
HF_INFO = {"engine": "transformers", "sampling": ["response_format", "tools"]}
LIMITS = Limits()


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def refused(body: dict, info=HF_INFO, parser: str | None = "hermes") -> ClientError:
    with pytest.raises(ClientError) as caught:
        parse_responses(json.dumps(body).encode(), LIMITS, "m", info, parser)
    return caught.value


def check_sequence(events: list) -> None:
    """Numbered from 0; each item's events name its output_index and id, between its
    ``added`` and its ``done``, one item at a time."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    items: list = []
    open_item = None
    for e in events:
        if e.type == "response.output_item.added":
            assert open_item is None and e.output_index == len(items)
            items.append(e.item.id)
            open_item = e.item.id
        elif e.type == "response.output_item.done":
            assert e.item.id == open_item and e.output_index == len(items) - 1
            open_item = None
        elif hasattr(e, "output_index"):
            assert e.output_index == len(items) - 1 and e.item_id == open_item
    assert [o.id for o in events[-1].response.output] == items


# -- the translation (sans-IO) -------------------------------------------------------------------


def test_input_items_become_chat_messages():
    req = parse_responses(json.dumps({
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                         {"type": "input_text", "text": "in Paris?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris", "unit": "C"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 50,
    }).encode(), LIMITS, "m", HF_INFO, "hermes")
    messages = req.prompts[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "Weather in Paris?"
    assert messages[2]["content"] == "Let me look."  # the call joins its turn's message
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "C"}
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert "reasoning_content" not in messages[2]
    assert req.params.max_tokens == 50 and req.chat.tools.parse == "forced"
    assert req.echo["tool_choice"] == {"type": "function", "name": "get_weather"}


THOUGHT = {"type": "reasoning", "id": "rs_1", "summary": [],
           "content": [{"type": "reasoning_text", "text": "Paris, so Celsius."}]}
TURN = [{"role": "user", "content": "Weather in Paris?"}, THOUGHT,
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "C"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]


def test_reasoning_items_go_back_as_reasoning_content():
    # A reasoning item is the template's reasoning_content of the assistant turn after it
    # (an agent sends the whole previous output back: reasoning, message, calls).
    req = parse_responses(json.dumps({"input": TURN, "tools": [WEATHER]}).encode(), LIMITS,
                          "m", HF_INFO, "hermes")
    messages = req.prompts[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["reasoning_content"] == "Paris, so Celsius."
    assert messages[1]["tool_calls"][0]["id"] == "c1"
    # thinking followed by no answer (cut by max_output_tokens): a turn of thinking alone
    req = parse_responses(json.dumps({"input": [*TURN[:2], TURN[0]]}).encode(), LIMITS, "m",
                          HF_INFO, "hermes")
    messages = req.prompts[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1] == {"role": "assistant", "content": "",
                           "reasoning_content": "Paris, so Celsius."}


def test_auto_tools_with_a_format_take_calls_or_the_document():
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}}
    req = parse_responses(json.dumps({"input": "hi", "tools": [WEATHER], "text": fmt}).encode(),
                          LIMITS, "m", HF_INFO, "hermes")
    assert req.chat.tools.parse == CALLS_OR_DOCUMENT
    grammar = req.params.extra["response_format"]["schema"]
    calls, document = grammar["anyOf"]
    assert calls["type"] == "array" and "get_weather" in grammar["$defs"]
    assert grammar["$defs"][document["$ref"].removeprefix("#/$defs/")] == {"type": "object"}
    call = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]'
    for text, kinds in [(call, ["function_call"]), ('{"city": "Paris"}', ["message"]),
                        ("", ["message"])]:
        outputs = []
        for cut in range(len(text) + 1):  # any split of the text: the same items
            events = ResponseEvents(new_response("resp_1", 0, "m", req.echo),
                                    reasoning_parser=None, tools=req.chat.tools)
            events.feed(text[:cut])
            events.feed(text[cut:], last=True)
            events.end("stop", response_usage(1, 1, None))
            outputs.append([{k: v for k, v in o.items() if k not in ("id", "call_id")}
                            for o in events.response["output"]])
        assert [o["type"] for o in outputs[0]] == kinds
        assert all(o == outputs[0] for o in outputs)
    assert outputs[0][0]["content"][0]["text"] == ""
    # tool_choice none: the format alone
    req = parse_responses(json.dumps({"input": "hi", "tools": [WEATHER], "text": fmt,
                                      "tool_choice": "none"}).encode(),
                          LIMITS, "m", HF_INFO, "hermes")
    assert req.params.extra["response_format"]["schema"] == {"type": "object"}


def test_refusals_name_the_responses_field():
    base = {"input": "hi"}
    for extra, param in [
        ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"), ({"conversation": "c"}, "conversation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"), ({"frobnicate": 1}, "frobnicate"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "id": "r",
                                                       "encrypted_content": "x"}]},
         "input[1].encrypted_content"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "a"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
         "input[1].arguments"),
    ]:
        assert refused({**base, **extra}).param == param, extra
    # store false and the other neutral values are accepted
    parse_responses(json.dumps({**base, "store": False, "truncation": "disabled", "include": [],
                                "reasoning": {"effort": None}, "metadata": {"k": "v"}}).encode(),
                    LIMITS, "m", HF_INFO, "hermes")
    # what the engine does not honour is named as the client sent it
    sim = {"engine": "sim", "sampling": ["tools"]}
    fmt = {"text": {"format": {"type": "json_object"}}}
    assert refused({**base, **fmt}, sim).param == "text.format"
    assert "'text.format'" in refused({**base, **fmt}, sim).message
    assert refused({**base, "tools": [WEATHER]}, sim, None).param == "tools"


# -- the sim engine over HTTP --------------------------------------------------------------------


async def test_text_streaming_and_not_with_the_sdk():
    async with running_server() as url:
        client = client_of(url)
        r = await client.responses.create(model="sim", input="hello", instructions="Be brief.",
                                          max_output_tokens=8, temperature=0)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.id.startswith("resp_") and r.object == "response"
        assert r.store  # (OpenAI's default, with the server's state store: docs/api.md)
        assert len(r.output_text.split()) == 8 and r.instructions == "Be brief."
        assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + 8
        # streaming: OpenAI's event sequence, numbered, the same text as without
        stream = await client.responses.create(model="sim", input="hello",
                                               instructions="Be brief.", max_output_tokens=8,
                                               temperature=0, stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        check_sequence(events)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == r.output_text == events[-4].text
        last = events[-1].response
        assert last.output_text == text and last.usage.output_tokens == 8
        # on the wire: named events, no [DONE]
        async with httpx.AsyncClient(base_url=url) as raw:
            wire = (await raw.post("/v1/responses", json={"input": "hi", "stream": True,
                                                           "max_output_tokens": 2})).content
        assert wire.startswith(b'event: response.created\ndata: {"type":"response.created",')
        assert wire.endswith(b"}\n\n") and b"[DONE]" not in wire
        assert events[2].item.id == last.output[0].id


async def test_function_calls_and_history_with_the_sdk():
    async with running_server(tool_call_parser="hermes") as url:
        client = client_of(url)
        r = await client.responses.create(model="sim", input="Weather in Paris?",
                                          tools=[WEATHER], max_output_tokens=40, temperature=0)
        assert r.status == "completed"
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and call.status == "completed"
        assert list(json.loads(call.arguments)) == ["city"]
        assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
        # the SDK's stream helper accumulates the same call
        async with client.responses.stream(model="sim", input="Weather in Paris?",
                                           tools=[WEATHER], max_output_tokens=40,
                                           temperature=0) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        check_sequence(events)
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        (streamed,) = final.output
        assert "".join(deltas) == streamed.arguments == call.arguments
        assert streamed.name == call.name and final.status == "completed"
        # the call and its output go back as input: rendered, more prompt tokens
        turn2 = await client.responses.create(
            model="sim", tools=[WEATHER], max_output_tokens=4, tool_choice="none",
            input=[{"role": "user", "content": "Weather in Paris?"}, *r.output,
                   {"type": "function_call_output", "call_id": call.call_id,
                    "output": "sunny, 21"}])
        assert turn2.usage.input_tokens > r.usage.input_tokens
        assert turn2.output[0].type == "message"  # tool_choice none: never parsed
        # refusals over HTTP: 400s naming the field
        for kwargs, param in [({"background": True, "store": False}, "background"),
                              ({"extra_body": {"nope": 1}}, "nope"),
                              ({"tool_choice": "required"}, "tool_choice"),
                              ({"text": {"format": {"type": "json_schema", "name": "x"}}},
                               "text.format.schema")]:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model="sim", input="x", **kwargs)
            assert caught.value.body["param"] == param, kwargs
        r = await client.responses.create(model="sim", input="x", max_output_tokens=2)
        assert r.status == "incomplete"  # the server still serves


async def test_reasoning_items_with_a_reasoning_parser():
    config = EngineConfig(engine_options={**FAST_SIM, "reasoning_tokens": 3})
    async with running_server(config, reasoning_parser="qwen3") as url:
        client = client_of(url)
        r = await client.responses.create(model="sim", input="why", max_output_tokens=8,
                                          temperature=0)
        thought, message = r.output
        assert thought.type == "reasoning" and message.type == "message"
        assert len(thought.content[0].text.split()) == 3  # the sim's three thinking words
        assert "think>" not in r.output_text and len(r.output_text.split()) == 3
        stream = await client.responses.create(model="sim", input="why", max_output_tokens=8,
                                               temperature=0, stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (reasoning, text) == (thought.content[0].text, r.output_text)
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta")
        assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
        check_sequence(events)
        # the SDK's output objects go back as input, as an agent sends them
        again = await client.responses.create(
            model="sim", max_output_tokens=8, temperature=0,
            input=[{"role": "user", "content": "why"}, *r.output,
                   {"role": "user", "content": "and then?"}])
        assert again.usage.input_tokens > r.usage.input_tokens


async def test_engine_failure_after_the_first_byte_is_response_failed():
    config = EngineConfig(engine_options={**FAST_SIM, "faults": True}, drain_timeout=0.5)
    async with running_server(config) as url:
        client = client_of(url)
        stream = await client.responses.create(
            model="sim", input="p", max_output_tokens=20, stream=True,
            extra_body={"fault": {"kind": "error", "after": 3}})
        events = [e async for e in stream]
        assert events[-1].type == "response.failed"
        check_sequence(events)
        failed = events[-1].response
        assert failed.status == "failed" and "injected engine failure" in failed.error.message
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert len(text.split()) == 3 and failed.output[0].content[0].text == text
        with pytest.raises(openai.InternalServerError):  # non-streaming: a 500
            await client.responses.create(model="sim", input="p", max_output_tokens=20,
                                          extra_body={"fault": {"kind": "error", "after": 3}})


async def test_request_timeout_after_the_first_byte_is_response_failed():
    config = EngineConfig(engine_options={**FAST_SIM, "faults": True}, drain_timeout=0.5)
    async with running_server(config, request_timeout=0.5) as url:
        stream = await client_of(url).responses.create(
            model="sim", input="p", max_output_tokens=20, stream=True,
            extra_body={"fault": {"kind": "stall", "after": 2}})
        events = [e async for e in stream]
        check_sequence(events)
        failed = events[-1].response
        assert events[-1].type == "response.failed" and failed.error.code == "request_timeout"
        assert failed.output[0].status == "incomplete"


async def test_disconnect_mid_stream_aborts_the_request():
    # The request stalls after two tokens: only an abort can end it.
    config = EngineConfig(engine_options={**FAST_SIM, "faults": True}, drain_timeout=0.5)
    async with running_server(config) as url:
        sock = await open_request(url, "/v1/responses", {
            "input": "go", "max_output_tokens": 50, "stream": True,
            "fault": {"kind": "stall", "after": 2}})
        with trio.fail_after(30):
            await read_until(sock, b"response.output_text.delta", 2)
        (running, _), = await url.engine.ping_all()
        assert running == 1
        await sock.aclose()
        await assert_engine_idle(url.engine, timeout=30)


# -- the transformers engine: grammar-forced calls and json_schema output ------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

ANSWER = {
    "type": "object", "additionalProperties": False, "required": ["city", "ok"],
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                   "ok": {"type": "boolean"}},
}


#: An output_type of nested models, as pydantic writes its schema.
NESTED = {
    "type": "object", "additionalProperties": False, "required": ["stops"],
    "properties": {"stops": {"type": "array", "maxItems": 2,
                             "items": {"$ref": "#/$defs/Stop"}}},
    "$defs": {"Stop": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string",
                                               "pattern": "^[A-Za-z]{1,8}$"}}}},
}


#: tests/conftest.py's ``tools_server``'s model, for the test over HTTP.
MODEL = "tiny-tools"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("responses") / "tiny-responses",
                            max_position_embeddings=2048)


def test_reasoning_and_calls_in_the_input_reach_the_template(model_dir):
    from server.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine(model_path=str(model_dir), max_batch=1)
    engine.tokenizer.chat_template = (  # a Qwen3-like template's use of reasoning_content
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m.reasoning_content %}<think>"
        "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] or '' }}"
        "{% for c in m.tool_calls or [] %}{{ c['function'] | tojson }}{% endfor %}\n"
        "{% endfor %}<|assistant|>")
    req = parse_responses(json.dumps({"input": TURN, "tools": [WEATHER]}).encode(), LIMITS,
                          "m", HF_INFO, "hermes")
    text = engine.tokenizer.decode(engine.encode(req.prompts[0], None, req.chat.tools.tools))
    assert "<think>Paris, so Celsius.</think>" in text
    assert '"name": "get_weather"' in text and "sunny" in text


async def test_forced_call_and_json_schema_on_transformers(tools_url):
    """On tests/conftest.py's ``tools_server`` (the transformers engine, hermes)."""
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    with trio.fail_after(120):
        client = client_of(tools_url)
        for choice in ("required", {"type": "function", "name": "get_weather"}):
            r = await client.responses.create(
                model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                tool_choice=choice, max_output_tokens=200, temperature=0)
            assert r.status == "completed"
            (call,) = [o for o in r.output if o.type == "function_call"][:1]
            arguments = json.loads(call.arguments)
            assert call.name == "get_weather" and set(arguments) == {"city", "unit"}
            async with client.responses.stream(
                    model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                    tool_choice=choice, max_output_tokens=200, temperature=0) as stream:
                final = await stream.get_final_response()
            assert [(o.name, o.arguments) for o in final.output] == [
                (o.name, o.arguments) for o in r.output]
        # auto with a format (an agent's tool and its output_type): calls or the document
        r = await client.responses.create(
            model=MODEL, input="Weather in Paris?", tools=[WEATHER],
            text=fmt, max_output_tokens=200, temperature=0)
        assert r.status == "completed"
        if r.output[0].type == "function_call":
            assert {o.name for o in r.output} == {"get_weather"}
            assert all(set(json.loads(o.arguments)) == {"city", "unit"}
                       for o in r.output)
        else:
            assert set(json.loads(r.output_text)) == {"city", "ok"}
        async with client.responses.stream(
                model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                text=fmt, max_output_tokens=200, temperature=0) as stream:
            final = await stream.get_final_response()
        assert [o.type for o in final.output] == [o.type for o in r.output]
        assert final.output_text == r.output_text
        assert [getattr(o, "arguments", None) for o in final.output] == [
            getattr(o, "arguments", None) for o in r.output]
        # ... with a document of nested models (pydantic's $defs and #/$defs refs): both
        # the tool's parameters and the document's definitions resolve in one grammar
        nested = {"format": {"type": "json_schema", "name": "trip", "strict": True,
                             "schema": NESTED}}
        r = await client.responses.create(
            model=MODEL, input="Plan a trip.", tools=[WEATHER],
            text=nested, max_output_tokens=200, temperature=0)
        assert r.status in ("completed", "incomplete")
        if r.status == "completed" and r.output[0].type == "message":
            jsonschema.validate(json.loads(r.output_text), NESTED)
        # json_schema output: a document valid for the schema, streaming and not
        r = await client.responses.create(model=MODEL, input="Answer in JSON.",
                                          text=fmt, max_output_tokens=200, temperature=0)
        assert r.status == "completed" and r.text.format.type == "json_schema"
        doc = json.loads(r.output_text)
        assert set(doc) == {"city", "ok"} and isinstance(doc["ok"], bool)
        async with client.responses.stream(model=MODEL, input="Answer in JSON.",
                                           text=fmt, max_output_tokens=200,
                                           temperature=0) as stream:
            final = await stream.get_final_response()
        assert final.output_text == r.output_text
