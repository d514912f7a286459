"""Migration end to end on the transformers and vllm engines (issue 24): two real worker
processes on the tiny model (tests/tiny_model.py), one SIGKILLed mid-stream; its streams go
on on the other with the text of an uninterrupted run, each token counted once, no error.
The sans-IO side (every cut, stop strings, grammars, seeds): tests/test_resume_engines.py.
No timing bounds; the vLLM test is slow (two engine loads, and a third for the restart)."""

from __future__ import annotations

import importlib.util

import pytest

# Both engines run the tiny model (vLLM brings all three).
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import trio  # noqa: E402

from server import EngineConfig, SamplingParams  # noqa: E402
from tests.fakes import all_outputs, open_real_engine, wait_for  # noqa: E402
from tests.test_migration import kill_worker, resumes  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

LIMIT = 1200  # seconds: vLLM's loads on a busy 2-core machine take minutes
PROMPTS = ("the quick 東京 brown fox", "🦊 jumps over the lazy café")


async def killed_mid_stream(config: EngineConfig) -> None:
    """The uninterrupted runs first (the reference), then the same requests, with stop
    strings that hold text back (never complete), while one worker is SIGKILLed."""
    greedy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with trio.fail_after(LIMIT):
        async with open_real_engine(config, settle=10.0) as (engine, spawn):
            reference = {}
            for prompt in PROMPTS:
                async with engine.generate(prompt, greedy) as stream:
                    outs = await all_outputs(stream)
                reference[prompt] = ("".join(o.text for o in outs), outs[-1].completion_tokens,
                                     outs[-1].finish_reason)
            text = reference[PROMPTS[0]][0]
            held = tuple(text[i:i + 3] + "\x00" for i in range(1, 60, 6))
            params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=held)
            streams = [engine.generate(p, params) for p in PROMPTS]
            results: dict[str, list] = {}

            async def consume(prompt, stream):
                async with stream:
                    results[prompt] = await all_outputs(stream)

            async with trio.open_nursery() as nursery:
                for prompt, stream in zip(PROMPTS, streams):
                    nursery.start_soon(consume, prompt, stream)
                [doomed] = [s for s in streams if s.choice_states()[0].worker.index == 0]
                [choice] = doomed.choice_states()
                await wait_for(lambda: choice.completion_tokens >= 3, timeout=LIMIT)
                kill_worker(engine, 0)
            stats = engine.statistics().migration
            assert stats is not None and stats.migrations["exited"] == 1
            assert choice.migrations == 1 and len(resumes(spawn)) == 1
    for prompt in PROMPTS:
        outs = results[prompt]
        assert outs[-1].error_kind is None, outs[-1].error
        got = ("".join(o.text for o in outs), outs[-1].completion_tokens, outs[-1].finish_reason)
        assert got == reference[prompt], prompt  # each token counted once
        assert outs[-1].prompt_tokens == outs[0].prompt_tokens  # the client's prompt


async def test_transformers_streams_go_on_with_the_uninterrupted_text(tmp_path):
    path = build_tiny_model(tmp_path / "tiny")
    await killed_mid_stream(EngineConfig(
        engine="transformers", workers=2, routing="round-robin", drain_timeout=5.0,
        startup_timeout=LIMIT, engine_options={"model_path": str(path)}))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
async def test_vllm_streams_go_on_with_the_uninterrupted_text(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", hidden_size=256, heads=4, layers=2,
                            vocab_size=1000, max_position_embeddings=1024)
    await killed_mid_stream(EngineConfig(
        engine="vllm", workers=2, routing="round-robin", drain_timeout=5.0,
        startup_timeout=LIMIT, engine_options={
            "model_path": str(path), "max_model_len": 1024, "dtype": "float32",
            "engine_args": {"kv_cache_memory_bytes": 64 << 20,
                            "enforce_eager": True}}))  # (no compilation: ~13 s of CPU each)
