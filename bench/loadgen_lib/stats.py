"""What a run measured: the outcome of each request (:class:`Result`), their aggregation over
a phase of the run (:class:`Stats`) and the nearest-rank :func:`percentile`."""

from __future__ import annotations

import math
from array import array
from collections import Counter

from .openai_api import StreamTracker

MAX_ERROR_SAMPLES = 5


class Result:
    """The outcome of one request (times in ``time.perf_counter`` seconds)."""

    __slots__ = ("start", "end", "status", "tracker", "error", "error_kind", "incomplete")

    def __init__(self, start: float) -> None:
        self.start = start
        self.end = start
        self.status = 0
        self.tracker: StreamTracker | None = None
        self.error: str | None = None
        self.error_kind: str | None = None
        self.incomplete = False


class Stats:
    """What a phase of the run collected."""

    def __init__(self, record_timeline: bool) -> None:
        self.requests = 0
        self.errors = 0
        self.incomplete = 0
        self.tokens = 0
        self.content_events = 0
        self.ttfts: list[float] = []
        self.gaps = array("d")
        self.error_kinds: Counter = Counter()
        self.error_samples: list[str] = []
        self.statuses: Counter = Counter()
        self.usage_missing = 0
        self.timeline: list | None = [] if record_timeline else None
        self.t_start = 0.0
        self.t_end = 0.0

    def record(self, r: Result) -> None:
        self.requests += 1
        self.statuses[r.status] += 1
        t = r.tracker
        if r.error is not None or (t is not None and t.error is not None):
            self.errors += 1
            kind = r.error_kind or "error_event"
            self.error_kinds[kind] += 1
            if len(self.error_samples) < MAX_ERROR_SAMPLES:
                self.error_samples.append(f"{kind}: {r.error or t.error}")
        if r.incomplete:
            self.incomplete += 1
        if t is not None:
            self.tokens += t.tokens
            self.content_events += t.content_events
            if t.usage_tokens is None and t.content_events:
                self.usage_missing += 1
            if t.first is not None:
                self.ttfts.append(t.first - r.start)
            if t.gaps:
                self.gaps.extend(t.gaps)
        if self.timeline is not None:
            ttft = (t.first - r.start) if (t is not None and t.first is not None) else None
            mean_gap = (sum(t.gaps) / len(t.gaps)) if (t is not None and t.gaps) else None
            self.timeline.append((r.start, r.end, ttft, mean_gap,
                                  t.tokens if t is not None else 0, r.error is not None))


def percentile(sorted_values, p: float):
    """Nearest-rank percentile of an ascending sequence (None when empty)."""
    n = len(sorted_values)
    if n == 0:
        return None
    k = math.ceil(p / 100.0 * n)
    k = min(max(k, 1), n)
    return sorted_values[k - 1]
