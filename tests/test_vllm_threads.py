"""Issue 41 item 10: the vllm worker runs torch with the threads vLLM's own server gives the
process that runs its model (server.engines.vllm.torch_threads), not one per core, which on a
loaded host spin against each other (docs/benchmarks.md: 256 tokens in 74 s against ~2 s).

The decision directly; then a real vllm worker (one engine load: slow), whose HELLO says
its torch thread count, against vLLM's own computation of that count. Skipped where vLLM is
not installed.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import trio

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from server.config import EngineConfig  # noqa: E402
from server.manager.engine import open_engine  # noqa: E402
from server.engines.vllm.torch_threads import serving_threads  # noqa: E402
from tests.test_vllm_engine import CONTEXT, MODEL, SHAPE  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)


def test_the_model_process_on_the_cpu_build_gets_its_bound_cores():
    assert serving_threads({}, model_here=True, cpu_build=True, bound=1) == 1
    assert serving_threads({}, model_here=True, cpu_build=True, bound=15) == 15
    # nobind: vLLM's CPU build leaves torch's default
    assert serving_threads({}, model_here=True, cpu_build=True, bound=None) is None


def test_one_thread_where_the_model_runs_elsewhere_or_on_a_gpu():
    assert serving_threads({}, model_here=False, cpu_build=True, bound=15) == 1
    assert serving_threads({}, model_here=True, cpu_build=False, bound=None) == 1


def test_the_operators_omp_num_threads_is_left_alone():
    assert serving_threads({"OMP_NUM_THREADS": "4"}, model_here=True, cpu_build=True,
                           bound=1) is None
    assert serving_threads({"OMP_NUM_THREADS": "4"}, model_here=False, cpu_build=False,
                           bound=None) is None
    # one vLLM chose for its own processes is not the operator's
    vllms = {"OMP_NUM_THREADS": "4", "VLLM_OMP_NUM_THREADS_SET_BY_VLLM": "1"}
    assert serving_threads(vllms, model_here=False, cpu_build=True, bound=None) == 1


def _vllm_serve_threads() -> int:
    """What ``vllm serve`` gives the process that runs the model on this host: on its CPU
    build, OMP_NUM_THREADS = the cores its OMPProcessManager binds rank 0 to (one process,
    as ours); the operator's OMP_NUM_THREADS where set."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    from vllm.platforms import current_platform
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    if not current_platform.is_cpu():
        return 1
    one = SimpleNamespace(parallel_config=SimpleNamespace(
        local_world_size=1, data_parallel_rank_local=None, _api_process_count=1),
        kv_transfer_config=None)
    return len(OMPProcessManager(one).cpu_lists[0])


async def test_the_vllm_workers_torch_threads_are_vllm_serves(tmp_path):
    model = build_tiny_model(tmp_path / MODEL, **SHAPE)
    config = EngineConfig(engine="vllm", startup_timeout=900, engine_options={
        "model_path": str(model), "max_model_len": CONTEXT, "dtype": "float32",
        "engine_args": {"kv_cache_memory_bytes": 64 << 20,
                        "enforce_eager": True}})  # (no compilation: ~10 s of CPU a start-up)
    with trio.fail_after(1200):  # (a bound that fails a hang, not a timing)
        async with open_engine(config) as engine:
            info = engine.workers[0].info
    assert info["torch_threads"] == _vllm_serve_threads()
