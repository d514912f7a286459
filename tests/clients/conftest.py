"""The client libraries (the ``clients`` extra) against a real server.

Each test drives one library as its users do, end to end: the server on hypercorn, port 0,
with the transformers engine on the tiny random model (tests/tiny_model.py), whose output
the grammar forces wherever the library needs valid JSON (structured output, forced tool
calls); ``--tool-call-parser hermes`` as its template writes calls. The libraries run in a
thread (their own event loop, asyncio or none), the server in the test's Trio loop.

The libraries are not in the main test environment (instructor holds openai back: see
pyproject.toml's ``clients`` extra); there, each module skips as a whole."""

from __future__ import annotations

import asyncio
import functools
from contextlib import asynccontextmanager

import pytest
import trio

#: The served model's name (the directory's).
MODEL = "tiny-tools"
#: A prompt the tools' examples answer.
ASK = "Book a room for Ann."


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("xgrammar")
    torch = pytest.importorskip("torch")
    from tests.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("clients") / MODEL,
                            max_position_embeddings=4096)  # tools take ~800-1800 tokens


@asynccontextmanager
async def serving(model_dir, **server_options):
    """The server on the tiny model; yields the base URL (``http://127.0.0.1:port``)."""
    from server.config import EngineConfig
    from tests.conftest import running_server

    config = EngineConfig(engine="transformers", drain_timeout=5.0, startup_timeout=600.0,
                          engine_options={"model_path": str(model_dir), "num_threads": 1})
    server_options.setdefault("tool_call_parser", "hermes")
    with trio.fail_after(300):
        async with running_server(config, **server_options) as url:
            yield url


async def in_thread(fn, *args):
    """Run a blocking client ``fn(*args)`` in a thread (the server keeps serving here)."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args))


async def in_asyncio(async_fn, *args):
    """Run an asyncio client coroutine ``async_fn(*args)`` on its own loop in a thread."""
    return await trio.to_thread.run_sync(asyncio.run, async_fn(*args))
