"""What a run measured: the outcome of each request (:class:`Result`), their aggregation over
a phase of the run (:class:`Stats`), the nearest-rank :func:`percentile`, and the tokens
delivered inside a time window by all streams (:func:`tokens_between`)."""

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

    def __init__(self, record_timeline: bool, streams: list | None = None) -> None:
        #: Shared by the phases of a run: (content event times, tokens per event) of every
        #: stream, for :func:`tokens_between`.
        self.streams = streams
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
        #: When the run stopped starting measured requests (0: not yet): until then every
        #: client was busy, so the window t_start..t_steady_end is the steady state.
        self.t_steady_end = 0.0

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
            if self.streams is not None and t.first is not None and t.content_events:
                self.streams.append((t.first, t.gaps, t.tokens / t.content_events))
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


def tokens_between(streams: list, a: float, b: float) -> float:
    """Tokens delivered from time ``a`` to ``b`` by ``streams`` (see :attr:`Stats.streams`):
    each content event carries its stream's tokens divided by its content events.

    Unlike tokens of requests *started* in a window divided by the window's length (which
    reads low by about one request length over the window, since the last requests end after
    it), this counts what was delivered while every client was busy, whoever started it.
    """
    total = 0.0
    for first, gaps, per_event in streams:
        t = first
        n = 1 if a <= t < b else 0
        for gap in gaps:
            t += gap
            if t >= b:
                break
            if t >= a:
                n += 1
        total += n * per_event
    return total
