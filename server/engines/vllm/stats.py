"""vLLM's own statistics, taken through its public stat-logger interface, for the frontend.

Example (what :class:`~server.engines.vllm.engine.VLLMEngine` does)::

    stats = VLLMStats()
    llm = LLMEngine.from_engine_args(args, stat_loggers=[stats.logger_factory()])
    stats.configure(llm.vllm_config)          # the cache config, for HELLO
    llm.step()                                # vLLM calls the logger's record()
    stats.running, stats.waiting              # the scheduler's queues after that step
    stats.take_finished()                     # {"7": {"queue": s, "prefill": s, ...}}
    stats.statistics()                        # the PONG's map: kv usage, preemptions, ...

Theory of operation
-------------------
vLLM hands every engine step's ``SchedulerStats`` and ``IterationStats`` to the stat loggers
given to ``LLMEngine.from_engine_args(stat_loggers=...)`` (``vllm.v1.metrics.loggers.
StatLoggerBase``: the interface vLLM documents for custom loggers; its own Prometheus
logger is one). Ours keeps what the frontend exports, as plain numbers, in this process:

- the scheduler's running and deferred/waiting counts and its KV-cache usage after the
  latest step (gauges: the worker sends them in each PONG);
- the preemptions and a histogram of the tokens each step processed (prompt tokens
  computed plus tokens generated, vLLM's ``iteration_tokens_total``), cumulative since the
  engine started (the PONG sends the totals: the engine's counters, like vLLM's per-engine
  ones, start over when the worker does);
- per finished request, vLLM's queue, prefill, decode and inference times, taken by the
  engine (:meth:`take_finished`) and sent as a note with the request's last output.

``SchedulerStats`` and ``IterationStats`` are plain data whose fields vLLM does not promise
to keep: every field is read with a default, so a vLLM version without one reports less,
never fails a step. Nothing here touches vLLM's private state; with log stats off
(``disable_log_stats``) the logger is never called and the engine falls back to its own
counts (:attr:`active` stays False).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from ...worker_protocol.wire import ITERATION_TOKEN_BUCKETS

__all__ = ["VLLMStats", "cache_config_info"]


#: The cache settings exported as labels of ``cache_config_info`` (vLLM exports every field
#: of its CacheConfig; these are the ones an operator reads, and the two sizes it derives).
_CACHE_FIELDS = (
    "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
    "prefix_caching_hash_algo", "gpu_memory_utilization", "kv_cache_memory_bytes",
)


def cache_config_info(vllm_config) -> dict[str, str]:
    """The KV cache's configuration as label values (all strings), with the KV cache's size
    in tokens and how many requests of the full context length fit in it at once."""
    cache = vllm_config.cache_config
    info = {name: str(getattr(cache, name, None)) for name in _CACHE_FIELDS}
    blocks = getattr(cache, "num_gpu_blocks", None)
    size = getattr(cache, "block_size", None)
    max_len = getattr(vllm_config.model_config, "max_model_len", None)
    tokens = blocks * size if isinstance(blocks, int) and isinstance(size, int) else None
    info["kv_cache_size_tokens"] = str(tokens)
    info["kv_cache_max_concurrency"] = (
        f"{tokens / max_len:.2f}" if tokens is not None and max_len else "None"
    )
    return info


class VLLMStats:
    """What vLLM's stat loggers are told, kept for the worker (see the module docstring)."""

    def __init__(self) -> None:
        #: True once vLLM recorded a step (stats are on).
        self.active = False
        self.running = 0
        #: Waiting for a batch slot (vLLM's ``num_waiting_reqs``).
        self.waiting = 0
        #: Waiting for something else: a grammar to compile, a remote KV transfer (vLLM's
        #: ``num_skipped_waiting_reqs``, its waiting reason "deferred").
        self.deferred = 0
        self.kv_cache_usage = 0.0
        #: vLLM's request id -> its times, for the requests finished since the last take.
        self._finished: dict[str, dict[str, float]] = {}
        self.reset()

    def logger_factory(self):
        """A per-engine stat logger factory for ``stat_loggers=[...]`` (vLLM imported)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx: int = 0) -> None:
                stats.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger

    # -- called by vLLM, in LLMEngine.step ---------------------------------------------------

    def record(self, scheduler: Any, iteration: Any) -> None:
        """One engine step's statistics (either may be None)."""
        self.active = True
        if scheduler is not None:
            self.running = getattr(scheduler, "num_running_reqs", 0)
            self.waiting = getattr(scheduler, "num_waiting_reqs", 0)
            self.deferred = getattr(scheduler, "num_skipped_waiting_reqs", 0)
            self.kv_cache_usage = float(getattr(scheduler, "kv_cache_usage", 0.0))
        if iteration is None:
            return
        self.preemptions += getattr(iteration, "num_preempted_reqs", 0)
        prompt = getattr(iteration, "prompt_token_stats", None)
        computed: int = (getattr(iteration, "num_prompt_tokens", 0) if prompt is None
                         else prompt.computed)  # without it: every prompt token counted
        tokens = computed + getattr(iteration, "num_generation_tokens", 0)
        self.iteration_tokens[bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.iteration_tokens_sum += tokens
        for done in getattr(iteration, "finished_requests", ()):
            rid = getattr(done, "request_id", None)
            if rid is not None:
                self._finished[rid] = {
                    "queue": _seconds(done, "queued_time"),
                    "prefill": _seconds(done, "prefill_time"),
                    "decode": _seconds(done, "decode_time"),
                    "inference": _seconds(done, "inference_time"),
                }

    # -- read by the engine -------------------------------------------------------------------

    def take_finished(self) -> dict[str, dict[str, float]]:
        """The times of the requests that finished since the last call (and forget them)."""
        finished, self._finished = self._finished, {}
        return finished

    def statistics(self) -> dict:
        """The engine's gauges and counters for a PONG (``wire.ENGINE_STATS``)."""
        return {
            "kv_cache_usage": self.kv_cache_usage,
            "deferred": self.deferred,
            "preemptions": self.preemptions,
            "iteration_tokens": [*self.iteration_tokens, self.iteration_tokens_sum],
        }

    def reset(self) -> None:
        """Start the counters over (after the engine's warm-up, which is no one's load)."""
        self.preemptions = self.iteration_tokens_sum = 0
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._finished.clear()

    def idle(self) -> None:
        """The engine holds no request: nothing runs, waits or occupies the cache (vLLM
        records no step after an abort of the last request, so its last counts are
        stale)."""
        self.running = self.waiting = self.deferred = 0
        self.kv_cache_usage = 0.0


def _seconds(done: Any, name: str) -> float:
    value = getattr(done, name, 0.0)
    return max(float(value), 0.0) if isinstance(value, (int, float)) else 0.0
