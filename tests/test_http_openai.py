"""End to end through hypercorn with the official openai SDK: shapes, streaming, n, batches."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio

import server
from server.config import EngineConfig
from tests.conftest import FAST_SIM, running_server


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_completion_non_streaming_shape(server_url):
    r = await client(server_url).completions.create(
        model="sim", prompt="one two three", max_tokens=7, temperature=0
    )
    assert r.object == "text_completion"
    assert r.model == "sim"
    assert r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert len(choice.text.split()) == 7  # the sim engine emits one word per token
    assert r.usage.prompt_tokens == 3
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == 10
    # vLLM's field, present as null (vLLM's own tests read it)
    assert choice.model_extra["prompt_logprobs"] is None
    r = await client(server_url).chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "prompt_logprobs" in r.model_extra and r.prompt_logprobs is None


async def test_a_seed_out_of_range_is_a_400_in_pydantics_words_too(server_url):
    """vLLM's test_long_seed: the message names the bound's kind as pydantic does."""
    for seed, kind in ((-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")):
        with pytest.raises(openai.BadRequestError) as info:
            await client(server_url).chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], seed=seed)
        assert kind in info.value.message and info.value.body["param"] == "seed"


async def test_streaming_equals_non_streaming(server_url):
    c = client(server_url)
    full = await c.completions.create(model="sim", prompt="a b c d", max_tokens=12, seed=5)
    stream = await c.completions.create(
        model="sim",
        prompt="a b c d",
        max_tokens=12,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for ch in chunk.choices:
            texts.append(ch.text)
            finishes.append(ch.finish_reason)
    assert "".join(texts) == full.choices[0].text
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert usage.prompt_tokens == 4 and usage.completion_tokens == 12


async def test_sync_client_in_a_thread(server_url):
    def call():
        c = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in c.chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                seed=1,
                stream=True,
            )
            if chunk.choices
        )
        whole = c.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hello"}], max_tokens=6, seed=1
        )
        return streamed, whole

    streamed, whole = await trio.to_thread.run_sync(call)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens == 6


async def test_chat_stream_roles_n_and_usage(server_url):
    stream = await client(server_url).chat.completions.create(
        model="sim",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=5,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    first_delta = {}
    text = {0: "", 1: "", 2: ""}
    finished = {}
    usage = None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            first_delta.setdefault(ch.index, ch.delta)
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason is not None:
                assert ch.index not in finished, "one finishing chunk per choice"
                finished[ch.index] = ch.finish_reason
    assert set(first_delta) == {0, 1, 2}
    assert all(d.role == "assistant" and d.content == "" for d in first_delta.values())
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert all(len(t.split()) == 5 for t in text.values())
    # The prompt is counted once, not once per sample: the sim template renders
    # "<|system|> be brief\n<|user|> hi\n<|assistant|>" = 6 words.
    assert usage.prompt_tokens == 6
    assert usage.completion_tokens == 15


async def test_continuous_usage_stats_on_every_chunk(server_url):
    for chat in (False, True):
        kw = dict(model="sim", max_tokens=6, n=2, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True})
        if chat:
            stream = await client(server_url).chat.completions.create(
                messages=[{"role": "user", "content": "a b c"}], **kw)
        else:
            stream = await client(server_url).completions.create(prompt="a b c", **kw)
        seen = []
        async for chunk in stream:
            assert chunk.usage is not None, chunk  # every chunk, the last one included
            seen.append(chunk.usage.completion_tokens)
            assert chunk.usage.prompt_tokens == (5 if chat else 3)  # "<|user|> a b c <|assistant|>"
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + seen[-1]
        assert seen == sorted(seen) and seen[-1] == 12
        assert seen[0] == 0 if chat else seen[0] < 12  # (a chat opens with role chunks)
        # a chunk a choice at least (each choice's steps in one, when the frontend read
        # them all at once on a busy machine), then the usage chunk
        assert len(seen) >= 3
    # vLLM's meaning: usage on every chunk when there is usage at all (here none)
    r = await httpx.AsyncClient(base_url=server_url).post("/v1/completions", json={
        "prompt": "a", "stream": True, "max_tokens": 3,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert r.status_code == 200 and '"usage"' not in r.text and "[DONE]" in r.text


async def test_unknown_stream_options_are_refused_by_name(server_url):
    http = httpx.AsyncClient(base_url=server_url)
    for options, bad in (({"include_obfuscation": True}, ["include_obfuscation"]),
                         ({"include_usage": True, "x_a": 1, "x_b": 2}, ["x_a", "x_b"])):
        r = await http.post("/v1/completions", json={"prompt": "a", "stream": True,
                                                     "stream_options": options})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and all(f"stream_options.{b}'" in message for b in bad), r.text
    r = await http.post("/v1/completions", json={  # what the openai SDK may send: no padding
        "prompt": "a", "stream": True, "max_tokens": 2,
        "stream_options": {"include_obfuscation": False}})
    assert r.status_code == 200 and "[DONE]" in r.text


async def test_batch_prompts_with_n_are_indexed(server_url):
    r = await client(server_url).completions.create(
        model="sim", prompt=["p zero", "p one two", "p two three four"], n=2, max_tokens=3, seed=9
    )
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.prompt_tokens == 2 + 3 + 4
    assert r.usage.completion_tokens == 18
    # Sample i of a prompt uses seed + i, so choices of one prompt differ from each other
    # and choice p*n + i matches a single request for prompt p with seed + i.
    single = await client(server_url).completions.create(
        model="sim", prompt="p one two", max_tokens=3, seed=10
    )
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[3] == single.choices[0].text


async def test_token_id_prompts_and_echo(server_url):
    c = client(server_url)
    r = await c.completions.create(model="sim", prompt=[[1, 2, 3], [4, 5]], max_tokens=2)
    assert r.usage.prompt_tokens == 5
    echoed = await c.completions.create(model="sim", prompt="say it", max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith("say it ")
    # echo of token ids needs a tokenizer to decode them (tests/test_clients.py): the sim's
    # answer is a 400 that says so
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        await c.completions.create(model="sim", prompt=[1, 2, 3], max_tokens=2, echo=True)


async def test_stop_string_is_honoured_and_excluded(server_url):
    c = client(server_url)
    base = await c.completions.create(model="sim", prompt="x y", max_tokens=30, seed=3)
    words = base.choices[0].text.split()
    stop = " " + words[4]
    r = await c.completions.create(model="sim", prompt="x y", max_tokens=30, seed=3, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
    assert base.choices[0].text.startswith(r.choices[0].text)
    streamed = ""
    async for chunk in await c.completions.create(
        model="sim", prompt="x y", max_tokens=30, seed=3, stop=stop, stream=True
    ):
        streamed += chunk.choices[0].text
    assert streamed == r.choices[0].text


async def test_models_and_health(server_url):
    models = await client(server_url).models.list()
    assert [m.id for m in models.data] == ["sim"]
    model = await client(server_url).models.retrieve("sim")
    assert model.id == "sim"
    with pytest.raises(openai.NotFoundError):
        await client(server_url).models.retrieve("nope")
    async with httpx.AsyncClient() as http:
        r = await http.get(server_url + "/health")
        assert r.status_code == 200
        r = await http.get(server_url + "/version")  # vLLM's route
    assert r.status_code == 200
    assert r.json() == {"version": server.__version__, "server_version": server.__version__,
                        "engine": "sim"}


async def test_request_id_names_the_response_unless_x_request_id_does(server_url):
    # vLLM's order: the X-Request-Id header, then the body's request_id, then a new id
    async with httpx.AsyncClient(base_url=server_url) as http:
        body = {"prompt": "a", "max_tokens": 2, "request_id": "job-7"}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["id"] == "cmpl-job-7"
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stream": True,
            "request_id": "job-8"})
        assert r.status_code == 200 and '"id":"chatcmpl-job-8"' in r.text
        r = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr-1"})
        assert r.json()["id"] == "cmpl-hdr-1"
        r = await http.post("/v1/completions", json={**body, "request_id": "a b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


async def test_chat_echo_puts_the_last_assistant_message_first(server_url):
    # vLLM's echo: the last message's content, when it is an assistant's, before the answer
    saying = "an apple a day keeps"
    history = [{"role": "user", "content": "a saying"}, {"role": "assistant", "content": saying}]
    c = client(server_url)
    plain = await c.chat.completions.create(model="sim", messages=history, max_tokens=4, seed=2)
    r = await c.chat.completions.create(model="sim", messages=history, max_tokens=4, seed=2,
                                        extra_body={"echo": True})
    assert r.choices[0].message.content == saying + plain.choices[0].message.content
    stream = await c.chat.completions.create(model="sim", messages=history, max_tokens=4,
                                             seed=2, stream=True, extra_body={"echo": True})
    said = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert said == r.choices[0].message.content
    # the last message a user's: nothing to echo
    r = await c.chat.completions.create(model="sim", messages=history[:1], max_tokens=4,
                                        seed=2, extra_body={"echo": True})
    assert not r.choices[0].message.content.startswith(saying)


async def test_served_model_name_and_unknown_model():
    async with running_server(EngineConfig(model="my-model", engine_options=dict(FAST_SIM))) as url:
        c = client(url)
        r = await c.completions.create(model="my-model", prompt="hi", max_tokens=1)
        assert r.model == "my-model"
        with pytest.raises(openai.NotFoundError) as info:
            await c.completions.create(model="sim", prompt="hi", max_tokens=1)
        assert info.value.body["code"] == "model_not_found"


async def test_unicode_line_breaks_stay_inside_their_sse_line(server_url):
    """U+0085, U+2028 and U+2029 are legal raw in JSON, but httpx's ``aiter_lines`` (and
    every SSE client that splits lines as Python's ``str.splitlines`` does) cuts a line at
    them: they go escaped, on chat and completions, in the text and in the echoed prompt."""
    said = "one\x85two\u2028three\u2029four"
    requests = [
        ("/v1/completions", {"prompt": said, "echo": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": said}],
                                  "echo": True}),
    ]
    async with httpx.AsyncClient() as http:
        for path, body in requests:
            body = {**body, "max_tokens": 3, "stream": True}
            async with http.stream("POST", server_url + path, json=body) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            text = "".join(c["choices"][0].get("text") or c["choices"][0]["delta"].get("content")
                           or "" for c in chunks if c["choices"])
            assert text.startswith(said)


async def test_sse_wire_format(server_url):
    """The bytes on the wire: headers, one `data:` line per event, blank-line separated."""
    body = {"prompt": "a", "max_tokens": 3, "stream": True}
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", server_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-cache"
            raw = b"".join([part async for part in r.aiter_raw()])
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        assert event.startswith(b"data: ")
        json.loads(event[6:])
