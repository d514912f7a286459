"""Capacity limiters for sans-IO work handed to threads (``trio.to_thread.run_sync``), one
per name and Trio run (a limiter belongs to the run that made it): a flood of big bodies or
big frames waits its turn rather than taking every thread of Trio's pool."""

from __future__ import annotations

import trio

__all__ = ["run_limiter"]

_VARS: dict[str, trio.lowlevel.RunVar] = {}


def run_limiter(name: str, threads: int) -> trio.CapacityLimiter:
    """This Trio run's limiter called ``name``, of ``threads`` threads (made on first use;
    the first caller's ``threads`` holds)."""
    var = _VARS.get(name)
    if var is None:
        var = _VARS.setdefault(name, trio.lowlevel.RunVar(name))
    try:
        return var.get()
    except LookupError:
        limiter = trio.CapacityLimiter(threads)
        var.set(limiter)
        return limiter
