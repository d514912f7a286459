"""Issue 41 item 10: the vllm worker runs torch with the threads vLLM's own server gives the
process that runs its model (server.engines.vllm.torch_threads), not one per core, which on a
loaded host spin against each other (docs/benchmarks.md: 256 tokens in 74 s against ~2 s).

The decision directly, here. A real vllm worker's HELLO, which says its torch thread count,
is checked against vLLM's own computation of that count (:func:`vllm_serve_threads`) by
tests/test_vllm_kv_events.py, on the workers it starts anyway (an engine load fewer).
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from server.engines.vllm.torch_threads import serving_threads  # noqa: E402


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


def vllm_serve_threads() -> int:
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

