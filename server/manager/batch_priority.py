"""A request's ``priority`` and the workers that honour it (vLLM's priority scheduling).

vLLM under ``--scheduling-policy priority`` orders its waiting queue by ``priority``
(lower first) and, when its KV cache is full, preempts the running request of the highest
value. With fcfs it refuses a request whose priority is not 0, and preempts the newest.
A worker says which it runs: its HELLO lists ``priority`` among its sampling fields or not
(:func:`honours_priority`). A pool may mix both kinds, or change kind when a worker restarts.

*A client's priority* (not 0) goes only to a worker that honours it: the router passes
the others over, a migration too. A pool with none refuses it with a 400 naming the field,
as vLLM's own server does under fcfs; one whose such workers are all down answers 503.

*A batch line's priority* is ours. The batch runner holds a line back until a model has
idle capacity (server.batches.runner). Once it runs, a worker with priority scheduling can
still tell it from interactive requests. A request made inside :func:`batch_work`
(server.batches.calls) goes to such a worker at :func:`batch_priority` of its own: after
every interactive request of a priority below :data:`BATCH_PRIORITY`, lines keeping their
order among themselves. A worker without priority scheduling is sent the line's own (0),
never ours. The choice keeps the line's own, so that a migration sends each worker its
kind's (:func:`scheduled`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

__all__ = ["BATCH_PRIORITY", "batch_priority", "batch_work", "honours_priority",
           "in_batch_work", "needs_priority", "scheduled"]

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


def honours_priority(info: dict) -> bool:
    """Whether a worker whose HELLO info is ``info`` schedules by ``priority``."""
    return "priority" in (info.get("sampling") or ())


def needs_priority(params: dict | None) -> bool:
    """Whether wire ``params`` carry a client's priority (not 0): only a worker that
    honours it may take them."""
    return bool((params or {}).get("priority"))


def scheduled(params: dict, batch: bool, info: dict) -> dict:
    """The wire ``params`` of a request (the client's own priority, never ours) as sent
    to the worker whose HELLO info is ``info``: a batch line's at :func:`batch_priority`
    where it honours priority; otherwise ``params`` themselves."""
    if batch and honours_priority(info):
        return {**params, "priority": batch_priority(params.get("priority") or 0)}
    return params
