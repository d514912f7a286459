"""The worker's pulse: proof of life while one engine step runs long. No trio here.

Example (what the worker loops of :mod:`server.workers.main` and ``listen`` do)::

    pulse = Pulse(send, period=1.0)   # holds pulse.lock: the loop owns the outputs
    pulse.start()
    ...
    pulse.enter()                     # about to step: the pulse may speak meanwhile
    outputs = engine.step(now)
    pulse.leave()                     # the loop owns the outputs again
    ...
    pulse.close()

Theory of operation
-------------------
The frontend pings its worker every second and takes it for hung after
``--heartbeat-timeout`` (10 s) without a frame. The loop answers a ping between two engine
steps, so one step longer than the timeout (a long prefill on a busy CPU, whose wall time
no token budget bounds: it is the machine's load times the work) used to get a worker that
was making progress killed, with every request it held.

So a thread beside the loop speaks for it while it is inside a step (or answers a
CALL between steps: an embedding's forward pass, a LoRA load; see
``server.workers.main.handle_in_pulse``), and only then. The loop holds :attr:`lock` at
all other times, and so owns its outputs (pipe or sockets) alone. :meth:`enter` releases
it for the step; :meth:`leave` takes it back (waiting for a pulse being written, a few
microseconds). Every ``period`` seconds the thread takes the lock, which it gets only while
the loop is in a step. If the step has run at least ``period`` and the loop's thread used
CPU since the last look, it calls ``send``. The worker then writes an unasked PONG
(sequence number 0, the counts of its last answer), which the frontend counts as hearing
from it. Its cost to the loop is a lock release and acquire per step.

What this tells apart:

* a worker whose step computes (a forward pass, a CPU busy in the loop's thread, or a GPU
  wait that spins) is never taken for hung, however long the step;
* a frozen process (SIGSTOP, a dead host, a dead network link) sends nothing: the thread is
  frozen too;
* a loop blocked outside a step (a bug, a deadlock, the sim's ``hang`` fault) sends
  nothing: the thread never gets the lock;
* a step blocked without computing (waiting on a lock or a peer that never answers) sends
  nothing: its thread's CPU time stands still;
* except for a while the loop declares a *wait* (``enter(waiting=s)``). A LoRA adapter's
  load waits, without computing, on a slow disk or on vLLM's engine core process (which
  does the loading with ``--engine-core process``). For its first ``s`` seconds the pulse
  speaks whether or not the loop's thread uses CPU, then as for a step (a load blocked for
  longer is taken for hung).

What it cannot tell apart: a step spinning forever (an infinite loop in the model's code)
looks like progress; no engine exposes progress inside one forward pass.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Pulse"]

#: How long the thread waits for the lock at a tick (the loop holds it between steps).
_LOCK_WAIT = 0.05


class Pulse:
    """See the module docstring. ``send`` runs in the pulse's thread, with :attr:`lock`
    held, while the loop is in a step."""

    def __init__(self, send: Callable[[], None], period: float = 1.0) -> None:
        if not period > 0:
            raise ValueError("the pulse period must be positive")
        self.period = period
        self.lock = threading.Lock()
        self.lock.acquire()  # the loop's, except while it steps
        self._send = send
        self._stop = threading.Event()
        self._since: float | None = None  # when the current step began (None: not in one)
        self._waiting = 0.0  # seconds from _since that it speaks without CPU (enter)
        self._loop_clock = time.pthread_getcpuclockid(threading.get_ident())
        self._cpu = 0.0
        self._thread = threading.Thread(target=self._run, name="worker-pulse", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def enter(self, waiting: float = 0.0) -> None:
        """The loop is about to step (it holds the lock); for the first ``waiting`` seconds
        what it runs may wait without computing (see the module docstring)."""
        self._waiting = waiting
        self._since = time.monotonic()
        self.lock.release()

    def leave(self) -> None:
        """The step is over: the loop owns its outputs again."""
        self.lock.acquire()
        self._since = None

    def close(self) -> None:
        """Stop the thread (from the loop's thread). The lock is not touched: the thread
        never waits for it long, so this holds also when a signal cut :meth:`leave` short
        and the loop does not hold it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            # Free only while the loop steps; held, this tick is skipped (not in a step).
            if not self.lock.acquire(timeout=_LOCK_WAIT):
                continue
            try:
                since = self._since
                if since is None or self._stop.is_set():
                    continue
                cpu = time.clock_gettime(self._loop_clock)
                moved, self._cpu = cpu > self._cpu, cpu
                inside = time.monotonic() - since
                if (moved or inside < self._waiting) and inside >= self.period:
                    try:
                        self._send()
                    except OSError:  # the link broke: the loop finds out after the step
                        self._stop.set()
            finally:
                self.lock.release()
