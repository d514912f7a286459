"""Torch's intra-op threads in a vllm worker, as vLLM sets them where it runs its model.

When and why
------------
vLLM's own server never runs its model with torch's default thread count (one per core):

* on a GPU, its worker sets torch to one thread once the weights are loaded
  (``vllm.utils.torch_utils.set_torch_threads_for_runtime``: no steady-state CPU op gains
  from intra-op parallelism, and the idle OpenMP threads spin against the step's serial
  code), as its engine-core process does when the model runs in worker processes;
* on vLLM's CPU build, the process that runs the model is started with ``OMP_NUM_THREADS``
  = the cores vLLM binds it to (``VLLM_CPU_OMP_THREADS_BIND``, ``auto`` by default: one
  NUMA node's cores less one kept for the scheduler; 1 on a 2-core host).

Our worker hosts vLLM's engine in its own process, where neither happens: the CPU build's
worker class even replaces ``torch.set_num_threads`` with a warning that does nothing. So
torch kept a thread per core, and on a loaded host those threads spun against each other:
256 greedy tokens of the tests' tiny model took 35-58 s at load 12-27 on 2 cores, about 1 s
with one thread (docs/changelog.md, 2026-12-03, "Torch threads in the vllm worker").

So once the engine is built (:func:`set_serving_threads`), the worker sets torch's threads
to vLLM's count for the process that runs the model. Where the model runs elsewhere
(``engine_core`` ``process``, tensor parallel workers: this process only schedules and
detokenizes), it sets them to 1. The operator's choice wins: ``OMP_NUM_THREADS`` in the
worker's environment (vLLM leaves torch alone then too), or ``nobind`` in
``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's CPU build then leaves torch's default).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .private_api import OMP_SET_BY_VLLM, omp_cpu_bound, set_torch_threads

__all__ = ["serving_threads", "set_serving_threads", "threads_in_use"]

def serving_threads(environ: Mapping[str, str], *, model_here: bool, cpu_build: bool,
                    bound: int | None) -> int | None:
    """The thread count vLLM would give this process (None: leave torch's as it is).
    ``model_here``: the model runs in this process; ``cpu_build``: vLLM's CPU platform;
    ``bound``: the cores its CPU build binds that process to (None: ``nobind``)."""
    if "OMP_NUM_THREADS" in environ and environ.get(OMP_SET_BY_VLLM) != "1":
        return None  # the operator's
    if not (model_here and cpu_build):
        return 1
    return bound


def set_serving_threads(llm_engine, *, multiprocess: bool) -> None:
    """Set torch's intra-op threads in this process as vLLM would (see the module
    docstring), for ``llm_engine`` built here (``multiprocess``: its core in a process of
    its own)."""
    import torch
    from vllm.platforms import current_platform

    config = llm_engine.vllm_config
    parallel = config.parallel_config
    model_here = not multiprocess and parallel.world_size == 1
    cpu_build = current_platform.is_cpu()
    count = serving_threads(os.environ, model_here=model_here, cpu_build=cpu_build,
                            bound=omp_cpu_bound(config) if model_here and cpu_build else None)
    if count is not None and count != torch.get_num_threads():
        set_torch_threads(count)


def threads_in_use() -> int:
    """Torch's intra-op threads in this process now (a vllm worker's HELLO says it)."""
    import torch

    return torch.get_num_threads()
