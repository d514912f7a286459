"""A histogram for one thread, kept as plain numbers and exposed at scrape time. Sans-IO."""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from prometheus_client.utils import floatToGoString

__all__ = ["Histogram"]


class Histogram:
    """A histogram for one thread: :meth:`observe` is a bisect and two additions, no lock.

    ``counts[i]`` counts the values in ``(bounds[i-1], bounds[i]]``; the last slot counts
    those above every bound (the ``+Inf`` bucket).
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, as the exposition format wants them."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            out.append((floatToGoString(bound), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out
