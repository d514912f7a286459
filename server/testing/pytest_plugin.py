"""pytest fixtures for tests of code that uses the engine, under pytest-trio.

Enable them in your root ``conftest.py``::

    pytest_plugins = ["server.testing.pytest_plugin"]

(or with ``pytest -p server.testing.pytest_plugin``, or by importing the two fixtures into
a test module). Then::

    async def test_something(llm_engine, autojump_clock):
        async with llm_engine.generate("hi", SamplingParams(max_tokens=3)) as stream:
            ...

``llm_engine`` is an engine on in-memory sim workers (:mod:`server.testing`), safe under
``autojump_clock``; after the test it checks that nothing was left in the manager or any
worker. Override ``llm_engine_config`` to change the engine (speed, batch size, context
length, faults).
"""

from __future__ import annotations

import pytest
from pytest_trio import trio_fixture

from . import open_in_memory_engine, sim_engine_config

__all__ = ["llm_engine", "llm_engine_config"]


@pytest.fixture
def llm_engine_config():
    """The engine of ``llm_engine``: the sim engine, 20 ms to the first token, then 10 ms
    per token, fault injection on (:func:`server.testing.fault`). Override it in your own
    conftest or test module."""
    return sim_engine_config()


@trio_fixture
async def llm_engine(llm_engine_config):
    """An :class:`~server.Engine` on in-memory workers, checked idle at the end."""
    async with open_in_memory_engine(llm_engine_config) as engine:
        yield engine
