"""Issue 43 item 4: vLLM's private names in one module (server.engines.vllm.private_api),
checked.

* The version check names a release outside the table (sans-IO).
* The installed vLLM is a release of the table and has every name the module relies on,
  and a name that goes missing is named: a vLLM update breaks this test, not a start.
* The adapters on stand-ins for vLLM's objects: the outputs queue that announces itself
  and is put back, the grammar pool replaced at the same size.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from server.engines.vllm import private_api
from server.engines.vllm.private_api import WRITTEN_FOR, version_problem

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")


def test_the_version_check_names_a_release_outside_the_table():
    for release in WRITTEN_FOR:
        assert version_problem(f"{release}.0") is None
        assert version_problem(f"{release}.2+cpu") is None
    newer = "9.1.0"
    assert version_problem(newer) == f"vLLM 9.1.0 (written for {', '.join(WRITTEN_FOR)})"
    assert version_problem(None) == "vLLM not installed"


@needs_vllm
def test_the_installed_vllm_is_in_the_table_and_has_every_name():
    import vllm

    assert version_problem(vllm.__version__) is None
    assert private_api.missing_names() == []


@needs_vllm
def test_a_name_that_goes_missing_is_named(monkeypatch):
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    monkeypatch.delattr(IncrementalDetokenizer, "update")
    monkeypatch.delattr(EngineCoreProc, "run_engine_core")
    missing = private_api.missing_names()
    assert "IncrementalDetokenizer.update" in missing
    assert "EngineCoreProc.run_engine_core" in missing


def _stand_in(outputs=None) -> SimpleNamespace:
    """An ``LLMEngine`` with a multiprocess client, as far as the adapters look."""
    return SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=outputs,
                                                       ensure_alive=lambda: None))


def test_the_outputs_queue_announces_each_output_until_put_back():
    outputs: queue.Queue = queue.Queue()
    read, write = os.pipe()
    os.set_blocking(read, False)
    try:
        assert private_api.announce_outputs(_stand_in(outputs), write) is outputs
        outputs.put("first")
        outputs.put("second")
        assert os.read(read, 16) == b"\0\0"
        private_api.stop_announcing(outputs)
        assert type(outputs) is queue.Queue
        outputs.put("third")
        with pytest.raises(BlockingIOError):
            os.read(read, 16)
        assert [outputs.get_nowait() for _ in range(3)] == ["first", "second", "third"]
    finally:
        os.close(read)
        os.close(write)


def test_a_client_without_an_outputs_queue_is_refused_in_one_line():
    with pytest.raises(RuntimeError, match="--engine-core worker"):
        private_api.announce_outputs(_stand_in(None), -1)


def test_the_grammar_pool_is_replaced_at_its_size_with_the_initializer():
    old = ThreadPoolExecutor(max_workers=3)
    manager = SimpleNamespace(executor=old)
    llm = SimpleNamespace(engine_core=SimpleNamespace(
        engine_core=SimpleNamespace(structured_output_manager=manager)))
    ran: list[str] = []
    assert private_api.replace_grammar_pool(llm, lambda tag: ran.append(tag), ("niced",))
    new = manager.executor
    try:
        assert new is not old and new._max_workers == 3
        assert new.submit(threading.current_thread).result().name.startswith("grammar")
        assert ran == ["niced"]
    finally:
        new.shutdown()
    # the core in a process of its own: nothing to replace
    assert not private_api.replace_grammar_pool(_stand_in(), print, ())
