"""Issue 23, item 3: big bodies must not stall the frontend's event loop.

What is tested here is the behaviour; the stalls themselves are measured by
``bench/bodies.py`` (no wall-clock bounds in tests):

* a token-id prompt that cannot fit the model's context is refused by the frontend, with
  the worker's own 400, before the walk over its ids, and no worker sees it;
* a body past :data:`server.http.post.BIG_BODY` (parsed in a thread) is answered exactly
  as the same request in a small body is;
* the parse (msgspec, then the standard library for what msgspec refuses) answers as
  ``json.loads`` did.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.config import EngineConfig, Limits
from server.errors import ClientError
from server.openai import schema
from server.http.post import BIG_BODY
from server.params import context_error
from tests.conftest import FAST_SIM, JSON, running_server

CONTEXT = 64


def _count_dispatches(engine) -> list:
    """Every request the engine is asked to run, recorded (and then run)."""
    seen: list = []
    generate_many = engine.generate_many

    def spy(prompts, *args, **kwargs):
        seen.append(prompts)
        return generate_many(prompts, *args, **kwargs)

    engine.generate_many = spy
    return seen


async def test_a_token_id_prompt_past_the_context_is_refused_before_any_worker():
    config = EngineConfig(engine_options={**FAST_SIM, "max_model_len": CONTEXT})
    async with running_server(config) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # What the worker answers when it finds the prompt too long (a text prompt: the
            # frontend cannot count its tokens).
            r = await http.post("/v1/completions", headers=JSON,
                                json={"prompt": "word " * 200, "max_tokens": 4})
            assert r.status_code == 400
            worker = r.json()["error"]
            assert "maximum context length is 64 tokens" in worker["message"]
            seen = _count_dispatches(url.app.engine)
            cases = [
                ({"prompt": [7] * 100, "max_tokens": 4}, 100, 4),
                ({"prompt": [7] * 60, "max_tokens": 5}, 60, 5),  # 65 > 64
                ({"prompt": [[7] * 3, [7] * 70], "max_tokens": 2}, 70, 2),
                # Millions of ids, parsed in a thread, refused on their count.
                ({"prompt": [1] * 1_900_000, "max_tokens": 4}, 1_900_000, 4),
            ]
            for body, tokens, max_tokens in cases:
                r = await http.post("/v1/completions", headers=JSON, json=body)
                assert r.status_code == 400, r.text[:300]
                error = r.json()["error"]
                assert error["message"] == context_error(tokens, max_tokens, CONTEXT)
                assert {k: error[k] for k in ("type", "param", "code")} == {
                    k: worker[k] for k in ("type", "param", "code")}
            assert seen == []
            # What fits still runs.
            r = await http.post("/v1/completions", headers=JSON,
                                json={"prompt": [7] * 60, "max_tokens": 4})
            assert r.status_code == 200, r.text[:300]
            assert len(seen) == 1


async def test_a_big_body_is_answered_as_the_same_request_in_a_small_one():
    request = {"prompt": "the same words", "max_tokens": 6, "seed": 3, "n": 2}
    pad = {"padding_nobody_defines": "p" * BIG_BODY}
    bad = {"prompt": "x", "max_tokens": 6, "temperature": "hot"}
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            answers = []
            for body in (request, {**request, **pad}):
                r = await http.post("/v1/completions", headers=JSON, json=body)
                assert r.status_code == 200, r.text[:300]
                answers.append([c["text"] for c in r.json()["choices"]])
            assert answers[0] == answers[1]
            errors = []
            for body in (bad, {**bad, **pad}):
                r = await http.post("/v1/completions", headers=JSON, json=body)
                errors.append((r.status_code, r.json()))
            assert errors[0] == errors[1] and errors[0][0] == 400
            assert errors[0][1]["error"]["param"] == "temperature"
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1}
            texts = []
            for body in (chat, {**chat, **pad}):
                r = await http.post("/v1/chat/completions", headers=JSON, json=body)
                assert r.status_code == 200, r.text[:300]
                texts.append(r.json()["choices"][0]["message"]["content"])
            assert texts[0] == texts[1]


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"prompt": "x", "user": "\\ud83d\\ude00", "max_tokens": 2}',
    b'{"prompt": [1, 2, 3], "n": 2, "unknown": {"a": [1.5, -0.0, 1e-7, true, null]}}',
    b'{"prompt": "x", "unknown": ' + b"1" * 4000 + b"}",
    b'{"prompt": "x", "prompt": [5]}',
    b'{"prompt": "x",}',
    b'{"prompt": "x"} trailing',
    b'{"prompt": "x", "unknown": ' + b"1" * 5000 + b"}",
])
def test_the_parse_takes_and_refuses_what_json_loads_does(body):
    try:
        expected = json.loads(body)
    except ValueError:
        with pytest.raises(ClientError) as refused:
            schema.decode_json(body)
        assert refused.value.status == 400 and "set_int_max_str_digits" not in str(refused.value)
        return
    assert json.dumps(schema.decode_json(body)) == json.dumps(expected)  # (NaN != NaN)


def test_a_big_body_keeps_the_known_fields_and_refuses_what_a_small_one_does():
    from server.openai.fields import KNOWN

    unknown = {f"{i:x}": [i, {"x": None}] for i in range(40_000)}
    body = {"prompt": [1, 2], "n": 2, "metadata": {"k": "v"}, "temperature": 0.5, **unknown,
            "stop": ["a"], "tools": None}
    raw = json.dumps(body).encode()
    assert len(raw) >= schema.SKIP_UNKNOWN_FROM
    assert schema.decode_json(raw, known=True) == {
        k: v for k, v in body.items() if k in KNOWN or k == "tools"}
    assert schema.decode_json(raw) == body
    for bad, param in (
        (b', "zz": "\\ud800"}', "zz"),  # a lone surrogate in a field nobody defines
        (b', "temperature": NaN}', "temperature"),  # json.loads takes NaN; the field does not
    ):
        with pytest.raises(ClientError) as refused:
            schema.parse_completion(raw[:-1] + bad, Limits(), "m", {})
        assert refused.value.param == param


# -- what one request may make the server build ------------------------------------------------

HF = {"engine": "transformers", "logprobs": 20, "max_model_len": 2048}
CHAT = [{"role": "user", "content": "hi"}]


def _chat(body: dict, limits: Limits, info=HF):
    return schema.parse_chat(json.dumps({"messages": CHAT, **body}).encode(), limits, "m", info)


def test_an_answer_past_max_answer_logprobs_is_refused_naming_the_fields():
    limits = Limits(max_answer_logprobs=16 * 100 * 21)
    at_the_bound = {"n": 16, "max_tokens": 100, "logprobs": True, "top_logprobs": 20}
    assert _chat(at_the_bound, limits).logprobs == 20
    for body, size in [
        ({**at_the_bound, "max_tokens": 101}, 16 * 101 * 21),
        # Without max_tokens, what fits the context.
        ({"n": 16, "logprobs": True, "top_logprobs": 1}, 16 * 2048 * 2),
    ]:
        with pytest.raises(ClientError) as refused:
            _chat(body, limits)
        error = refused.value
        assert error.status == 400 and error.param == "top_logprobs"
        assert f"{size} logprobs" in error.message and f"more than the {16 * 100 * 21}" in error.message
        for name in ("n", "max_tokens", "top_logprobs", "stream"):
            assert name in error.message
        # A stream sends them as it goes: not bounded.
        assert _chat({**body, "stream": True}, limits).logprobs is not None
        assert _chat(body, Limits(max_answer_logprobs=0)).logprobs is not None  # no limit
    # Completions: prompts x n choices, logprobs k.
    body = {"prompt": ["a", "b"], "n": 4, "max_tokens": 10, "logprobs": 5}
    with pytest.raises(ClientError) as refused:
        schema.parse_completion(json.dumps(body).encode(), Limits(max_answer_logprobs=479),
                                "m", HF)
    assert refused.value.param == "logprobs" and "480 logprobs" in refused.value.message
    assert schema.parse_completion(json.dumps(body).encode(), Limits(max_answer_logprobs=480),
                                   "m", HF).logprobs == 5


def test_prompt_logprobs_count_toward_max_answer_logprobs():
    """prompt_logprobs up to the engine's most (-1: the whole vocabulary, as vLLM) make one
    entry per prompt token and alternative: counted before anything runs, the prompt's
    tokens bounded by its size (a token-id prompt's length; a text's bytes and 16)."""
    info = {"engine": "vllm", "logprobs": 1000, "vocab_size": 1000, "max_model_len": 2048,
            "sampling": ["prompt_logprobs"]}

    def completion(body: dict, most: int):
        return schema.parse_completion(json.dumps({"max_tokens": 2, **body}).encode(),
                                       Limits(max_answer_logprobs=most), "m", info)

    ids = {"prompt": [5] * 10, "prompt_logprobs": -1}
    assert completion(ids, 10 * 1001).params.extra["prompt_logprobs"] == 1000
    assert completion({**ids, "prompt_logprobs": 30}, 10 * 31).params.extra["prompt_logprobs"] == 30
    for body, size in [(ids, 10 * 1001), ({"prompt": "abc", "prompt_logprobs": 30}, 19 * 31),
                       ({"prompt": "abc", "prompt_logprobs": 3, "n": 2}, 2 * 19 * 4)]:
        with pytest.raises(ClientError) as refused:
            completion(body, size - 1)
        assert refused.value.param == "prompt_logprobs" and f"{size} prompt" in refused.value.message
        assert completion(body, size).prompt_logprobs is not None
    with pytest.raises(ClientError) as refused:  # past the engine's most
        completion({"prompt": "abc", "prompt_logprobs": 1001}, 0)
    assert refused.value.param == "prompt_logprobs"
    # A chat: its messages as JSON, and 256 tokens for the template's own text.
    with pytest.raises(ClientError) as refused:
        _chat({"prompt_logprobs": -1}, Limits(max_answer_logprobs=256 * 1001), info)
    size = int(refused.value.message.split(" could hold ")[1].split()[0])
    assert 256 * 1001 < size < 330 * 1001 and size % 1001 == 0
    assert _chat({"prompt_logprobs": -1}, Limits(max_answer_logprobs=size), info)


async def test_a_big_answer_built_in_a_thread_is_the_answer_built_here(transformers_url,
                                                                       monkeypatch):
    import trio

    from server.http import post

    # 192 tokens x 21 logprobs: past BIG_BODY, so built in a worker thread. One sequence,
    # alone in the batch: greedy decoding gives the same tokens both times (several would
    # join the batch as each is prepared, and a batch's shape moves the floats of a tie).
    body = {"messages": CHAT, "max_tokens": 192, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20}
    with trio.fail_after(120):  # (the server's own thread reads the patched module too)
        async with httpx.AsyncClient(base_url=transformers_url, timeout=60) as http:
            answers = []
            for big_body in (post.BIG_BODY, 1 << 62):
                monkeypatch.setattr(post, "BIG_BODY", big_body)
                r = await http.post("/v1/chat/completions", headers=JSON, json=body)
                assert r.status_code == 200, r.text[:300]
                answers.append(r.json()["choices"])
    assert len(r.content) > BIG_BODY
    assert answers[0] == answers[1]
    assert sum(len(c["logprobs"]["content"]) for c in answers[0]) == 192


# -- item 6: names the client chose, echoed and logged -----------------------------------------


async def test_a_huge_or_forging_key_is_echoed_and_logged_bounded_and_escaped(caplog):
    import logging

    from server.observability.logs import TextFormatter

    huge = "a\nb" + "k" * 1_000_000
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # A lone surrogate under a key: the 400 names the path to it.
            body = {"prompt": "x", "metadata": {huge: "\ud800"}}
            r = await http.post("/v1/completions", headers=JSON,
                                content=json.dumps(body).encode())
            assert r.status_code == 400
            param = r.json()["error"]["param"]
            assert param.startswith("metadata.a\\nb" + "k" * 10) and "\n" not in param
            assert len(param) < 300 and len(r.content) < 1500
            # Field names nobody defines are logged (debug), bounded and on one line.
            caplog.set_level(logging.DEBUG, logger="server.http")
            # (A body under SKIP_UNKNOWN_FROM: a bigger one's unknown fields are not built.)
            body = {"prompt": "x", "max_tokens": 1, "x\n2026-01-01 ERROR forged": 1,
                    huge[:100_000]: 2}
            r = await http.post("/v1/completions", headers=JSON, json=body)
            assert r.status_code == 200
    lines = [TextFormatter().format(rec) for rec in caplog.records
             if "nobody defines" in rec.getMessage()]
    assert len(lines) == 1
    assert "\n" not in lines[0] and "x\\n2026" in lines[0] and len(lines[0]) < 1000


# -- item 6: framing ---------------------------------------------------------------------------


@pytest.mark.direct_http
async def test_transfer_encoding_in_http_1_0_is_a_400_and_the_connection_closes():
    from tests.test_hostile import raw_exchange
    from tests.test_hostile_framing import error_of, statuses

    body = b'{"prompt": "x", "max_tokens": 2}'
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    async with running_server() as url:
        raw = await raw_exchange(
            url,
            b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked
            + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        status, headers, error = error_of(raw)
        assert status == 400 and error["code"] == "ambiguous_framing", raw[:300]
        assert headers["connection"] == "close" and statuses(raw) == [400]
        # HTTP/1.1 chunked is still served.
        raw = await raw_exchange(
            url,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked,
        )
        assert statuses(raw) == [200], raw[:300]


@pytest.mark.parametrize("after", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"garbage that is no request at all\r\n\r\n",
    b"\x00" * 70000,
])
@pytest.mark.direct_http
async def test_bytes_after_a_connection_close_request_are_ignored_and_it_is_answered(after):
    from tests.test_hostile import raw_exchange, split_response
    from tests.test_hostile_framing import post, statuses

    async with running_server() as url:
        for request in (
            post(b"application/json"),
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n",
        ):
            raw = await raw_exchange(url, request + after)
            assert split_response(raw)[0] == 200, raw[:300]
            assert len(statuses(raw)) + raw.count(b"HTTP/1.0 ") == 1, raw[:600]
