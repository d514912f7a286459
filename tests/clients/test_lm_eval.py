"""lm-eval (https://github.com/EleutherAI/lm-evaluation-harness): its API models driven as
an evaluation drives them, without the hub: ``local-completions`` with its defaults
(token-id prompts, ``echo`` and ``logprobs: 1`` for loglikelihoods; the tokenizer from the
model's directory), loglikelihoods checked against the model run directly in transformers,
rolling loglikelihoods and ``generate_until``; ``local-chat-completions`` generating with
stop sequences, and with lm-eval's defaults (no generation arguments: lm-eval then sends
its own ``max_tokens``, 256, and ``temperature`` 0, so it never sends a body without a
token limit)."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL, in_thread, serving

pytest.importorskip("lm_eval")
openai_completions = pytest.importorskip("lm_eval.models.openai_completions")

PAIRS = [("the quick brown fox", " jumps over"), ("hello world", " 🙂 🚀"),
         ("日本語 model", " token stream")]


def direct_loglikelihoods(model_dir, lm) -> list[tuple[float, bool]]:
    """Each continuation's log-probability and whether greedy decoding writes it: the model
    run directly, on the tokens lm-eval sends."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for context, continuation in PAIRS:
        whole = lm.tok_encode(context + continuation)
        n = len(whole) - len(lm.tok_encode(context))
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits[0, :-1].double()
        logprobs = torch.log_softmax(logits, -1)[-n:]
        wanted = torch.tensor(whole[-n:])
        out.append((float(logprobs.gather(1, wanted[:, None]).sum()),
                    bool((logprobs.argmax(-1) == wanted).all())))
    return out


def drive(url: str, model_dir) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr

    lm = openai_completions.LocalCompletionsAPI(
        model=MODEL, base_url=url + "/v1/completions", tokenizer=str(model_dir),
        num_concurrent=2, max_retries=1, max_length=1024)
    assert lm.tokenized_requests  # the default: token ids, echoed
    asked = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    got = lm.loglikelihood(asked)
    expected = direct_loglikelihoods(model_dir, lm)
    for (lp, greedy), (want_lp, want_greedy) in zip(got, expected):
        assert lp == pytest.approx(want_lp, abs=1e-3) and greedy == want_greedy
    (rolling,) = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, ("the lazy dog over the café",), 0)])
    assert rolling < 0
    until = {"until": ["."], "max_gen_toks": 12, "do_sample": False}
    texts = lm.generate_until([Instance("generate_until", {}, ("the quick", until), 0)])
    assert isinstance(texts[0], str) and "." not in texts[0]

    chat = openai_completions.LocalChatCompletion(
        model=MODEL, base_url=url + "/v1/chat/completions", num_concurrent=1, max_retries=1)
    messages = JsonChatStr(json.dumps([{"role": "user", "content": "the quick brown fox"}]))
    texts = chat.generate_until([Instance("generate_until", {}, (messages, until), 0)])
    assert isinstance(texts[0], str) and "." not in texts[0]
    texts = chat.generate_until([Instance("generate_until", {}, (messages, {}), 0)])
    assert isinstance(texts[0], str)


async def test_lm_eval_api_models(model_dir):
    async with serving(model_dir) as url:
        await in_thread(drive, url, model_dir)
