"""Pacing: when the consumers of one worker's streams are woken for news. Never blocks.

Theory of operation
-------------------
With a stream interval (``--stream-interval-ms``), news that is not terminal wakes a
stream's consumer at most once per interval; what arrives meanwhile merges into the
pending text of its choices. That gives fewer, fuller SSE events, which is what makes the
HTTP send path affordable.

One :class:`Pacer` per worker client holds every decision about *when*:

* A consumer that has news before its time (its waker's ``not_before``) is **deferred**: it
  waits in a heap ordered by ``not_before``.
* The router wakes the deferred consumers that are due **when the next frame arrives**, so
  that an event carries whole engine steps (at 8 ms a step and a 20 ms interval: 3 tokens,
  not alternately 2 and 3). When no frame comes (a stalled or slow engine), it wakes them
  **by time**, one interval after the first is due. :meth:`router_deadline` is that time; a consumer
  that defers itself while the router waits moves the router's deadline (``router_scope``).
* A paced consumer whose time has come when news arrives is woken **soon**: one scheduler
  turn after the router woke the urgent ones (a stream's first output, its end, an error),
  so that a new stream's first token does not wait behind the next event of every other
  stream.

The stream side (:class:`~server.manager.stream.Waker`) asks :meth:`Pacer.defer` or
:meth:`Pacer.wake_soon`; the router calls :meth:`wake_due` and :meth:`take_soon`; the
worker client calls :meth:`clear` when its process goes away.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from .stream import Waker

__all__ = ["Pacer"]


class Pacer:
    """The paced wakeups of one worker's consumers (see the module docstring)."""

    __slots__ = ("interval", "frame_time", "due", "router_scope", "_heap", "_seq", "_soon")

    def __init__(self, interval: float) -> None:
        #: The least time between two wakeups of one consumer for news (0: no pacing).
        self.interval = interval
        #: When the router read the frame it is routing (one clock read per frame).
        self.frame_time = -math.inf
        #: The earliest ``not_before`` of the deferred consumers (inf: none).
        self.due = math.inf
        #: The router's wait for the next frame, while it waits.
        self.router_scope: trio.CancelScope | None = None
        self._heap: list[tuple[float, int, Waker]] = []
        self._seq = 0
        self._soon: list[Waker] = []

    def defer(self, waker: Waker) -> None:
        """Hold ``waker``'s wakeup until its ``not_before``."""
        self._seq += 1
        heapq.heappush(self._heap, (waker.not_before, self._seq, waker))
        self.due = due = self._heap[0][0]
        scope = self.router_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, due + self.interval)

    def wake_soon(self, waker: Waker) -> None:
        """Wake ``waker`` after the router's next scheduler turn."""
        self._soon.append(waker)

    def router_deadline(self) -> float:
        """When the router stops waiting for a frame to wake the deferred by time."""
        return self.due + self.interval

    def pending(self, now: float) -> bool:
        """Whether a paced wakeup is due (soon ones, or deferred ones whose time came)."""
        return bool(self._soon) or self.due <= now

    def take_soon(self) -> list[Waker]:
        soon, self._soon = self._soon, []
        return soon

    def wake_due(self, now: float) -> None:
        """Wake the deferred consumers whose time has come; keep the others."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            waker = heapq.heappop(heap)[2]
            if waker.task is None:
                waker.deferred = False  # woken by other news, or cancelled: nothing to do
            elif waker.not_before > now:  # took other news since: due later now
                self._seq += 1
                heapq.heappush(heap, (waker.not_before, self._seq, waker))
            else:
                waker.deferred = False
                waker.wake_paced()
        self.due = heap[0][0] if heap else math.inf

    def clear(self) -> None:
        """Forget every paced wakeup (the worker's process went away; its streams end)."""
        for _, _, waker in self._heap:
            waker.deferred = False
        self._heap = []
        self.due = math.inf
        self._soon = []
