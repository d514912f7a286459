"""The client libraries (the ``clients`` extra) against a real server.

Each test drives one library as its users do, end to end: the server on hypercorn, port 0,
with the transformers engine on the tiny random model (tests/tiny_model.py), whose output
the grammar forces wherever the library needs valid JSON (structured output, forced tool
calls); ``--tool-call-parser hermes`` as its template writes calls. Where a library runs
on the sim engine too, :func:`serving_sim` serves it there. The libraries run in a thread
(their own event loop, asyncio or none), the server in the test's Trio loop.

Each library also makes its default call, with nothing tuned: no ``max_tokens``, no
``temperature`` (issue 41: such a call was a 400 on the transformers engine, and no test
sent one). The answer then runs until the model ends it, so the model here ends its
answers as a chat model does (:func:`make_it_end`), a few to a few dozen tokens when
sampled, rather than at its 8,192-token context (minutes on one thread).

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


#: The end of sequence's mean logit along the model's answers (:func:`make_it_end`): the
#: other logits' largest is ~5-8, so a sampled answer ends after ~1-50 tokens (median ~8).
EOS_LOGIT = 4.0


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("xgrammar")
    torch = pytest.importorskip("torch")
    from tests.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model(tmp_path_factory.mktemp("clients") / MODEL,
                            max_position_embeddings=8192)  # tools take ~800-4500 tokens
    make_it_end(path)
    return path


def make_it_end(path) -> None:
    """Give the tiny model's end of sequence a logit of about :data:`EOS_LOGIT` along its
    own answers. Its embedding row (tied to the output's) is the padding token's, zero: the
    model never ends, which a test of ``max_tokens`` wants and a default call (no limit)
    does not. The row becomes the direction of the model's last hidden states, averaged
    over one sampled answer (seeded), scaled to that logit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_model import EOS

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": ASK}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    torch.manual_seed(0)
    with torch.no_grad():
        answer = model.generate(prompt, do_sample=True, max_new_tokens=300)
        mean = model(answer, output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(EOS)] = (
            EOS_LOGIT * mean / mean.norm() ** 2)
    model.save_pretrained(path)


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


@asynccontextmanager
async def serving_sim(**server_options):
    """The server on the sim engine, serving :data:`MODEL`; yields the base URL. The sim
    answers structured output and forced calls with valid documents, and ends an answer
    without ``max_tokens`` after a few dozen to a few hundred tokens (2 ms each here)."""
    from server.config import EngineConfig
    from tests.conftest import FAST_SIM, running_server

    config = EngineConfig(model=MODEL, engine_options=dict(FAST_SIM))
    server_options.setdefault("tool_call_parser", "hermes")
    with trio.fail_after(300):
        async with running_server(config, **server_options) as url:
            yield url


#: The engines a module parametrizes its test over with :func:`served`.
ENGINES = ["transformers", "sim"]


def served(request, engine: str):
    """:func:`serving` on the package's model, or :func:`serving_sim`, by ``engine``."""
    if engine == "sim":
        return serving_sim()
    return serving(request.getfixturevalue("model_dir"))


async def in_thread(fn, *args):
    """Run a blocking client ``fn(*args)`` in a thread (the server keeps serving here)."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args))


async def in_asyncio(async_fn, *args):
    """Run an asyncio client coroutine ``async_fn(*args)`` on its own loop in a thread."""
    return await trio.to_thread.run_sync(asyncio.run, async_fn(*args))
