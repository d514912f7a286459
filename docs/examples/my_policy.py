"""A user's own code on top of the engine: a deadline policy and an error fallback.

Tested in virtual time by docs/examples/test_my_policy.py with the testing kit
(docs/testing.md).
"""

from __future__ import annotations

import trio

import server


async def answer_within(engine: server.Engine, prompt: str, seconds: float) -> tuple[str, bool]:
    """The text generated for ``prompt`` within ``seconds``, and whether it was cut short
    (the engine request is then aborted: leaving the block cancels it)."""
    text = ""
    with trio.move_on_after(seconds) as scope:
        async with engine.generate(prompt, server.SamplingParams(max_tokens=1000)) as stream:
            async for out in stream:
                text += out.text
    return text, scope.cancelled_caught


async def answer_or_fallback(
    engine: server.Engine, prompt: str, params: server.SamplingParams, fallback: str
) -> str:
    """The generated text, or ``fallback`` when the engine fails the request (a client fault,
    such as a prompt over the context, is not hidden: it propagates)."""
    try:
        async with engine.generate(prompt, params) as stream:
            return "".join([out.text async for out in stream])
    except server.EngineError:
        return fallback
