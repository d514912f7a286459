"""A refusal the engine worker makes names the client's field (``param``), as the
frontend's own 400s do (issue 41 item 8): end to end on the sim and transformers engines,
and, with a frontend that does not ask (an older one), the two-item ``err`` it can read."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import trio

from server import SamplingParams
from server.config import EngineConfig
from server.manager.transport import open_connected
from server.worker_protocol import wire
from tests.conftest import FAST_SIM, running_server
from tests.remote import listening_worker, remote_config

LIMIT = 300  # a hang guard on real processes, not a bound


async def _refused(http: httpx.AsyncClient, path: str, body: dict) -> dict:
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


async def test_a_sim_workers_refusals_name_the_field_over_http():
    """Refusals only the worker makes (it tokenizes the text): a truncation past the
    context, and a text prompt over it (``prompt`` for completions, ``messages`` for
    chat, as OpenAI's context_length_exceeded), streamed or not."""
    config = EngineConfig(engine_options={**FAST_SIM, "max_model_len": 20})
    long = "w " * 30
    with trio.fail_after(LIMIT):
        async with running_server(config) as url:
            async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
                for stream in (False, True):
                    error = await _refused(http, "/v1/completions", {
                        "model": "sim", "prompt": long, "max_tokens": 2, "stream": stream,
                        "truncate_prompt_tokens": 25})
                    assert "truncate_prompt_tokens=25" in error["message"]
                    assert error["param"] == "truncate_prompt_tokens", error
                    error = await _refused(http, "/v1/completions", {
                        "model": "sim", "prompt": long, "max_tokens": 2, "stream": stream})
                    assert "maximum context length is 20" in error["message"]
                    assert error["param"] == "prompt", error
                    error = await _refused(http, "/v1/chat/completions", {
                        "model": "sim", "messages": [{"role": "user", "content": long}],
                        "max_tokens": 2, "stream": stream})
                    assert error["param"] == "messages", error


needs_hf = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "xgrammar")),
    reason="needs the transformers extra")


@needs_hf
async def test_a_grammar_the_transformers_worker_refuses_names_its_field(transformers_url):
    """xgrammar refuses the constraint in the worker: the 400 names the field the request
    used for it (vLLM's ``structured_outputs`` here, ``response_format`` there). On the
    shared transformers server (tests/conftest.py)."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(base_url=transformers_url, timeout=LIMIT) as http:
            chat["model"] = (await http.get("/v1/models")).json()["data"][0]["id"]
            error = await _refused(http, "/v1/chat/completions", {
                **chat, "structured_outputs": {"regex": "(unclosed"}})
            assert "structured_outputs" in error["message"]
            assert error["param"] == "structured_outputs", error
            error = await _refused(http, "/v1/chat/completions", {
                **chat, "structured_outputs": {"grammar": "root ::= ("}})
            assert error["param"] == "structured_outputs", error


async def _answers(link, messages: list) -> list[list]:
    """Send ``messages`` on a frontend-by-hand ``link``; the error rows and TOKENIZEDs
    that answer them (one each)."""
    await link.send.send_all(b"".join(wire.encode(m) for m in messages))
    got: list[list] = []
    data = b""
    while len(got) < len(messages):
        for message in link.decoder.feed(data):
            if message[0] == wire.RESULT:
                got.append(message)
            elif message[0] == wire.STEP:
                got += [[wire.STEP, *row] for row in message[2] if row[3] == "error"]
        if len(got) < len(messages):
            data = await link.receive.receive_some(1 << 16)
            assert data, "the worker closed the connection"
    return got


async def test_a_listening_worker_sends_two_item_errs_to_a_frontend_that_does_not_ask(
        tmp_path):
    """Frontends and listening workers may be of adjacent versions: an older frontend
    (no ``error_param`` in its SUBMITs and TOKENIZEs) would end the connection on a
    three-item ``err``, so it gets ``[kind, message]``; one that asks gets the field."""
    params = SamplingParams(max_tokens=2).to_wire()
    old = {k: v for k, v in params.items() if k != wire.ERROR_PARAM_KEY}
    too_far = {"truncate_prompt_tokens": 10**9}
    embed = {"op": "embed", "input": ["a"], "dimensions": 10**6}
    async with listening_worker(tmp_path) as w:
        config = remote_config(w)
        link = await open_connected(config, w.address, None)
        try:
            with trio.fail_after(LIMIT):
                await link.handshake()
                older = await _answers(link, [
                    [wire.SUBMIT, 1, "a b", {**old, **too_far}],
                    [wire.CALL, 7, embed]])
                newer = await _answers(link, [
                    [wire.SUBMIT, 2, "a b", {**params, **too_far}],
                    [wire.CALL, 8, {**embed, wire.ERROR_PARAM_KEY: True}]])
        finally:
            await link.aclose(0)
    for answers in (older, newer):  # (a RESULT may come before the STEP, or after)
        answers.sort(key=lambda m: m[0] == wire.RESULT)
    assert [len(older[0][5]), len(older[1][3])] == [2, 2], older
    assert newer[0][5][2] == "truncate_prompt_tokens" and newer[1][3][2] == "dimensions", newer
