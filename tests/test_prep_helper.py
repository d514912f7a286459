"""Heavy preparation in the worker's helper process (server/workers/prep_helper.py and
prep_child.py): the same results as in the worker, and a helper that dies fails only the
requests it held (an engine fault), is restarted, and leaves no process behind."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

import torch  # noqa: E402
import trio  # noqa: E402

import server  # noqa: E402
from server.worker_protocol import wire  # noqa: E402
from server.workers.base import Rejected  # noqa: E402
from server.engines.transformers.engine import TransformersEngine  # noqa: E402
from tests.conftest import child_pids, children_of, pid_exists  # noqa: E402
from tests.test_worker_prepare import json_schema, wide_schema  # noqa: E402
from tests.test_worker_probe import _cpu_seconds  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

torch.set_num_threads(1)

LIMIT = 600  # seconds: a helper process loads the tokenizer and xgrammar (slow when busy)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("helper") / "tiny-llama")


def _generate(engine, params: dict) -> str:
    engine.add(1, "hello", params)
    outs: list = []
    while engine.next_deadline() is not None:
        outs += engine.step(0.0)
    return "".join(o[1] for o in outs)


def test_the_helper_prepares_as_the_worker_does(model_dir):
    """Everything through the helper (threshold 0 bytes) against everything here."""
    here = TransformersEngine(model_path=str(model_dir), max_batch=2, prepare_process=False)
    there = TransformersEngine(model_path=str(model_dir), max_batch=2, prepare_process_bytes=0)
    before = child_pids()
    there.remote_grammars = True  # (the hook is off by default: see helper_config)
    there.start_helper()
    there._grammars.remote = (there._helper.compile, 0)
    try:
        params = {"max_tokens": 24, "temperature": 1.0, "seed": 11,
                  "response_format": json_schema(wide_schema(3, "q"))}
        assert _generate(there, params) == _generate(here, params)
        assert there.statistics()["grammars"]["misses"] == 1
        chat = {"messages": [{"role": "user", "content": "héllo " * 50}]}
        assert there.encode(chat) == here.encode(chat)
        assert there._helper_for(chat) is not None
        for request in ({"op": "tokenize", "prompt": "x" * 40_000},
                        {"op": "tokenize", "prompt": "x" * 40_000, "packed_ids": True},
                        {"op": "tokenize", "prompt": "hi there", "add_special_tokens": False},
                        {"op": "tokenize", "prompt": chat}):
            packed = there.tokenize(request)
            assert type(packed) is wire.Packed
            assert (wire.encode([wire.RESULT, 1, packed, None])
                    == wire.encode([wire.RESULT, 1, here.tokenize(request), None]))
        # asked for (by a frontend that reads them), long ids are packed: the same list
        plain = here.tokenize({"op": "tokenize", "prompt": "x" * 40_000})["tokens"]
        asked = here.tokenize({"op": "tokenize", "prompt": "x" * 40_000, "packed_ids": True})
        assert len(plain) >= wire.PACK_MIN and asked["tokens"] == wire.pack_ids(plain)
        with pytest.raises(Rejected, match="packed_ids must be a boolean"):
            here.tokenize({"op": "tokenize", "prompt": "x", "packed_ids": 1})
        assert len(child_pids() - before) == 1  # the helper process
        # a client fault in the helper is the same client fault
        too_long = "a" * (here.max_model_len * 64)
        with pytest.raises(Rejected, match="maximum context length"):
            there.prepare(too_long, {"max_tokens": 1})
    finally:
        there.close()
        here.close()
    assert child_pids() == before


def test_small_requests_stay_in_the_worker(model_dir):
    engine = TransformersEngine(model_path=str(model_dir), max_batch=2)
    engine.start_helper()
    try:
        assert engine._helper_for("hello") is None
        assert engine._helper_for({"messages": [{"role": "user", "content": "hi"}]}) is None
        assert engine._helper_for("x" * 40_000) is not None
        assert isinstance(engine.tokenize({"op": "tokenize", "prompt": "hello"}), dict)
    finally:
        engine.close()


async def test_a_dead_helper_fails_only_what_it_held(model_dir):
    """A real worker; its helper is SIGKILLed while it tokenizes a huge prompt: that
    /tokenize fails with an engine error naming the fault, a stream beside it and the
    worker go on, and the next heavy request is served by a new helper."""
    config = server.EngineConfig(
        engine="transformers",
        engine_options={"model_path": str(model_dir), "num_threads": 1,
                        "prepare_process_bytes": 1000,
                        # not niced: on a saturated machine a niced helper waits minutes
                        "prepare_process_nice": 0},
        heartbeat_interval=0.1, heartbeat_timeout=10.0, drain_timeout=5.0,
        startup_timeout=LIMIT)
    heavy = {"op": "tokenize", "prompt": "x" * 2_000_000}
    with trio.fail_after(LIMIT):
        async with server.open_engine(config) as hf:
            worker = hf.statistics().workers[0]
            # a first heavy request: the helper is up (it answered)
            small = {"op": "tokenize", "prompt": "y" * 2000}
            assert len((await hf.tokenize(small))["tokens"]) > 0
            helpers = children_of(worker.pid)
            assert len(helpers) == 1
            (helper,) = helpers
            failed = []

            async def doomed():
                with pytest.raises(server.EngineError) as info:
                    await hf.tokenize(heavy)
                failed.append(str(info.value))

            async with trio.open_nursery() as nursery:
                idle_cpu = _cpu_seconds(helper)
                nursery.start_soon(doomed)
                # it is tokenizing (CPU seconds for 2 MB of one word) once it has used 0.2 s
                # of CPU: not a fixed pause, which a busy machine can end before the request
                # reached the helper
                while _cpu_seconds(helper) - idle_cpu < 0.2:
                    await trio.sleep(0.02)
                os.kill(helper, signal.SIGKILL)
            assert "preparation process died" in failed[0]
            while pid_exists(helper):
                await trio.sleep(0.05)
            assert len((await hf.tokenize(small))["tokens"]) > 0  # a new helper answers
            assert children_of(worker.pid) - {helper}
            after = hf.statistics().workers[0]
            assert (after.pid, after.restarts) == (worker.pid, 0)
    assert not pid_exists(worker.pid)


def _loads_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


def test_the_helper_loads_no_torch_where_its_tokenizer_encodes_as_the_workers(model_dir):
    """The helper loads the tokenizer's own class without torch (AutoTokenizer imports it:
    11-16 s of CPU at each start) when that encodes the worker's probes as the worker
    does; when a probe differs, it loads the tokenizer as the worker does, torch and all.
    Either way it encodes as the worker."""
    here = TransformersEngine(model_path=str(model_dir), max_batch=2, prepare_process=False)
    chat = {"messages": [{"role": "user", "content": "héllo wörld " * 50}]}
    try:
        for wrong in (False, True):
            there = TransformersEngine(model_path=str(model_dir), max_batch=2,
                                       prepare_process_bytes=0)
            if wrong:  # a probe whose ids are not the light tokenizer's
                probes = there.helper_probes()
                assert probes and all(ids for _, ids in probes)
                probes[0][1] = probes[0][1][1:]
                there.helper_probes = lambda probes=probes: probes  # type: ignore[method-assign]
            try:
                there.start_helper()
                assert there._helper is not None
                there._helper.wait_started()
                assert _loads_torch(there._helper.pid()) is wrong
                assert there.encode_prompt(chat) == here.encode(chat)
                assert there._helper_for(chat) is not None
            finally:
                there.close()
    finally:
        here.close()
