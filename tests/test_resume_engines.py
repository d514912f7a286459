"""Resuming a migrated request on the transformers and vllm engines (issue 24), sans-IO:
a request runs on a real engine (the tiny model of tests/tiny_model.py, in this process);
at every cut, it is aborted and a new request resumes it from what a frontend has (the
token ids, the text's length, the tokens left), and the client's text, token count and
finish reason are compared with the uninterrupted run's. Real worker processes SIGKILLed
mid-stream: tests/test_migration.py."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from server.workers.base import Rejected
from tests.tiny_model import build_tiny_model
from tests.vllm_reference import checks_apart

PROMPT = "the quick 東京 brown fox 🦊 jumps"


def run(engine, params: dict, cut: int | None = None, rid: int = 1,
        prompt: object = PROMPT) -> tuple[str, int, str, list]:
    """``(text, completion tokens, finish, token ids)`` of one request; at ``cut`` tokens,
    the request is aborted and another one resumes it."""
    engine.add(rid, prompt, {**params, "token_ids": True})
    text, ids, n, finish = "", [], 0, None
    while finish is None:
        outs = engine.step(0.0)
        for r, note in engine.notes:
            if r == rid:
                ids += note.get("token_ids", [])
        engine.notes.clear()
        for out in outs:
            if out.rid == rid:
                assert out.error is None, out.error
                text += out.text
                n += out.ntok
                finish = out.finish
        if cut is not None and n >= cut and finish is None:
            assert len(ids) == n
            assert engine.abort(rid)
            rid += 1
            resume = {"token_ids": list(ids), "text_chars": len(text)}
            left = params["max_tokens"] - n
            engine.add(rid, prompt, {**params, "token_ids": True, "resume": resume,
                                     "max_tokens": left})
            cut = None
    assert len(ids) == n
    return text, n, finish, ids


def check_every_cut(engine, params: dict, step: int = 1) -> tuple[str, int, str, list]:
    whole = run(engine, params)
    for cut in range(1, whole[1], step):
        assert run(engine, params, cut, rid=100 * cut) == whole, (params, cut)
    return whole


def stops_from(text: str) -> tuple[list[str], list[str]]:
    """Stop strings made from a run's text: ``held`` ones begin at several places of it but
    never complete (their start is held back, across any cut), and ``stopping`` ones end it
    part way."""
    held = [text[i:i + 3] + "\x00" for i in range(2, len(text) - 3, 7)]
    stopping = [text[len(text) * 2 // 3: len(text) * 2 // 3 + 3]]
    return held, stopping


def multibyte_across_tokens(engine, ids: list[int]) -> bool:
    """Whether a non-ASCII character of the text spans two of ``ids`` (one decodes alone to
    a replacement character)."""
    return any("\ufffd" in engine.tokenizer.decode([t]) for t in ids)


# -- transformers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from server.engines.transformers.engine import TransformersEngine

    path = build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny")
    return TransformersEngine(model_path=str(path))


def test_transformers_resumes_exactly_at_every_cut(hf):
    assert hf.info["resume"] is True
    greedy = {"max_tokens": 16, "temperature": 0}
    text, _, _, ids = check_every_cut(hf, greedy)
    assert multibyte_across_tokens(hf, ids)  # (the case splits a character across the cut)
    held, stopping = stops_from(text)
    assert check_every_cut(hf, {**greedy, "stop": held}, step=2)[0] == text
    assert check_every_cut(hf, {**greedy, "stop": stopping}, step=2)[2] == "stop"
    # seeded sampling (the generator is replayed), with sampling rules (replayed too)
    check_every_cut(hf, {"max_tokens": 12, "temperature": 1.0, "seed": 7,
                         "presence_penalty": 0.5, "min_tokens": 10, "top_k": 50}, step=2)
    # a grammar: its matcher is replayed through the generated tokens
    fmt = {"type": "json_schema", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}
    check_every_cut(hf, {"max_tokens": 16, "temperature": 0, "response_format": fmt}, step=4)


def test_transformers_resumes_through_an_llguidance_matcher(hf):
    """A schema xgrammar would not enforce (a pattern's string bounded in length) runs on
    llguidance (server.engines.transformers.guidance), whose matcher is replayed the same way: seeded
    sampling, resumed at every other cut, equals the uninterrupted run, which ends with the
    document complete."""
    pytest.importorskip("llguidance")
    from server.engines.transformers.schema_check import unenforced

    schema = {"type": "object", "required": ["id", "n"], "properties": {
        "id": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},
        "n": {"type": "number", "multipleOf": 0.5}}}
    assert unenforced(schema) is not None  # (xgrammar's path would refuse it)
    params = {"max_tokens": 40, "temperature": 1.0, "seed": 3,
              "response_format": {"type": "json_schema", "schema": schema}}
    text, n, finish, _ = check_every_cut(hf, params, step=2)
    assert finish == "stop", (text, n)
    value = json.loads(text)
    assert re.fullmatch("[a-z]{1,5}", value["id"]) and value["n"] * 2 % 1 == 0, value


def test_transformers_refuses_a_resume_it_cannot_continue(hf):
    text, n, _, ids = run(hf, {"max_tokens": 6, "temperature": 0})
    cases = [
        {"token_ids": ids, "text_chars": len(text) + 1},  # the client has more text
        {"token_ids": [hf.vocab_size], "text_chars": 0},  # not a token of the model
        {"token_ids": ids},  # malformed
    ]
    for i, resume in enumerate(cases):
        with pytest.raises(Rejected) as info:
            hf.add(900 + i, PROMPT, {"max_tokens": 4, "temperature": 0, "resume": resume})
        assert info.value.kind == "engine_error" and "resume" in info.value.message


# -- vllm ------------------------------------------------------------------------------------
# In a child process of its own: in pytest's process (quart's context proxies among its
# modules), vLLM's start fails with "Working outside of application context".


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_resumes_at_every_cut(tmp_path):
    checks_apart(tmp_path, "tests.test_resume_engines:vllm_checks")


def vllm_checks(path: str) -> None:
    """The vllm engine's checks (run by the test above, in a process of its own)."""
    from server.engines.vllm.engine import VLLMEngine

    vllm = VLLMEngine(model_path=path, max_model_len=1024, dtype="float32",
                      engine_args={"kv_cache_memory_bytes": 64 << 20,
                                   "enforce_eager": True})  # (no compilation: ~13 s of CPU)
    try:
        assert vllm.info["resume"] is True
        greedy_exactly(vllm)
        seeded_with_fresh_draws(vllm)
        not_offered(vllm)
    finally:
        vllm.close()
    print("vllm resume checks passed")


def greedy_exactly(vllm) -> None:
    greedy = {"max_tokens": 16, "temperature": 0}
    text, _, _, ids = check_every_cut(vllm, greedy)
    assert multibyte_across_tokens(vllm, ids)
    held, stopping = stops_from(text)
    assert check_every_cut(vllm, {**greedy, "stop": held})[0] == text
    assert check_every_cut(vllm, {**greedy, "stop": stopping})[2] == "stop"
    assert check_every_cut(vllm, {**greedy, "stop": stopping, "include_stop_str_in_output":
                                  True, "min_tokens": 3}, step=2)[0].endswith(stopping[0])


def seeded_with_fresh_draws(vllm) -> None:
    """Seeded: a valid continuation (the same for the same seed and cut), not the
    uninterrupted run's draws (docs/routing.md)."""
    seeded = {"max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    whole = run(vllm, seeded)
    again = run(vllm, seeded, cut=4, rid=50)
    assert again[3][:4] == whole[3][:4] and again[1] == whole[1]
    assert run(vllm, seeded, cut=4, rid=60) == again


def not_offered(vllm) -> None:
    """A grammar or output penalties: no token ids (the frontend then ends the stream with
    worker_died), and a resume of it is refused."""
    fmt = {"type": "json_object"}
    for extra in ({"response_format": fmt}, {"presence_penalty": 0.5}, {"bad_words": ["x"]}):
        params = {"max_tokens": 4, "temperature": 0, "token_ids": True, **extra}
        vllm.add(70, PROMPT, params)
        notes = []
        while vllm.next_deadline() is not None:
            vllm.step(0.0)
            notes += vllm.notes
            vllm.notes.clear()
        assert not any("token_ids" in note for _, note in notes), extra
        try:
            vllm.add(71, PROMPT, {**params, "resume": {"token_ids": [5], "text_chars": 0}})
        except Rejected as exc:
            assert exc.kind == "engine_error" and next(iter(extra)) in exc.message
        else:
            raise AssertionError(f"resumed with {extra}")
