"""Batch work below interactive work in an engine's own scheduler (vLLM's ``priority``).

The batch runner holds a line back until a model has idle capacity (server.batches.runner).
Once a line runs, an engine with priority scheduling can still tell it from interactive
requests: vLLM under ``--scheduling-policy priority`` orders its waiting queue by
``priority`` (lower first) and, when its KV cache is full, preempts the running request of
the highest value. With fcfs it preempts the newest, often the interactive request.

A batch line runs inside :func:`batch_work` (server.batches.calls). A request made there,
to a worker whose HELLO lists ``priority`` among its sampling fields, goes at
:func:`batch_priority` of its own: after every interactive request of a priority below
:data:`BATCH_PRIORITY`, lines keeping their order among themselves. A worker without
priority scheduling gets nothing new: its lines are held back by the runner alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

__all__ = ["BATCH_PRIORITY", "batch_priority", "batch_work", "in_batch_work"]

#: Added to a batch line's own ``priority`` (vLLM's default 0): above any priority a
#: client plausibly sends, with room for a line's own order below the int64 limit.
BATCH_PRIORITY = 2**62

_batch: ContextVar[bool] = ContextVar("trio_llm_batch_work", default=False)


@contextmanager
def batch_work() -> Iterator[None]:
    """Mark the requests this task (and the tasks it starts) makes as batch work."""
    token = _batch.set(True)
    try:
        yield
    finally:
        _batch.reset(token)


def in_batch_work() -> bool:
    """Whether the request being made is a batch line's."""
    return _batch.get()


def batch_priority(own: int) -> int:
    """The priority a batch line goes at: its own moved above :data:`BATCH_PRIORITY`.
    Its own is held within ``±(2**62 - 1)``, so the result lies in ``[1, 2**63 - 1]``:
    always after a request at the default 0, and within int64 as vLLM's wire needs."""
    most = BATCH_PRIORITY - 1
    return BATCH_PRIORITY + max(-most, min(most, own))
