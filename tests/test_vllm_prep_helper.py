"""The vllm engine's heavy preparation in the worker's helper process
(server/workers/prep_helper.py, prep_child.py), as tests/test_prep_helper.py checks the
transformers engine's: the helper's token ids and /tokenize answers are the worker's own
(vLLM's tokenizer), a client fault there is the same client fault, a light request stays
in the worker, and no process is left behind. The engine runs in a process of its own (as
in tests/test_resume_engines.py: vLLM sets process-wide state), shared with
tests/test_structured_defaults.py's vllm checks (tests/conftest.py's ``vllm_checks``: one
engine start-up for both); the helper dying under a real server is in
tests/test_vllm_engine.py."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from tests.vllm_reference import APART_OPTIONS  # noqa: E402

CONTEXT = APART_OPTIONS["max_model_len"]


def test_the_helper_prepares_as_the_vllm_worker_does(vllm_checks):
    vllm_checks.run("tests.test_vllm_prep_helper:vllm_helper_checks")


def _generate(engine, rid: int, prompt, params: dict) -> tuple[int, str]:
    """(prompt tokens, text) of one request run alone."""
    ntok = engine.add_prepared(rid, engine.prepare(prompt, params))
    rows: list = []
    while engine.next_deadline() is not None:
        rows += engine.step(0.0)
    return ntok, "".join(r[1] for r in rows if r[0] == rid)


def vllm_helper_checks(path: str) -> None:
    """The checks (run by the test above, in a process of its own): everything through the
    helper (threshold 0 bytes), on the checks' shared vLLM build. (Nothing here imports
    tests.conftest: vLLM's kernel dispatcher scans the loaded modules' globals when it builds
    an engine, and Quart's context proxies raise when touched outside an app.)"""
    from server.engines.vllm.engine import VLLMEngine
    from tests.vllm_reference import apart_engine

    engine = VLLMEngine(llm_engine=apart_engine(path)._llm, warmup=False,
                        prepare_process_bytes=0, prepare_process_nice=0)
    try:
        _checks(engine)
    finally:
        engine.stop_helper()  # (the shared build goes on: only this wrapper's helper)
    print("vllm helper checks passed")


def _checks(engine) -> None:
    from server.worker_protocol import wire
    from server.workers.base import HFTokenizing, Rejected, encode_text
    from server.engines.vllm.engine import VLLMEngine
    from tests.processes import child_pids
    from tests.test_tokenize_fast import TEXTS

    before = child_pids()
    engine.start_helper()
    # the GIL-free path gives vLLM's tokenizer's own ids (as tests/test_tokenize_fast)
    for text in TEXTS:
        assert encode_text(engine.tokenizer, text) == engine.tokenizer.encode(text), text
    chat = {"messages": [{"role": "user", "content": "héllo " * 50}]}
    for prompt in ("hello world", chat, "héllo 日本 🙂\n\ttabs"):
        assert engine.encode_prompt(prompt) == engine.encode(prompt), prompt
    helpers = child_pids() - before
    assert len(helpers) == 1, helpers  # the helper process (vLLM's core is in here)
    for request in ({"op": "tokenize", "prompt": "x" * 40_000},
                    {"op": "tokenize", "prompt": "hi there", "add_special_tokens": False},
                    {"op": "tokenize", "prompt": chat}):
        packed = engine.tokenize(request)
        assert type(packed) is wire.Packed, request
        here = HFTokenizing.tokenize(engine, request)
        assert (wire.encode([wire.RESULT, 1, packed, None])
                == wire.encode([wire.RESULT, 1, here, None]))
    # a client fault in the helper is the same client fault
    too_long = "a" * (CONTEXT * 64)
    with pytest.raises(Rejected, match="maximum context length"):
        engine.prepare(too_long, {"max_tokens": 1})
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    there = _generate(engine, 1, chat, greedy)
    engine.stop_helper()
    assert child_pids() == before
    assert _generate(engine, 2, chat, greedy) == there  # prepared in this process
    # the default threshold (on the same vLLM): light requests stay in the worker
    default = VLLMEngine(llm_engine=engine._llm, warmup=False)
    off = VLLMEngine(llm_engine=engine._llm, warmup=False, prepare_process=False)
    try:
        default.start_helper()
        off.start_helper()  # (prepare_process off: none)
        assert isinstance(default.tokenize({"op": "tokenize", "prompt": "hello"}), dict)
        heavy = {"op": "tokenize", "prompt": "x" * 40_000}
        assert type(default.tokenize(heavy)) is wire.Packed
        assert len(child_pids() - before) == 1
        assert isinstance(off.tokenize(heavy), dict)
    finally:
        default.stop_helper()
    assert child_pids() == before
