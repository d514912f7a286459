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

With ``--checks MODEL_PATH`` it runs checks instead (:class:`ChecksApart`: tests/conftest.py's
``vllm_checks``): one ``"module:function"`` a line, each called with the model's path, each
answered ``"passed"`` or the traceback; the checks share :func:`apart_engine`.
"""

from __future__ import annotations

import json
import os
import sys


#: The checks' engine options (:func:`apart_engine`), as a worker takes them: the tiny
#: model's whole context, float32, a small KV cache. ``enforce_eager`` (``--enforce-eager``)
#: because no check looks at vLLM's compiled graph, which costs ~10 s of CPU a start.
APART_OPTIONS = {"max_model_len": 1024, "dtype": "float32"}
APART_ARGS = {"kv_cache_memory_bytes": 64 << 20, "enforce_eager": True}
#: Seconds a check may run in :class:`ChecksApart`: a bound on a hang, not on speed.
CHECK_LIMIT = 1500


def build_checks_model(tmp_path):
    """The checks' tiny model (vLLM's CPU attention needs a head size of at least 32)."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path / "tiny", hidden_size=256, heads=4, layers=2,
                            vocab_size=1000, max_position_embeddings=1024)


_apart: dict = {}


def apart_engine(path: str, **engine_args):
    """The vllm engine on ``path`` with :data:`APART_OPTIONS` and ``engine_args`` (beyond
    :data:`APART_ARGS`), built once per process for every check that asks for the same, so
    that checks in several modules share one start-up. One at a time: another is closed
    before a different one is built (vLLM keeps process-wide state). A check leaves it
    holding nothing (:func:`checks_main` makes sure)."""
    from server.engines.vllm.engine import VLLMEngine

    key = json.dumps([path, engine_args], sort_keys=True)
    if _apart.get("key") != key:
        close_apart_engine()
        engine = VLLMEngine(model_path=path, **APART_OPTIONS,
                            engine_args={**APART_ARGS, **engine_args})
        _apart.update(key=key, engine=engine)
    return _apart["engine"]


def close_apart_engine() -> None:
    engine = _apart.pop("engine", None)
    _apart.clear()
    if engine is not None:
        engine.close()


def checks_main(path: str) -> None:
    """``--checks``: each line's check called with ``path``; after it, the shared engine
    holds no request and the check left no process (else the answer says so, and the
    engine is closed, so that the next check gets a clean one)."""
    import importlib
    import traceback

    from tests.processes import child_pids

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        module, function = line.strip().split(":")
        before = child_pids()
        try:
            getattr(importlib.import_module(module), function)(path)
            answer = "passed"
        except BaseException:
            answer = traceback.format_exc()[-4000:]
        engine = _apart.get("engine")
        left = 0 if engine is None else engine._llm.get_num_unfinished_requests()
        if left:  # (vLLM's own count: its wrappers' requests too)
            answer += f"; left {left} request(s) in the shared engine"
            close_apart_engine()
        if child_pids() - before:
            answer += f"; left processes {sorted(child_pids() - before)}"
        print(json.dumps(answer), file=out, flush=True)
    close_apart_engine()


class ChecksApart:
    """A Python process of its own (in pytest's, vLLM's start fails: see above) that runs
    the checks needing vLLM in process, one after another, on one tiny model: a session's
    (tests/conftest.py's ``vllm_checks``), so that they share :func:`apart_engine`'s
    start-up."""

    def __init__(self, tmp_path) -> None:
        import subprocess

        path = build_checks_model(tmp_path)
        self.log = tmp_path / "checks.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.vllm_reference", "--checks", str(path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

    def run(self, checks: str) -> None:
        """Call ``checks`` (``"module:function"``) there; assert that it passed."""
        import select

        assert self.proc.poll() is None, "the checks process died:\n" + self.tail()
        self.proc.stdin.write(checks + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CHECK_LIMIT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"{checks}: no answer (hung or died):\n" + self.tail())
        answer = json.loads(line)
        assert answer == "passed", f"{checks}:\n{answer}\n{self.tail()}"

    def tail(self) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-30:])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def checks_apart(tmp_path, checks: str) -> None:
    """Build the vllm tests' tiny model under ``tmp_path`` and call ``checks``
    (``"module:function"``) with its path in a Python process of its own (in pytest's, vLLM's
    start fails: see above), asserting that it exits 0 and its last line says "checks
    passed". (:class:`ChecksApart` runs several in one process.)"""
    import subprocess

    path = build_checks_model(tmp_path)
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
    if sys.argv[1] == "--checks":  # (as tests.vllm_reference, the module the checks import,
        from tests.vllm_reference import checks_main  # not __main__: one apart_engine)

        checks_main(sys.argv[2])
    else:
        main()
