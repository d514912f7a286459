"""The transformers engine on a tiny random model built here (tests/tiny_model.py).

Three layers, cheapest first:

1. the sans-IO engine in this process (no worker process): greedy output equals
   ``model.generate`` for requests that join at different steps, stop strings, max_tokens,
   seeded sampling, multi-byte text, aborts, rejections;
2. real worker processes behind :func:`server.open_engine`;
3. the real HTTP server (tests/conftest.py ``running_server``) with the openai SDK.

The model is built once per session; the engine of layer 1 is loaded once per module.
"""

from __future__ import annotations

import collections
import json
import random

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402

import server  # noqa: E402
from server import SamplingParams  # noqa: E402
from server.errors import ClientError  # noqa: E402
from server.workers.base import Rejected  # noqa: E402
from server.engines.transformers.engine import TransformersEngine, load_model  # noqa: E402
from server.engines.transformers.logits import Rules, bad_words_ids  # noqa: E402
from server.engines.transformers.sample import sample  # noqa: E402
from server.engines.transformers.text import RequestText  # noqa: E402
from tests.tiny_model import WORDS, build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)

# One thread each, here and in the workers: this machine's two cores are shared, and torch's
# threads spin-waiting for a busy core make a step ten times slower.
torch.set_num_threads(1)

MODEL = "tiny-llama"  # the served name: the model directory's name
LIMIT = 120  # a hang guard for any test that starts processes (each imports torch: ~5 s
# quiet; a missing-model start took over 40 s on two cores under three benches)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hf") / MODEL)


@pytest.fixture(scope="module")
def engine(model_dir):
    return TransformersEngine(model_path=str(model_dir), max_batch=8)


def prompts(n: int, seed: int = 1) -> list[str]:
    """Prompts of different lengths, in all the scripts of the corpus."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def reference(engine: TransformersEngine, prompt, max_tokens: int) -> tuple[str, int]:
    """(text, tokens) of ``model.generate`` with greedy decoding, alone."""
    tok = engine.tokenizer
    ids = engine.encode(prompt)
    with torch.inference_mode():
        out = engine.model.generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False
        )
    new = out[0, len(ids) :].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


def greedy(max_tokens: int, **kw) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, **kw}


def run(engine, outputs: dict | None = None, steps: int | None = None) -> dict:
    """Step the engine until idle (or ``steps`` times); outputs by rid."""
    outputs = {} if outputs is None else outputs
    n = 0
    while engine.next_deadline() is not None and (steps is None or n < steps):
        for out in engine.step(0.0):
            outputs.setdefault(out[0], []).append(out)
        n += 1
    return outputs


def result(outs: list) -> tuple[str, int, str]:
    """(text, tokens, finish_reason) of one request's outputs."""
    assert all(o[3] is None for o in outs[:-1])
    return "".join(o[1] for o in outs), sum(o[2] for o in outs), outs[-1][3]


# -- 1. the sans-IO engine -----------------------------------------------------------------------


def test_greedy_matches_generate_as_requests_join_at_different_steps(engine):
    ps = prompts(6)
    lengths = [24, 9, 30, 17, 5, 21]
    refs = [reference(engine, p, n) for p, n in zip(ps, lengths)]
    outputs: dict = {}
    schedule = [(0, [0]), (3, [1, 2]), (2, [3]), (0, [4, 5])]  # steps to run, then who joins
    for steps, joining in schedule:
        run(engine, outputs, steps)
        for i in joining:
            assert engine.add(i, ps[i], greedy(lengths[i])) == len(engine.encode(ps[i]))
    run(engine, outputs)
    for i, (text, ntok) in enumerate(refs):
        got_text, got_ntok, finish = result(outputs[i])
        assert (got_text, got_ntok) == (text, ntok), f"prompt {i}: {ps[i]!r}"
        assert finish == ("length" if ntok == lengths[i] else "stop")
    assert engine.running() == engine.waiting() == engine.cached_tokens() == 0
    assert engine.next_deadline() is None
    assert any(ord(c) > 0x7F for text, _ in refs for c in text)  # multi-byte text was made


def test_token_id_and_chat_prompts(engine):
    ids = engine.encode("the quick brown fox")
    chat = {"messages": [{"role": "user", "content": "hello 世界 🙂"}]}
    rendered = engine.tokenizer.apply_chat_template(
        chat["messages"], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|assistant|>")
    assert engine.encode(chat) == engine.tokenizer(rendered, add_special_tokens=False).input_ids
    engine.add(1, ids, greedy(8))
    engine.add(2, chat, greedy(8))
    out = run(engine)
    assert result(out[1])[:2] == reference(engine, ids, 8)
    assert result(out[2])[:2] == reference(engine, chat, 8)


def test_chat_template_kwargs_reach_the_template(engine):
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    rendered = engine.tokenizer.apply_chat_template(
        chat["messages"], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert rendered.endswith("<|assistant|><think>")  # (the tiny model's template)
    ids = engine.encode(chat, {"enable_thinking": True})
    assert ids == engine.tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids != engine.encode(chat)
    params = greedy(4, chat_template_kwargs={"enable_thinking": True})
    assert engine.add(1, chat, params) == len(ids)
    run(engine)


def test_a_message_name_reaches_the_template(engine):
    from server.config import Limits
    from server.openai.schema import parse_chat

    body = json.dumps({"messages": [{"role": "user", "content": "hello", "name": "ada"}]})
    req = parse_chat(body.encode(), Limits(), MODEL, engine.info)
    rendered = engine.tokenizer.decode(engine.encode(req.prompts[0]))
    assert "<|user|>ada: hello" in rendered, rendered
    bad = json.dumps({"messages": [{"role": "user", "content": "hi", "name": 5}]}).encode()
    with pytest.raises(ClientError) as info:
        parse_chat(bad, Limits(), MODEL, engine.info)
    assert info.value.param == "messages[0].name"


def test_stop_string_across_token_boundaries(engine):
    prompt = prompts(1, seed=7)[0]
    engine.add(1, prompt, greedy(30))
    deltas = [o[1] for o in run(engine)[1]]
    full = "".join(deltas)
    # a stop string made of the end of one delta and the start of the next
    k = next(i for i in range(3, len(deltas) - 1) if len(deltas[i]) >= 2 and deltas[i + 1])
    stop = deltas[k][-2:] + deltas[k + 1][:1]
    engine.add(2, prompt, greedy(30, stop=[stop, "never \x00 seen"]))
    text, ntok, finish = result(run(engine)[2])
    assert finish == "stop"
    assert text == full[: full.index(stop)]
    assert stop not in text
    assert ntok <= k + 2


def test_max_tokens_and_ignore_eos(engine):
    engine.add(1, "hello world", greedy(5))
    engine.add(2, "hello world", greedy(1, ignore_eos=True))
    out = run(engine)
    assert result(out[1])[1:] == (5, "length")
    assert result(out[2])[1:] == (1, "length")
    assert [o[2] for o in out[1]] == [1] * 5  # one output per token, each one step


def test_eos_ends_with_stop(engine, monkeypatch):
    prompt = "hello 世界"
    ids = engine.encode(prompt)
    with torch.inference_mode():
        new = engine.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    new = new[0, len(ids) :].tolist()
    k = next(i for i in range(3, 12) if new[i] not in new[:i])
    monkeypatch.setattr(engine, "eos_ids", frozenset({new[k]}))  # make it the EOS token
    engine.add(1, prompt, greedy(12))
    engine.add(2, prompt, greedy(12, ignore_eos=True))
    out = run(engine)
    text = engine.tokenizer.decode(new[:k], skip_special_tokens=True)
    assert result(out[1]) == (text, k + 1, "stop")  # the EOS token counts, its text is not sent
    assert result(out[2])[1:] == (12, "length")


def test_seeded_sampling_is_reproducible(engine):
    params = {"max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    engine.add(1, "the model", params)
    alone = result(run(engine)[1])
    engine.add(2, "the model", params)  # now next to other requests
    engine.add(3, "日本語 数据 模型", {**params, "seed": 99})
    engine.add(4, "a much longer prompt " * 4, greedy(20))
    out = run(engine)
    assert result(out[2]) == alone
    engine.add(5, "the model", {**params, "seed": 1235})
    assert result(run(engine)[5]) != alone


def test_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 2)
    rngs = [torch.Generator().manual_seed(s) for s in (1, 2)]
    for _ in range(20):
        assert sample(logits, [(1.0, 1e-6, rngs[0]), (0.0, 1.0, None)]) == [1, 1]
    picks = {sample(logits, [(5.0, 1.0, rngs[1])])[0] for _ in range(200)}
    assert picks == {0, 1, 2, 3}


def _penalised_reference(engine, prompt, max_tokens: int, *, rep=1.0, freq=0.0, pres=0.0):
    """Greedy decoding with vLLM's penalties, one full forward pass per token (no cache):
    repetition over prompt and output, frequency and presence over the output."""
    ids = engine.encode(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = engine.model(torch.tensor([ids + out])).logits[0, -1].float()
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(ids + out)] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            counts = torch.zeros_like(logits)
            for t in out:
                counts[t] += 1
            logits = logits - freq * counts - pres * (counts > 0)
            out.append(int(logits.argmax()))
    return out


def test_sampling_fields_in_the_transformers_engine(engine):
    prompt = prompts(1, seed=11)[0]
    text, _ = reference(engine, prompt, 12)
    # top_k=1 and a tiny min_p... at temperature 1: only the most likely token is left.
    engine.add(1, prompt, {"max_tokens": 12, "temperature": 1.0, "top_k": 1, "seed": 3})
    engine.add(2, prompt, {"max_tokens": 12, "temperature": 1.0, "min_p": 0.999999, "seed": 4})
    # a logit bias that makes one token the only choice
    token = engine.encode("dog")[0]
    engine.add(3, prompt, {"max_tokens": 4, "temperature": 0, "logit_bias": {str(token): 100}})
    out = run(engine)
    assert result(out[1])[0] == text and result(out[2])[0] == text
    assert result(out[3])[:2] == (engine.tokenizer.decode([token] * 4), 4)

    # Penalties: equal to a plain reference of vLLM's formulas, token for token.
    for i, kw in enumerate(({"rep": 1.5}, {"freq": 1.5}, {"pres": 2.0},
                            {"rep": 1.2, "freq": 0.5, "pres": 0.5})):
        params = greedy(16, repetition_penalty=kw.get("rep", 1.0),
                        frequency_penalty=kw.get("freq", 0.0), presence_penalty=kw.get("pres", 0.0))
        engine.add(10 + i, prompt, params)
        ids = _penalised_reference(engine, prompt, 16, **kw)
        got = result(run(engine)[10 + i])
        assert got[:2] == (engine.tokenizer.decode(ids, skip_special_tokens=True), 16), kw
    assert _penalised_reference(engine, prompt, 16, rep=1.5) != \
        _penalised_reference(engine, prompt, 16)  # (the penalty changes this output)


def test_stop_token_ids_and_min_tokens(engine):
    prompt = prompts(1, seed=12)[0]
    ids = _penalised_reference(engine, prompt, 12)  # plain greedy ids
    third = ids[2]
    first = ids.index(third)  # (it may come earlier too)
    engine.add(1, prompt, greedy(12, stop_token_ids=[third]))
    text, ntok, finish = result(run(engine)[1])
    assert (ntok, finish) == (first + 1, "stop")
    assert text == engine.tokenizer.decode(ids[:first], skip_special_tokens=True)
    # min_tokens bans the stop token (and EOS) until that many tokens were made.
    engine.add(2, prompt, greedy(12, stop_token_ids=[third], min_tokens=first + 3))
    text, ntok, finish = result(run(engine)[2])
    assert ntok >= first + 3
    # Bad token ids are a client fault.
    for params in ({"stop_token_ids": [10**6]}, {"logit_bias": {"999999": 1}}):
        with pytest.raises(Rejected, match="token ids"):
            engine.add(3, prompt, greedy(4, **params))
    assert engine.next_deadline() is None


def test_allowed_token_ids_and_bad_words(engine):
    prompt = prompts(1, seed=14)[0]
    ids = _penalised_reference(engine, prompt, 8)  # plain greedy ids
    # allowed_token_ids: only those can be picked (greedy among them)
    allowed = engine.encode("dog cat")
    engine.add(1, prompt, greedy(6, allowed_token_ids=allowed))
    got = engine.tokenizer.encode(result(run(engine)[1])[0], add_special_tokens=False)
    assert got and set(got) <= set(allowed), got
    # bad_words: the greedy output's first word is never made
    word = engine.tokenizer.decode(ids[:1]).strip()
    assert word
    engine.add(2, prompt, greedy(8, bad_words=[word]))
    text = result(run(engine)[2])[0]
    banned = [w[-1] for w in bad_words_ids([word], engine.tokenizer) if len(w) == 1]
    assert banned and not set(banned) & set(engine.tokenizer.encode(text, add_special_tokens=False))
    assert text != engine.tokenizer.decode(ids, skip_special_tokens=True)
    with pytest.raises(Rejected, match="token ids"):
        engine.add(3, prompt, greedy(4, allowed_token_ids=[10**6]))
    assert engine.next_deadline() is None


def test_bad_words_ban_the_last_token_after_the_others():
    rules = Rules()
    rules.bad = [[5, 6, 7], [9]]
    assert rules.banned_words() == [9]
    for token in (1, 5, 6):
        rules.observe(token)
    assert rules.banned_words() == [7, 9]
    rules.observe(7)
    assert rules.banned_words() == [9]


def test_tokenize_and_detokenize_use_the_serving_tokenizer(engine):
    text = "hello 世界 🙂 café"
    got = engine.tokenize({"op": "tokenize", "prompt": text, "add_special_tokens": True})
    assert got == {"tokens": engine.encode(text), "max_model_len": engine.max_model_len}
    chat = {"messages": [{"role": "user", "content": text}]}
    assert engine.tokenize({"op": "tokenize", "prompt": chat})["tokens"] == engine.encode(chat)
    ids = got["tokens"]
    assert engine.tokenize({"op": "detokenize", "tokens": ids}) == {"prompt": text}
    with pytest.raises(Rejected, match="token ids"):
        engine.tokenize({"op": "detokenize", "tokens": [10**6]})


def test_vllms_tokenize_options(engine):
    """/tokenize's vLLM options, from the body (parsed as the frontend does) to the
    worker's answer: the template's options, special tokens, the tokens' strings."""
    from server.http.tokenize import _tokenize_answer, parse_tokenize

    tok = engine.tokenizer
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "wor"}]
    body = {"messages": messages, "continue_final_message": True,
            "add_generation_prompt": False, "add_special_tokens": True,
            "return_token_strs": True}
    request = parse_tokenize(json.dumps(body).encode(), MODEL)
    answer = json.loads(_tokenize_answer("tokenize", engine.tokenize(request)))
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    assert rendered.endswith("wor")  # the answer goes on from the last message
    assert answer["tokens"] == tok(rendered, add_special_tokens=True)["input_ids"]
    assert answer["token_strs"] == tok.convert_ids_to_tokens(answer["tokens"])
    assert answer["count"] == len(answer["tokens"])
    plain = json.loads(_tokenize_answer("tokenize", engine.tokenize(
        parse_tokenize(b'{"prompt": "hello"}', MODEL))))
    assert plain["token_strs"] is None


def test_logprobs_are_the_models_own(engine):
    prompt = prompts(1, seed=13)[0]
    engine.add(1, prompt, greedy(6, logprobs=3, prompt_logprobs=2))
    engine.add(2, prompt, greedy(6))  # asks for none: gets none
    engine.notes.clear()
    notes: dict = {}
    outputs: dict = {}
    while engine.next_deadline() is not None:
        for out in engine.step(0.0):
            outputs.setdefault(out[0], []).append(out)
        for rid, note in engine.notes:
            for key, entries in note.items():
                notes.setdefault((rid, key), []).extend(entries)
        engine.notes.clear()
    assert set(notes) == {(1, "logprobs"), (1, "prompt_logprobs")}
    ids = engine.encode(prompt)
    out = _penalised_reference(engine, prompt, 6)  # plain greedy ids
    with torch.inference_mode():
        rows = torch.log_softmax(engine.model(torch.tensor([ids + out])).logits[0].float(), -1)
    decode = engine.tokenizer.decode
    entries = notes[(1, "logprobs")]
    assert [e[0] for e in entries] == [decode([t]) for t in out]
    for j, (text, lp, alts, token, rank) in enumerate(entries):
        row = rows[len(ids) - 1 + j]
        assert lp == pytest.approx(float(row[out[j]]), abs=1e-4)
        assert token == out[j] and rank == 1  # greedy: the best one
        values, top = row.topk(3)
        assert [a[0] for a in alts] == [decode([t]) for t in top.tolist()]
        assert [a[2] for a in alts] == top.tolist()
        assert [a[1] for a in alts] == pytest.approx(values.tolist(), abs=1e-4)
        assert alts[0] == [text, pytest.approx(lp, abs=1e-6), token]
    prompt_entries = notes[(1, "prompt_logprobs")]
    assert prompt_entries[0] == [decode([ids[0]]), None, [], ids[0], None]
    for i in range(1, len(ids)):
        text, lp, alts, token, rank = prompt_entries[i]
        assert lp == pytest.approx(float(rows[i - 1][ids[i]]), abs=1e-4)
        assert token == ids[i] and rank == int((rows[i - 1] > rows[i - 1][ids[i]]).sum()) + 1
        assert len(alts) == 2
    assert result(outputs[1])[:2] == result(outputs[2])[:2]


SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
     "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
     "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}},
    {"type": "object", "additionalProperties": False, "required": ["n", "inner"],
     "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                    "inner": {"type": "object", "additionalProperties": False,
                              "required": ["x"], "properties": {"x": {"type": "boolean"}}}}},
    {"type": "array", "minItems": 1, "maxItems": 4,
     "items": {"type": "object", "additionalProperties": False, "required": ["id"],
               "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}}}},
]


def test_json_schema_outputs_validate(engine):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    rid = 0
    for schema in SCHEMAS:
        for params in (greedy(80), {"max_tokens": 80, "temperature": 1.0, "seed": 5}):
            for prompt in prompts(2, seed=rid + 30):
                rid += 1
                fmt = {"type": "json_schema", "schema": schema}
                engine.add(rid, prompt, {**params, "response_format": fmt})
                text, ntok, finish = result(run(engine)[rid])
                assert finish == "stop", (schema, text)
                jsonschema.validate(json.loads(text), schema)
    # json_object: an object or array as far as it got; complete ones parse.
    engine.add(99, "hello", greedy(60, response_format={"type": "json_object"}))
    text, _, finish = result(run(engine)[99])
    if finish == "stop":
        json.loads(text)
    for bad in ({"type": "json_schema", "schema": {"type": "no-such-type"}},
                {"type": "yaml"}):
        with pytest.raises(Rejected, match="response_format"):
            engine.add(100, "hello", greedy(4, response_format=bad))
    assert engine.next_deadline() is None


def test_structured_outputs_regex_choice_and_grammar(engine):
    # vLLM's structured_outputs kinds besides JSON (server.openai.structured makes these)
    import re

    pytest.importorskip("xgrammar")
    origin = {"origin": "structured_outputs"}
    choices = ["alpha beta", "gamma", "delta \"quoted\""]
    rid = 200
    for seed in range(3):
        sampling = {"max_tokens": 40, "temperature": 1.0, "seed": seed}
        rid += 1
        engine.add(rid, "pick one", {**sampling, "response_format": {
            "type": "choice", "choice": choices, **origin}})
        text, _, finish = result(run(engine)[rid])
        assert finish == "stop" and text in choices, text
        rid += 1
        engine.add(rid, "a number", {**sampling, "response_format": {
            "type": "regex", "regex": r"[a-c]{2}-[0-9]{1,3}", **origin}})
        text, _, finish = result(run(engine)[rid])
        assert finish == "stop" and re.fullmatch(r"[a-c]{2}-[0-9]{1,3}", text), text
        rid += 1
        engine.add(rid, "yes or no", {**sampling, "response_format": {
            "type": "grammar", "grammar": 'root ::= ("yes" | "no") "!"', **origin}})
        text, _, finish = result(run(engine)[rid])
        assert finish == "stop" and text in ("yes!", "no!"), text
    for bad in ({"type": "regex", "regex": "(unclosed"}, {"type": "grammar", "grammar": "x ::="}):
        with pytest.raises(Rejected, match="structured_outputs"):
            engine.add(rid + 1, "hello", greedy(4, response_format={**bad, **origin}))
    assert engine.next_deadline() is None


def test_length_bounded_strings_are_strict_json(engine):
    """Strings bounded by ``minLength``/``maxLength`` hold no raw control characters (issue
    29, item 7: xgrammar 0.2.8's bounded-string rule lets them through, and every client's
    JSON parser refuses them): the control characters' tokens pushed to the top by
    ``logit_bias``, the grammar still keeps them out, and every answer parses strictly."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    tok = engine.tokenizer
    controls = {t for c in range(32) for t in tok.encode(chr(c), add_special_tokens=False)}
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
              "properties": {"a": {"type": "string", "maxLength": 6},
                             "b": {"type": "string", "minLength": 2, "maxLength": 4},
                             "c": {"type": "array", "maxItems": 2,
                                   "items": {"type": "string", "minLength": 1, "maxLength": 3}}}}
    fmt = {"type": "json_schema", "schema": schema}
    bias = {str(t): 100 for t in controls}
    for seed in range(4):
        engine.add(seed, "hello", {"max_tokens": 60, "temperature": 1.0, "seed": seed,
                                   "logit_bias": bias, "response_format": fmt})
    out = run(engine)
    for seed in range(4):
        text, _, finish = result(out[seed])
        assert finish == "stop", text
        jsonschema.validate(json.loads(text, strict=True), schema)


def _grammar_takes(engine, schema: dict, text: str) -> bool:
    """Whether the engine's grammar for ``schema`` takes ``text`` whole (token by token, as
    the tokenizer splits it) and then ends."""
    grammars = engine._grammar()
    matcher = grammars.matcher(grammars.compile({"type": "json_schema", "schema": schema}))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return (all(matcher.accept_token(t) for t in ids)
            and matcher.accept_token(min(engine.eos_ids)) and matcher.is_terminated())


@pytest.mark.parametrize("fmt, invalid, valid", [
    # an email's quoted local part: xgrammar 0.2.8 took a backslash then any printable
    # character, "\a" among them, which is no JSON escape (issue 29 item 7)
    ("email", '"\\"\\a\\"@x"', json.dumps('"a\\b"@x')),
    # a JSON pointer's characters: xgrammar took control characters, a quote, a backslash
    ("json-pointer", '"/a\x01b"', json.dumps("/a/b~0c")),
    ("json-pointer", '"/a\\qb"', json.dumps("/a/b")),
    ("json-pointer", '"/a"b"', json.dumps("/a")),
    ("relative-json-pointer", '"0/\x1f"', json.dumps("0/a")),
])
def test_format_strings_are_strict_json(engine, fmt, invalid, valid):
    """A ``format``'s grammar takes only strings that strict JSON parsers take (issue 29
    item 7): the invalid text is refused by strict ``json.loads`` and by the grammar; the
    valid one passes both."""
    pytest.importorskip("xgrammar")
    schema = {"type": "string", "format": fmt}
    with pytest.raises(ValueError):
        json.loads(invalid)
    json.loads(valid)
    assert not _grammar_takes(engine, schema, invalid)
    assert _grammar_takes(engine, schema, valid)


def test_streamed_multibyte_text_equals_the_full_decode(engine):
    # characters the tokenizer never saw whole: they are split into byte tokens
    text = "漢字かな 🦀🧪 Ωμέγα — ñandú 👩🏽‍🚀"
    tok = engine.tokenizer.backend_tokenizer
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text) // 2
    stream = RequestText(tok, [0], ())
    deltas = [stream.feed(i)[0] for i in ids]
    assert "".join(deltas) + stream.finish()[0] == text
    assert all("\ufffd" not in d for d in deltas)
    # an incomplete character at the end still comes out, as a full decode shows it
    stream = RequestText(tok, [0], ())
    cut = next(i for i in range(len(ids)) if tok.decode(ids[: i + 1]).endswith("\ufffd"))
    partial = ids[: cut + 1]
    got = "".join(stream.feed(i)[0] for i in partial) + stream.finish()[0]
    assert got == tok.decode(partial)
    # and the engine's deltas concatenate to the full decode, for random output
    for i, p in enumerate(prompts(4, seed=3)):
        engine.add(i, p, greedy(25))
    out = run(engine)
    for i, p in enumerate(prompts(4, seed=3)):
        assert result(out[i])[0] == reference(engine, p, 25)[0]


def test_stop_string_split_inside_a_multibyte_run():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(_byte_tokenizer()))
    text = "ab🦀cd🦀ef"
    ids = tok.encode(text).ids
    stream = RequestText(tok, [ids[0]], ("d🦀e",))
    pieces = []
    for i in ids[1:]:
        piece, stopped = stream.feed(i)
        pieces.append(piece)
        if stopped:
            break
    assert stopped and "".join(pieces) == "b🦀c"


def _byte_tokenizer() -> dict:
    """A byte-level BPE with no merges: every byte is a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return json.loads(tok.to_str())


def test_abort_frees_the_request_at_once(engine):
    engine.add(1, "hello world", greedy(100))
    engine.add(2, "the quick brown fox jumps", greedy(100))
    run(engine, steps=3)
    assert engine.running() == 2
    held = engine.cached_tokens()
    assert engine.abort(2) is True
    assert engine.running() == 1 and 0 < engine.cached_tokens() < held
    assert engine.abort(2) is False  # idempotent: it is gone
    engine.add(3, "waiting", greedy(4))
    assert engine.abort(3) is True  # aborted while waiting
    assert engine.abort(1) is True
    assert engine.running() == engine.waiting() == engine.cached_tokens() == 0
    assert engine.next_deadline() is None and engine.step(0.0) == []


def _plain(batch, config):
    """Give ``batch`` transformers' own cache layers (copied at every step, join and leave)."""
    from transformers import DynamicCache

    batch.cache = DynamicCache(
        ((layer.keys.clone(), layer.values.clone()) for layer in batch.cache.layers),
        config=config,
    )


def test_the_batch_cache_changes_in_place_and_computes_what_copies_compute(engine):
    """Rows join (shorter and longer than the batch), leave (the last rows take their
    places) and step, at random: the logits equal those of a batch on transformers' own
    layers, row for row; and in steady state the keys and values stay in the same buffers
    (server/engines/transformers/cache.py), where transformers' layers copied them at every step."""
    from server.engines.transformers.batch import KVBatch
    from server.engines.transformers.cache import RoomyLayer

    config = engine.model.config
    rng = random.Random(7)
    roomy, plain = KVBatch(engine.model), KVBatch(engine.model)

    def prompt(n):
        return [rng.randrange(5, 600) for _ in range(n)]

    with torch.inference_mode():
        first = [prompt(n) for n in (5, 2, 9, 4)]
        a, b = roomy.prefill(first), plain.prefill(first)
        _plain(plain, config)
        layer = roomy.cache.layers[0]
        assert type(layer) is RoomyLayer and type(plain.cache.layers[0]) is not RoomyLayer
        moves, steps, during = 0, 0, collections.Counter()
        for step in range(200):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4), step
            buffer = layer._kbuf.data_ptr()
            action = rng.random()
            kind = "leave" if action < 0.15 and roomy.size > 1 else \
                "join" if action < 0.3 else "step"
            during[kind] += layer.statistics()["migrating"]
            if kind == "leave":  # some rows leave
                gone = rng.sample(range(roomy.size), rng.randint(1, roomy.size - 1))
                order = roomy.remove(gone)
                assert plain.remove(gone) == order
                assert sorted(order) == sorted(set(range(len(order) + len(gone))) - set(gone))
                a, b = a[order], b[order]
            elif kind == "join":  # rows join: shorter than the batch, or longer
                joining = [prompt(rng.randint(1, roomy.length + 8))
                           for _ in range(rng.randint(1, 5))]
                a = torch.cat([a, roomy.prefill(joining)])
                b = torch.cat([b, plain.prefill(joining)])
            else:
                token = [int(x) for x in a.argmax(-1)]
                a, b = roomy.decode(token), plain.decode(token)
                steps += 1
            moves += layer._kbuf.data_ptr() != buffer
            assert roomy.length == plain.length and roomy.size == plain.size
            assert torch.equal(roomy.mask, plain.mask)
        assert steps > 100 and moves < 20  # a move now and then, not at every step
        # (rows joined while new buffers were being filled: those were copied too; for rows
        # that leave meanwhile, see the next test)
        assert during["join"] and during["step"], during
        # Back-to-back streams: the oldest rows leave, young ones join, the batch slides
        # right through its buffers and migrates to new ones, a chunk of columns per step.
        migrations, most = 0, 0.0
        for _ in range(8):
            for _ in range(30):
                token = [int(x) for x in a.argmax(-1)]
                buffer, copied = layer._kbuf.data_ptr(), layer.statistics()["copied"]
                a, b = roomy.decode(token), plain.decode(token)
                assert torch.allclose(a, b, atol=1e-4)
                migrations += layer._kbuf.data_ptr() != buffer
                cache = 2 * roomy.size * roomy.length  # a copy of the whole cache
                most = max(most, (layer.statistics()["copied"] - copied) / cache)
            oldest = [int(i) for i in roomy.positions.argsort(descending=True)[:-1]]
            order = roomy.remove(oldest)
            assert plain.remove(oldest) == order
            joining = [prompt(rng.randint(1, 6)) for _ in range(3)]
            a = torch.cat([a[order], roomy.prefill(joining)])
            b = torch.cat([b[order], plain.prefill(joining)])
            assert torch.allclose(a, b, atol=1e-4)
        assert migrations >= 2 and most < 0.5  # no step copied the whole cache
        # One row runs on alone past its buffer's columns: new, larger buffers.
        order = roomy.remove(list(range(1, roomy.size)))
        assert plain.remove(list(range(1, plain.size))) == order
        a, b, grew = a[order], b[order], 0
        for _ in range(120):
            buffer = layer._kbuf.data_ptr()
            token = [int(x) for x in a.argmax(-1)]
            a, b = roomy.decode(token), plain.decode(token)
            assert torch.allclose(a, b, atol=1e-4)
            grew += layer._kbuf.data_ptr() != buffer
        assert 0 < grew < 10
        # Steady state: a row leaves, a short one joins, steps go on: the same buffers.
        buffer = layer._kbuf.data_ptr()
        roomy.remove([0])
        roomy.prefill([prompt(2)])
        for _ in range(3):
            roomy.decode([7] * roomy.size)
        assert layer._kbuf.data_ptr() == buffer


def test_rows_that_leave_or_join_while_the_cache_migrates_keep_their_columns(engine):
    """While new buffers are filled a chunk of columns per step (server/engines/transformers/cache.py),
    the longest row leaves (the last row takes its place, and the padding columns no row
    needs are dropped), another row leaves (the place of the copy after the drop), and a
    row as long as the batch joins: after the switch to the new buffers, the logits still
    equal those of a batch on transformers' own layers."""
    from server.engines.transformers.batch import KVBatch

    rng = random.Random(11)
    roomy, plain = KVBatch(engine.model), KVBatch(engine.model)

    def prompt(n):
        return [rng.randrange(5, 600) for _ in range(n)]

    with torch.inference_mode():
        first = [prompt(16)] + [prompt(12) for _ in range(4)]
        a, b = roomy.prefill(first), plain.prefill(first)
        _plain(plain, engine.model.config)
        layer = roomy.cache.layers[0]

        def step():
            nonlocal a, b
            token = [int(x) for x in a.argmax(-1)]
            a, b = roomy.decode(token), plain.decode(token)
            assert torch.allclose(a, b, atol=1e-4)

        for _ in range(100):
            if layer.statistics()["migrating"]:
                break
            step()
        assert layer.statistics()["migrating"]
        buffer, start = layer._kbuf.data_ptr(), layer._start
        for gone in (0, 1):
            order = roomy.remove([gone])
            assert plain.remove([gone]) == order and order[gone] == len(order)
            a, b = a[order], b[order]
            step()
        assert layer._start > start  # (the longest row's padding went)
        joining = [prompt(roomy.length)]
        a = torch.cat([a, roomy.prefill(joining)])
        b = torch.cat([b, plain.prefill(joining)])
        assert torch.allclose(a, b, atol=1e-4)
        assert layer.statistics()["migrating"] and layer._kbuf.data_ptr() == buffer
        for _ in range(100):
            step()
            if not layer.statistics()["migrating"]:
                break
        assert layer._kbuf.data_ptr() != buffer  # switched to the new buffers
        for _ in range(3):
            step()


def test_cpu_attention_equals_transformers_sdpa_on_a_padded_batch(engine, model_dir):
    """On a CPU the engine's model attends with grouped heads and the padding mask together
    (server/engines/transformers/attention.py), where transformers' sdpa copies the cache per query
    head: the same logits, for rows of different lengths joining and leaving."""
    from server.engines.transformers import attention
    from server.engines.transformers.batch import KVBatch

    assert engine.model.config._attn_implementation == attention.NAME
    assert engine.model.config.num_key_value_heads < engine.model.config.num_attention_heads
    theirs, _ = load_model(model_dir, attn="sdpa")
    ours_b, theirs_b = KVBatch(engine.model), KVBatch(theirs)
    rng = random.Random(3)
    with torch.inference_mode():
        first = [[rng.randrange(5, 600) for _ in range(n)] for n in (3, 11, 7)]
        a, b = ours_b.prefill(first), theirs_b.prefill(first)
        for step in range(12):
            token = [rng.randrange(5, 600) for _ in range(ours_b.size)]
            if step == 4:
                joining = [[rng.randrange(5, 600) for _ in range(n)] for n in (2, 9)]
                a = torch.cat([ours_b.decode(token), ours_b.prefill(joining)])
                b = torch.cat([theirs_b.decode(token), theirs_b.prefill(joining)])
            elif step == 8:
                ours_b.remove([1])
                theirs_b.remove([1])
                a, b = ours_b.decode(token[:-1]), theirs_b.decode(token[:-1])
            else:
                a, b = ours_b.decode(token), theirs_b.decode(token)
            assert torch.allclose(a, b, atol=1e-4), step
        assert ours_b.mask is not None and not bool(ours_b.mask.all())  # padded throughout


def test_an_abort_in_the_middle_of_the_batch_leaves_the_others_exact(engine):
    """Aborting a row that is not the last moves the last row into its place (in place, in
    the batch's inference tensors, from outside the step): the others go on exactly."""
    ps = prompts(4, seed=11)
    refs = [reference(engine, p, 12) for p in ps]
    outputs: dict = {}
    for i in range(4):
        engine.add(i, ps[i], greedy(12))
    run(engine, outputs, 3)
    engine.add(9, "the quick brown fox", greedy(12))
    run(engine, outputs, 1)
    assert engine.abort(1) is True and engine.abort(9) is True
    run(engine, outputs)
    for i in (0, 2, 3):
        assert result(outputs[i])[:2] == refs[i], f"prompt {i}: {ps[i]!r}"
    assert engine.running() == engine.cached_tokens() == 0


def test_models_that_choose_their_own_attention_load_with_it(model_dir, tmp_path):
    """The CPU attention (server/engines/transformers/attention.py) is asked for only where the model
    looks attention up in transformers' registry: Falcon's layers pick their own classes
    from the name, and know only transformers' ones."""
    import shutil

    from transformers import AutoModelForCausalLM, FalconConfig

    config = FalconConfig(vocab_size=640, hidden_size=64, num_hidden_layers=1,
                          num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2)
    path = tmp_path / "falcon"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    model, _ = load_model(path)
    assert model.config._attn_implementation == "sdpa"


def test_rejections(engine, model_dir, tmp_path):
    limit = engine.max_model_len  # 256 for the tiny model
    long_prompt = list(range(10, 10 + limit + 5))
    with pytest.raises(Rejected, match="maximum context length is 256 tokens"):
        engine.add(1, long_prompt, greedy(4))
    with pytest.raises(Rejected, match=r"requested 300 tokens \(200 in the prompt"):
        engine.add(1, long_prompt[:200], greedy(100))
    with pytest.raises(Rejected, match=f"token id {engine.vocab_size} is out of vocabulary"):
        engine.add(1, [1, 2, engine.vocab_size], greedy(4))
    with pytest.raises(Rejected, match="at least one token"):
        engine.add(1, "", greedy(4))
    with pytest.raises(Rejected, match="max_tokens"):
        engine.add(1, "hi", greedy(0))
    assert engine.waiting() == 0
    bare = TransformersEngine(
        model_path=str(build_tiny_model(tmp_path / "bare", chat_template=False))
    )
    assert bare.info["chat_template"] is None
    with pytest.raises(Rejected, match="has no chat template"):
        bare.add(1, {"messages": [{"role": "user", "content": "hi"}]}, greedy(4))
    assert engine.info["chat_template"] and engine.info["model"] == MODEL


def test_sliding_window_model_is_capped_at_its_window(tmp_path):
    sliding = TransformersEngine(
        model_path=str(build_tiny_model(tmp_path / "mistral", sliding_window=40))
    )
    assert sliding.max_model_len == 40
    with pytest.raises(Rejected, match="maximum context length is 40"):
        sliding.add(1, "hello", greedy(40))
    ps = [p for p in prompts(12, seed=5) if len(sliding.encode(p)) <= 14][:4]
    refs = [reference(sliding, p, 40 - len(sliding.encode(p))) for p in ps]
    out: dict = {}
    for i, p in enumerate(ps):  # each joins two steps after the one before
        sliding.add(i, p, greedy(40 - len(sliding.encode(p))))
        run(sliding, out, 2)
    run(sliding, out)
    assert [result(out[i])[:2] for i in range(len(ps))] == refs
    assert sliding.cached_tokens() == 0


def test_a_failing_step_fails_the_running_requests_and_serving_goes_on(engine, monkeypatch):
    engine.add(1, "hello", greedy(10))
    engine.add(2, "world", greedy(10))
    run(engine, steps=2)

    def boom(tokens):
        raise RuntimeError("CUDA out of memory (simulated)\nmore details")

    monkeypatch.setattr(engine._batch, "decode", boom)
    outs = engine.step(0.0)
    assert sorted(o[0] for o in outs) == [1, 2]
    assert all(o[3] == "error" and o[4][0] == "engine_error" for o in outs)
    assert "CUDA out of memory (simulated)" in outs[0][4][1] and "\n" not in outs[0][4][1]
    assert engine.running() == engine.cached_tokens() == 0
    monkeypatch.undo()
    engine.add(3, "hello", greedy(10))
    assert result(run(engine)[3])[:2] == reference(engine, "hello", 10)


def test_broken_model_directories_give_one_clear_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .* does not exist"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="cannot load") as info:
        load_model(str(broken))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="model_path"):
        TransformersEngine()


# -- 2. real worker processes -------------------------------------------------------------------


def hf_config(model_dir, **options) -> server.EngineConfig:
    return server.EngineConfig(
        engine="transformers",
        engine_options={"model_path": str(model_dir), "num_threads": 1, **options},
        drain_timeout=5.0,
    )


async def collect(engine, prompt, params) -> tuple[str, int, str]:
    texts, ntok, finish = [], 0, None
    async with engine.generate(prompt, params) as stream:
        async for out in stream:
            texts.append(out.text)
            ntok += out.num_tokens
            finish = out.finish_reason or finish
    return "".join(texts), ntok, finish


async def test_workers_greedy_concurrent_and_cancel(model_dir, engine):
    ps = prompts(5, seed=11)
    lengths = [20, 6, 28, 13, 9]
    refs = [reference(engine, p, n) for p, n in zip(ps, lengths)]
    results = [None] * len(ps)
    with trio.fail_after(LIMIT):
        async with server.open_engine(hf_config(model_dir)) as hf:
            assert hf.model_name == MODEL and hf.info["max_model_len"] == 256

            async def one(i):
                await trio.sleep(0.01 * i)  # they join the running batch at different steps
                params = SamplingParams(max_tokens=lengths[i], temperature=0)
                results[i] = await collect(hf, ps[i], params)

            async with trio.open_nursery() as nursery:
                for i in range(len(ps)):
                    nursery.start_soon(one, i)
            for i, (text, ntok) in enumerate(refs):
                assert results[i][:2] == (text, ntok), f"prompt {i}"

            # cancelling the consumer aborts the request in the worker
            with trio.CancelScope() as scope:
                async with hf.generate("hello", SamplingParams(max_tokens=200)) as stream:
                    n = 0
                    async for _ in stream:
                        n += 1
                        if n == 3:
                            scope.cancel()
            assert await hf.ping_all() == [(0, 0)]

            # a client fault is raised from the loop as a ClientError, before any text
            outs = []
            with pytest.raises(server.ClientError, match="maximum context length") as info:
                async with hf.generate(list(range(10, 300)), SamplingParams(max_tokens=4)) as s:
                    async for o in s:
                        outs.append(o)
            assert outs == [] and info.value.output.error_kind == "invalid_request"


async def test_worker_with_a_missing_model_dir_fails_to_start(tmp_path, capfd):
    with trio.fail_after(LIMIT):
        with pytest.raises(BaseException) as info:
            async with server.open_engine(hf_config(tmp_path / "missing")):
                pass  # pragma: no cover
    exc = info.value
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # open_engine's nurseries may wrap it
    assert isinstance(exc, server.WorkerStartupError)
    err = capfd.readouterr().err.strip().splitlines()
    lines = [line for line in err if "cannot start engine" in line]
    assert lines == [
        f"trio-llm-server worker: cannot start engine: model directory {tmp_path / 'missing'} "
        "does not exist"
    ]
    assert not any(line.startswith("Traceback") for line in err)


# -- 3. the HTTP server, with the openai SDK ----------------------------------------------------


async def test_keywords_the_grammar_would_drop_are_a_400_naming_them(transformers_url):
    """A schema keyword xgrammar cannot enforce is refused by name and place, on every path
    a schema reaches the grammar (issue 29 item 7: bench/schema_validity.py found answers
    that finished and did not validate); what it enforces is served."""
    unique = {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}}}
    negated = {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    union = {"$defs": {"A": {"type": "object", "additionalProperties": False,
                             "required": ["k"], "properties": {"k": {"const": "a"}}},
                       "B": {"type": "object", "additionalProperties": False,
                             "required": ["k", "n"], "properties": {
                                 "k": {"const": "b"}, "n": {"type": "integer"}}}},
             "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    tool = {"type": "function", "function": {"name": "f", "parameters": negated}}
    with trio.fail_after(3 * LIMIT):  # three grammars compiled
        async with httpx.AsyncClient(base_url=transformers_url, timeout=LIMIT) as http:
            for body, param, where in [
                ({"response_format": {"type": "json_schema", "json_schema": {
                    "name": "t", "schema": unique}}}, "response_format",
                 "'uniqueItems' at #/properties/tags is not enforced"),
                ({"structured_outputs": {"json": {"type": "string", "pattern": "^(?!x)."}}},
                 "structured_outputs", "'pattern' at # is not enforced"),
                ({"tools": [tool], "tool_choice": {"type": "function", "function": {
                    "name": "f"}}}, "tool_choice", "/properties/x is not enforced"),
            ]:
                r = await http.post("/v1/chat/completions", json={**chat, **body})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["message"].startswith(param) and where in error["message"]
            r = await http.post("/v1/chat/completions", json={
                **chat, "max_tokens": 60, "temperature": 0, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "u", "schema": union}}})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            value = json.loads(choice["message"]["content"])
            pytest.importorskip("jsonschema").validate(value, union)


async def test_http_end_to_end(transformers_server, transformers_url, engine):
    """(The reference: this module's ``engine``, on its own build of the same tiny model.)"""
    ps = prompts(3, seed=21)
    lengths = [16, 7, 24]
    refs = [reference(engine, p, n) for p, n in zip(ps, lengths)]
    chat = [{"role": "user", "content": "hello 世界 🙂"}]
    chat_ref = reference(engine, {"messages": chat}, 12)
    with trio.fail_after(LIMIT):
        client = openai.AsyncOpenAI(base_url=transformers_url + "/v1", api_key="x", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        full, streamed = [None] * 3, [None] * 3

        async def plain(i):
            r = await client.completions.create(
                model=MODEL, prompt=ps[i], max_tokens=lengths[i], temperature=0
            )
            full[i] = (r.choices[0].text, r.usage.completion_tokens)

        async def stream(i):
            s = await client.completions.create(
                model=MODEL, prompt=ps[i], max_tokens=lengths[i], temperature=0, stream=True
            )
            streamed[i] = "".join([c.choices[0].text async for c in s if c.choices])

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(plain, i)
                nursery.start_soon(stream, i)
        assert full == refs
        assert streamed == [text for text, _ in refs]
        assert any(ord(c) > 0x7F for text, _ in refs for c in text)

        r = await client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=12, temperature=0
        )
        assert (r.choices[0].message.content, r.usage.completion_tokens) == chat_ref
        prompt_tokens = len(engine.encode({"messages": chat}))
        assert r.usage.prompt_tokens == prompt_tokens

        # a stop string: the text up to it, finish_reason stop
        text = refs[2][0]
        stop = text[6:9]
        r = await client.completions.create(
            model=MODEL, prompt=ps[2], max_tokens=lengths[2], temperature=0, stop=[stop]
        )
        assert r.choices[0].text == text[: text.index(stop)]
        assert r.choices[0].finish_reason == "stop"

        # a field the engine declares reaches it: top_k=1 at temperature 1 is greedy
        r = await client.completions.create(
            model=MODEL, prompt=ps[2], max_tokens=lengths[2], temperature=1.0,
            extra_body={"top_k": 1},
        )
        assert r.choices[0].text == text

        # /tokenize and /detokenize, answered by the worker's tokenizer
        async with httpx.AsyncClient(base_url=transformers_url) as http:
            r = await http.post("/tokenize", json={"model": MODEL, "prompt": ps[0]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["tokens"] == engine.encode(ps[0])
            assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
            assert body["max_model_len"] == engine.max_model_len
            r = await http.post("/tokenize", json={"messages": chat})
            assert r.json()["count"] == prompt_tokens
            # tools and template variables, rendered as a chat request renders them
            tools = [{"type": "function", "function": {
                "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }}]
            with_tools = {"messages": chat, "tools": tools,
                          "chat_template_kwargs": {"enable_thinking": True}}
            r = await http.post("/tokenize", json=with_tools)
            assert r.status_code == 200, r.text
            rendered = engine.encode({"messages": chat}, {"enable_thinking": True}, tools)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == rendered and len(rendered) > prompt_tokens + 10
            r = await http.post("/tokenize", json={"prompt": "x", "tools": tools})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
            r = await http.post("/detokenize", json={"tokens": body["tokens"]})
            assert r.json() == {"prompt": ps[0]}
            r = await http.post("/detokenize", json={"tokens": [10**6]})
            assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]

        # logprobs: completions (legacy shape, echo gives the prompt's), chat, streaming
        r_echo = r = await client.completions.create(
            model=MODEL, prompt=ps[0], max_tokens=5, temperature=0, logprobs=2, echo=True
        )
        lp = r.choices[0].logprobs
        n_prompt = r.usage.prompt_tokens
        assert len(lp.tokens) == n_prompt + 5 == len(lp.token_logprobs)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
        s = await client.completions.create(
            model=MODEL, prompt=ps[0], max_tokens=5, temperature=0, logprobs=0, stream=True
        )
        chunks = [c.choices[0].logprobs async for c in s if c.choices and c.choices[0].logprobs]
        streamed_tokens = [t for c in chunks for t in c.tokens]
        assert streamed_tokens == lp.tokens[n_prompt:]
        offsets = [o for c in chunks for o in c.text_offset]
        assert offsets == [x - lp.text_offset[n_prompt] for x in lp.text_offset[n_prompt:]]
        r = await client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=4, temperature=0, logprobs=True,
            top_logprobs=3,
        )
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 4
        assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
        s = await client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=4, temperature=0, logprobs=True, stream=True
        )
        streamed = [e async for c in s if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
        assert all(e.top_logprobs == [] for e in streamed)
        s = await client.completions.create(
            model=MODEL, prompt=ps[0], max_tokens=5, temperature=0, logprobs=2, echo=True,
            stream=True,
        )
        chunks = [c.choices[0] async for c in s if c.choices]
        assert "".join(c.text for c in chunks) == r_echo.choices[0].text
        merged = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        assert merged == lp.tokens
        assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
        with pytest.raises(openai.BadRequestError, match="between 0 and 20"):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=21)

        # chat_template_kwargs reach the template; reserved names and completions refuse
        r = await client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=2,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        assert r.usage.prompt_tokens == len(
            engine.encode({"messages": chat}, {"enable_thinking": True})
        ) > prompt_tokens
        for where, body in (
            ("chat", {"chat_template_kwargs": {"tokenize": True}}),
            ("completions", {"chat_template_kwargs": {"enable_thinking": True}}),
        ):
            with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
                if where == "chat":
                    await client.chat.completions.create(
                        model=MODEL, messages=chat, max_tokens=2, extra_body=body)
                else:
                    await client.completions.create(
                        model=MODEL, prompt="x", max_tokens=2, extra_body=body)

        # structured output: the SDK's response_format, streaming and not
        import jsonschema

        schema = SCHEMAS[2]
        fmt = {"type": "json_schema",
               "json_schema": {"name": "thing", "schema": schema, "strict": True}}
        r = await client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=80, temperature=0, response_format=fmt
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        s = await client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=80, temperature=0, response_format=fmt,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
        assert text == r.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="response_format"):
            await client.chat.completions.create(
                model=MODEL, messages=chat, max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "x"}},
            )

        # a client that goes away mid-stream: the worker drops the request
        s = await client.completions.create(
            model=MODEL, prompt="hello", max_tokens=200, stream=True
        )
        n = 0
        async for _ in s:
            n += 1
            if n == 3:
                break
        await s.close()
        await trio.to_thread.run_sync(transformers_server.assert_idle)

        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(
                model=MODEL, prompt="the quick brown fox " * 100, max_tokens=4
            )
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(
                model=MODEL, prompt="hello", max_tokens=1000, stream=True
            )
        await client.close()


def test_continue_final_message_leaves_the_last_message_open(engine):
    # vLLM's continue_final_message: the template renders the final assistant message
    # without its end of turn (and no generation prompt), so the answer continues it
    from server.workers.base import encode_prompt

    messages = [{"role": "user", "content": "tell me a saying"},
                {"role": "assistant", "content": "An apple a day keeps"}]

    def rendered(**options) -> str:
        ids = encode_prompt({"messages": messages, **options}, engine.tokenizer,
                            vocab_size=engine.vocab_size, chat=True, model="m")
        return engine.tokenizer.decode(ids)

    assert rendered(continue_final_message=True, add_generation_prompt=False).endswith(
        "An apple a day keeps")
    assert not rendered().endswith("An apple a day keeps")
    assert len(rendered(add_generation_prompt=False)) < len(rendered())
