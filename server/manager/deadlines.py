"""Request timeouts: one server-wide task, not one timer per request.

:class:`DeadlineQueue` holds (deadline, stream) pairs in a heap. Its :meth:`run` task, in the
engine's nursery, sleeps until the earliest deadline and then calls the stream's
``abort("timeout")``: the stream drains and each open choice ends with ``abort``. A stream
that finished before its deadline is only referenced weakly, so the queue never keeps a
finished request alive; its entry is dropped when its time comes.

Cost per request: one heap push and one weak reference.
"""

from __future__ import annotations

import heapq
import itertools
import math
import weakref

import trio

__all__ = ["DeadlineQueue"]


class DeadlineQueue:
    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline: float, stream) -> None:
        """Abort ``stream`` (with cause ``"timeout"``) at ``deadline`` (trio time)."""
        first = not self._heap or deadline < self._heap[0][0]
        heapq.heappush(self._heap, (deadline, next(self._seq), weakref.ref(stream)))
        if first:
            self._changed.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                stream = heapq.heappop(heap)[2]()
                if stream is not None:
                    stream.abort("timeout")
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._changed.wait()
            self._changed = trio.Event()
