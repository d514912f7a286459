"""Tests of a user's own code (docs/examples/my_policy.py) against the engine, in virtual
time, with the testing kit (docs/testing.md). Run from the project root:

    python -m pytest docs/examples/test_my_policy.py
"""

from __future__ import annotations

import pytest
import trio

import server
from server.testing import fault, sim_engine_config
from server.testing.pytest_plugin import llm_engine  # noqa: F401 - the fixture

from my_policy import answer_or_fallback, answer_within


@pytest.fixture
def llm_engine_config():
    # 20 ms to the first token, then one token every 100 ms.
    return sim_engine_config(ttft_ms=20, itl_ms=100)


async def test_a_slow_answer_is_cut_at_the_deadline(llm_engine, autojump_clock):
    start = trio.current_time()
    text, cut = await answer_within(llm_engine, "tell me everything", seconds=2.0)
    assert cut and trio.current_time() - start == pytest.approx(2.0)
    assert len(text.split()) == 20  # tokens at 0.02, 0.12, ..., 1.92 s
    # The request was aborted on the engine: the fixture checks that nothing is left.


async def test_an_engine_failure_falls_back(llm_engine, autojump_clock):
    params = server.SamplingParams(max_tokens=10, extra=fault("error", after=2))
    assert await answer_or_fallback(llm_engine, "x", params, "sorry") == "sorry"


async def test_a_client_fault_is_not_hidden(llm_engine, autojump_clock):
    params = server.SamplingParams(max_tokens=10_000)  # over the sim's 8192-token context
    with pytest.raises(server.ClientError, match="maximum context length"):
        await answer_or_fallback(llm_engine, "x", params, "sorry")
