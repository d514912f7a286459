"""Request timeouts: one server-wide task, not one timer per request.

:class:`DeadlineQueue` holds (deadline, stream, cause) entries in a heap. Its :meth:`run`
task, in the engine's nursery, sleeps until the earliest deadline and then calls the
stream's ``abort(cause)``: the stream drains and each open choice ends with ``abort``. Two
causes: ``"timeout"`` (the request timeout: whatever the stream is doing) and
``"queue_timeout"`` (the queue-time limit: only a stream that has not started, see
:attr:`~server.manager.stream.RequestStream.started`; one that started is left alone). A
stream that finished before its deadline is only referenced weakly, so the queue never
keeps a finished request alive; its entry is dropped when its time comes.

Cost per request and limit: one heap push and one weak reference.
"""

from __future__ import annotations

import heapq
import itertools
import math
import weakref

import trio

from ..errors import ServiceUnavailable

__all__ = ["DeadlineQueue", "QUEUE_TIMEOUT", "TIMEOUT", "queue_timeout_error"]

#: The causes of a deadline's abort (the stream's ``abort_cause``).
TIMEOUT = "timeout"
QUEUE_TIMEOUT = "queue_timeout"


def queue_timeout_error() -> ServiceUnavailable:
    """What a request the queue-time limit aborted before it started gets (a 503 with
    Retry-After: the server is overloaded, not broken)."""
    return ServiceUnavailable(
        "The request waited longer than the server's queue-time limit without starting "
        "(the server is overloaded); retry later.",
        code="server_overloaded",
    )


class DeadlineQueue:
    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline: float, stream, cause: str = TIMEOUT) -> None:
        """Abort ``stream`` with ``cause`` at ``deadline`` (trio time); for
        :data:`QUEUE_TIMEOUT`, only if it has not started by then."""
        first = not self._heap or deadline < self._heap[0][0]
        heapq.heappush(self._heap, (deadline, next(self._seq), weakref.ref(stream), cause))
        if first:
            self._changed.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _, _, ref, cause = heapq.heappop(heap)
                stream = ref()
                if stream is not None and (cause != QUEUE_TIMEOUT or not stream.started):
                    stream.abort(cause)
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._changed.wait()
            self._changed = trio.Event()
