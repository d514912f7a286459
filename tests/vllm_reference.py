"""The reference for tests/test_vllm_engine.py: ``vllm.LLM`` on a model, in a process of its
own, answering one JSON line per JSON line on stdin.

Its own process because vLLM, when it builds an engine, walks every loaded module's globals
with ``hasattr``, and Quart's context-local proxies (loaded in the test process) raise
RuntimeError from it. It also runs the checks of :class:`server.engines.vllm.engine.VLLMEngine`
that need vLLM in process (wrapping this LLM's engine, no second model load).

Requests: ``{"op": "generate", "prompts": [...], "max_tokens": n, "params": {...}}`` ->
``[[text, tokens], ...]`` (with ``"lora": [name, int_id, path]``: with that
``LoRARequest``); ``{"op": "logprobs", "prompt": s, "max_tokens": n, "k": k}`` ->
the chosen tokens' and the prompt's logprobs; ``{"op": "encode", "text": s}`` -> ids; ``{"op": "decode",
"ids": [...]}`` -> text; ``{"op": "engine_failure"}`` and ``{"op": "engine_abort"}`` -> what
the engine did.
"""

from __future__ import annotations

import json
import os
import sys


def checks_apart(tmp_path, checks: str) -> None:
    """Build the vllm tests' tiny model under ``tmp_path`` and call ``checks``
    (``"module:function"``) with its path in a Python process of its own (in pytest's, vLLM's
    start fails: see above), asserting that it exits 0 and its last line says "checks
    passed"."""
    import subprocess

    from tests.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", hidden_size=256, heads=4, layers=2,
                            vocab_size=1000, max_position_embeddings=1024)
    module, function = checks.split(":")
    code = f"from {module} import {function}; {function}({str(path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("checks passed"), proc.stdout[-2000:]


def main() -> None:
    from server.engines.vllm.engine import ENVIRONMENT

    # Answers on a private copy of stdout; vLLM's own prints go to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    os.environ.update(ENVIRONMENT)
    import vllm

    options = json.loads(sys.argv[1])
    llm = vllm.LLM(**options)
    tok = llm.get_tokenizer()
    print(json.dumps("ready"), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "generate":
            params = vllm.SamplingParams(max_tokens=req["max_tokens"], **req.get("params", {}))
            from vllm.lora.request import LoRARequest

            lora = req.get("lora")  # one [name, id, path] for all, or one (or None) each
            if lora and isinstance(lora[0], str):
                lora = LoRARequest(*lora)
            elif lora:
                lora = [None if x is None else LoRARequest(*x) for x in lora]
            outs = llm.generate(req["prompts"], params, use_tqdm=False, lora_request=lora)
            answer: object = [[o.outputs[0].text, len(o.outputs[0].token_ids)] for o in outs]
        elif op == "logprobs":
            params = vllm.SamplingParams(max_tokens=req["max_tokens"], temperature=0,
                                         logprobs=req["k"], prompt_logprobs=req["k"])
            o = llm.generate([req["prompt"]], params, use_tqdm=False)[0]
            c = o.outputs[0]
            answer = {
                "tokens": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                "prompt": [None if lp is None else lp[t].logprob
                           for t, lp in zip(o.prompt_token_ids, o.prompt_logprobs)],
            }
        elif op == "encode":
            answer = list(tok.encode(req["text"]))
        elif op == "decode":
            answer = tok.decode(req["ids"])
        elif op == "engine_failure":
            answer = engine_failure(llm)
        elif op == "engine_abort":
            answer = engine_abort(llm)
        else:
            answer = {"unknown op": op}
        print(json.dumps(answer), file=out, flush=True)


def engine_failure(llm) -> dict:
    """A failure inside vLLM's step: every held request fails, and EngineBroken says so."""
    from server.workers.base import EngineBroken
    from server.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(llm_engine=llm.llm_engine, warmup=False)
    prompt_tokens = [
        engine.add(1, "hello", {"max_tokens": 50, "temperature": 0}),
        engine.add(2, [5, 6, 7], {"max_tokens": 50, "temperature": 0}),
    ]
    engine.step(0.0)
    real = llm.llm_engine.step

    def boom():
        raise RuntimeError("CUDA error: an illegal memory access\nand more lines")

    llm.llm_engine.step = boom
    try:
        engine.step(0.0)
        raised = None
    except EngineBroken as exc:
        raised = {"message": exc.message, "rows": sorted(list(r) for r in exc.outputs)}
    finally:
        llm.llm_engine.step = real
    llm.llm_engine.abort_request(["1", "2"])
    return {"prompt_tokens": prompt_tokens, "raised": raised,
            "left": llm.llm_engine.get_num_unfinished_requests()}


def engine_abort(llm) -> dict:
    """An abort removes the request from vLLM's scheduler before it returns."""
    from server.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(llm_engine=llm.llm_engine, warmup=False)
    engine.add(7, "hello", {"max_tokens": 50, "temperature": 0})
    engine.step(0.0)
    held = engine.running() + engine.waiting()
    first = engine.abort(7)
    return {
        "held_before": held,
        "abort": first,
        "held_after": engine.running() + engine.waiting(),
        "vllm_unfinished": llm.llm_engine.get_num_unfinished_requests(),
        "abort_again": engine.abort(7),
        "deadline": engine.next_deadline(),
    }


if __name__ == "__main__":
    main()
