"""The range of each numeric command-line option (the server's, and a listening worker's),
checked as argparse reads it.

Why: ``--max-body-bytes -1`` started a server that answered every request 413 "larger
than -1 bytes", and other negative or zero limits started too. A value outside its option's
range is refused at start, in argparse's one line naming the option (``argument
--max-body-bytes: expected an integer of at least 1, got '-1'``), on the command line and in
a ``--model-config`` file alike (both are read by the same parser). NaN and infinities are
never a value.

:data:`BOUNDS` names each option's least value (and its greatest, for ports and fractions);
0 is allowed where the option's help gives 0 a meaning ("0: never", "0: no limit"). Options
passed through to vLLM as they are (``--seed``, ``--max-logprobs``, ...) are vLLM's to check.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

__all__ = ["BOUNDS", "Bounds", "bound_numbers"]


@dataclass(frozen=True)
class Bounds:
    """``low`` (included, or excluded with ``above``) to ``high`` (included, None: none)."""

    low: float
    high: float | None = None
    above: bool = False  # the value must be greater than ``low``

    def check(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if value < self.low or (self.above and value == self.low):
            return False
        return self.high is None or value <= self.high

    def say(self, kind: str) -> str:
        if self.high is not None:
            if self.above:
                return f"{kind} greater than {self.low:g} and at most {self.high:g}"
            return f"{kind} from {self.low:g} to {self.high:g}"
        return f"{kind} {'greater than' if self.above else 'of at least'} {self.low:g}"


_PORT = Bounds(0, 65535)
_COUNT = Bounds(1)  # a size, a count: 0 would refuse everything
_ZERO_OK = Bounds(0)  # 0 has a meaning (never, none, no limit, at once)
_SECONDS = Bounds(0, above=True)  # a timeout whose 0 has no meaning

BOUNDS: dict[str, Bounds] = {
    # serving
    "port": _PORT, "health_port": _PORT, "keep_alive_timeout": _SECONDS,
    "read_timeout": _SECONDS, "send_timeout": _ZERO_OK, "backlog": _COUNT,
    "max_connections": _COUNT,
    # routing, several frontends
    "routing_balance": _ZERO_OK, "max_migrations": _ZERO_OK, "api_servers": _COUNT,
    "listen_fd": _ZERO_OK, "health_listen_fd": _ZERO_OK, "frontend_index": _ZERO_OK,
    # limits and timeouts
    "max_concurrent_requests": _COUNT, "max_concurrent_sequences": _ZERO_OK,
    "max_queue_time": _ZERO_OK, "queued_heartbeat_s": _ZERO_OK, "request_timeout": _SECONDS,
    "shutdown_timeout": _ZERO_OK, "stream_interval_ms": _ZERO_OK, "drain_timeout": _ZERO_OK,
    "max_body_bytes": _COUNT, "max_n": _COUNT, "max_tokens_cap": _COUNT,
    "max_prompts": _COUNT, "max_answer_logprobs": _ZERO_OK, "heartbeat_timeout": _SECONDS,
    "max_restarts": _ZERO_OK,
    # the engine
    "grammar_max_bytes": _COUNT, "grammar_timeout": _SECONDS, "num_threads": _COUNT,
    "engine_workers": _COUNT, "max_model_len": _COUNT, "max_batch": _COUNT,
    "worker_startup_timeout": _SECONDS, "tensor_parallel_size": _COUNT,
    "gpu_memory_utilization": Bounds(0, 1, above=True), "devices_per_worker": _COUNT,
    # a listening worker (python -m server.workers --listen)
    "frontend_timeout": _SECONDS, "max_buffer_bytes": _COUNT, "max_frontends": _COUNT,
    "max_total_buffer_bytes": _COUNT,
    # the sim engine
    "sim_itl_ms": _ZERO_OK, "sim_ttft_ms": _ZERO_OK, "sim_prefill_us_per_token": _ZERO_OK,
    "sim_max_batch": _COUNT, "sim_reasoning_tokens": _ZERO_OK,
    "sim_prefix_cache_tokens": _ZERO_OK, "sim_prefix_block_size": _COUNT,
}


def _checked(convert, bounds: Bounds):
    kind = "an integer" if convert is int else "a number"

    def read(text: str):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            value = math.nan
        if not bounds.check(value):
            raise argparse.ArgumentTypeError(f"expected {bounds.say(kind)}, got {text!r}")
        return value

    read.__name__ = getattr(convert, "__name__", "number")
    read.bounds = bounds  # type: ignore[attr-defined]  # (checked: not wrapped twice)
    return read


def bound_numbers(parser: argparse.ArgumentParser, bounds: dict[str, Bounds] = BOUNDS) -> None:
    """Give each option of ``parser`` named in ``bounds`` a type that refuses values out of
    its range (its type, int or float, kept). Call it once the parser has every option."""
    for action in parser._actions:
        found = bounds.get(action.dest)
        if found is not None and action.type is not None and not hasattr(action.type, "bounds"):
            action.type = _checked(action.type, found)
