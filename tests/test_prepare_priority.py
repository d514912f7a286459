"""A pool of preparation threads can run at a lower CPU priority than the thread that made
it (server/workers/prepare.py, ``DaemonPool(..., nice)``; the worker does not use it, see
``lower_priority``; bench/step_contention.py measures it).

The nice value is a thread's own on Linux; elsewhere nothing changes (and nothing is
tested here)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from server.workers.prepare import DaemonPool, lower_priority

NICE = 10

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a thread's nice is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_pool_thread_runs_niced_and_the_caller_does_not():
    mine = _nice()
    pool = DaemonPool(2, "test-prepare", NICE)
    try:
        seen = {pool.submit(_nice).result(timeout=60) for _ in range(8)}
    finally:
        pool.shutdown()
    assert seen == {min(19, mine + NICE)}
    assert _nice() == mine  # the calling thread (the loop) keeps its priority


def test_a_pool_without_nice_keeps_the_priority():
    mine = _nice()
    pool = DaemonPool(1, "test-plain")
    try:
        assert pool.submit(_nice).result(timeout=60) == mine
    finally:
        pool.shutdown()


def test_lower_priority_changes_the_calling_thread_only():
    mine = _nice()

    def lowered():
        assert lower_priority(3)
        return _nice()

    assert _in_thread(lowered) == min(19, mine + 3)
    assert _nice() == mine
    assert _in_thread(lambda: (lower_priority(0), _nice())) == (False, mine)
