"""Garbage-collector pauses, counted from ``gc.callbacks``, exposed as metrics.

A request creates no cyclic garbage (see server/manager/stream.py), and the server freezes
its long-lived objects after startup (:func:`freeze_after_startup`), so a generation-2
collection during serving should not happen; these metrics show whether it does, and how
long the longest pause of each generation was:

    python_gc_collections_total{generation}     collections since the process started
    python_gc_pause_seconds_total{generation}   time spent in them
    python_gc_pause_seconds_max{generation}     the longest one
"""

from __future__ import annotations

import gc
import time
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["GCStats", "gc_stats", "freeze_after_startup"]


class GCStats:
    """Counts collections and their pauses per generation (one instance per process)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.total = [0.0, 0.0, 0.0]
        self.max = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        g = info["generation"]
        self.count[g] += 1
        self.total[g] += pause
        if pause > self.max[g]:
            self.max[g] = pause

    def collect(self) -> Iterator[Metric]:
        labels = ["generation"]
        count = CounterMetricFamily("python_gc_collections", "Garbage collections.", labels=labels)
        total = CounterMetricFamily(
            "python_gc_pause_seconds", "Time spent in garbage collections.", labels=labels
        )
        longest = GaugeMetricFamily(
            "python_gc_pause_seconds_max", "The longest garbage-collection pause.", labels=labels
        )
        for g in range(3):
            count.add_metric([str(g)], self.count[g])
            total.add_metric([str(g)], self.total[g])
            longest.add_metric([str(g)], self.max[g])
        yield count
        yield total
        yield longest


_stats: GCStats | None = None


def gc_stats() -> GCStats:
    """The process's GCStats (installed on first use)."""
    global _stats
    if _stats is None:
        _stats = GCStats()
    return _stats


#: Allocations between young collections while serving (CPython's default is 700). The
#: request path frees its objects by reference counting, so frequent collections mostly
#: rescan live streams and connections: under 512 streams the default thresholds spent about
#: a fifth of the frontend's CPU in the collector, with generation-2 pauses over 100 ms.
SERVING_THRESHOLDS = (50_000, 20, 100)


def freeze_after_startup() -> None:
    """Move everything alive now (modules, the app, config) out of the collector's sight, so
    that collections during serving only scan objects created since, and collect less often
    (:data:`SERVING_THRESHOLDS`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
