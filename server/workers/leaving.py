"""A listening worker told to stop (SIGTERM): when it tells its frontends, and when it goes.
No trio here.

Theory of operation
-------------------
Kubernetes scales a worker down with SIGTERM, then SIGKILL after the pod's grace period
(30 s by default). A worker that stopped at once would end every stream it runs; its
frontends would move them elsewhere (migration) or end them with an error. So the first
SIGTERM starts a *leave* instead, in three phases that :class:`Leave` times:

1. *told*: the loop sends each frontend that subscribed to ``wire.LEAVING_TOPIC`` a LEAVING
   message. From then on that frontend's SUBMITs are refused with the err kind
   ``wire.LEAVING_KIND`` (the frontend sends them to another worker), and the listener is
   closed. What runs goes on. A connection that was not told (an older frontend) is shut
   as soon as it holds no request: it cannot know to send its new ones elsewhere.
2. *drained*: once nothing runs and every answer is sent, or ``--shutdown-timeout`` seconds
   after the signal (what still runs is then aborted: its frontends move it), the loop
   shuts the write side of each connection. A frontend reads to the end, then closes.
3. *gone*: once every frontend closed, or :data:`CLOSE_GRACE` seconds later, the loop
   returns, and the worker exits with status 0.

A second SIGTERM cuts the leave short: the worker stops at once, as before leaves existed,
and dies of the signal (:func:`server.workers.main.run_as_worker`). Once the leave is over, a
SIGTERM is ignored: the engine's cleanup (seconds for vLLM) runs uncut.

The signal handler only sets a flag and writes a byte to a socket the loop's selector
watches, so the loop wakes up; it never runs the loop's code itself.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from .main import terminate

__all__ = ["CLOSE_GRACE", "Leave"]

#: Seconds the frontends have to close their connections once the drain is over.
CLOSE_GRACE = 2.0


class Leave:
    """The leave of one listening worker's loop (see the module docstring).

    ``timeout``: seconds from the signal until what still runs is cut."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        #: SIGTERM arrived (set by the handler; the loop starts the leave).
        self.asked = False
        #: When what still runs is cut (monotonic), once the leave started; else None.
        self.until: float | None = None
        #: When the connections still open are closed (monotonic), once drained; else None.
        self.closing_until: float | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def fileno(self) -> int:
        """The descriptor the loop's selector watches: readable once SIGTERM arrived."""
        return self._wake_r.fileno()

    @property
    def started(self) -> bool:
        return self.until is not None

    def start(self, now: float) -> float:
        """The leave starts now; returns the seconds until the cut."""
        self.until = now + self.timeout
        return self.timeout

    def left(self, now: float) -> float:
        """Seconds until the cut, from ``now`` (0 once past it)."""
        assert self.until is not None
        return max(0.0, self.until - now)

    def close_soon(self, now: float) -> None:
        """The drain is over: the connections get :data:`CLOSE_GRACE` to close."""
        self.closing_until = now + CLOSE_GRACE

    def woken(self) -> None:
        """Read the wake-up bytes (the loop's selector saw them)."""
        try:
            while self._wake_r.recv(64):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _handler(self, signum, frame) -> None:
        if self.asked:  # a second SIGTERM: stop now, as a worker did before leaves
            terminate(signum, frame)
            return
        self.asked = True
        try:
            self._wake_w.send(b"\0")
        except OSError:  # (full: the loop has a byte to read already)
            pass

    @contextmanager
    def handling_sigterm(self) -> Iterator[None]:
        """Around the loop: the first SIGTERM starts the leave, a second stops at once."""
        previous = signal.signal(signal.SIGTERM, self._handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
