"""When a silent worker is hung: its silence, less what the frontend or the host made of it.

Sans-IO: the heartbeat (:meth:`server.manager.worker.WorkerClient._heartbeat`) feeds these
with its clock's readings and the kernel's counter, and asks :func:`judge` on each tick.

Why
---
A worker is taken for hung when the frontend has not heard from it for
``--heartbeat-timeout``. But silence is what the *frontend* saw, and on a starved host it
sees late: a frontend whose event loop was blocked or starved for 9 s reads the worker's
answers 9 s late, and a worker that waits for a CPU cannot answer at all. On a host at load
15-28 over 2 cores (``/proc/pressure/cpu`` at 98 %) every idle worker of three servers was
SIGKILLed within half a second of the others ("no answer for 10.0 s"), to come back ~70 s
later. Those workers were not hung; the host was.

So the silence counted against a worker is its silence less the larger of:

* the frontend's own lateness over that silence (:class:`LoopLag`): how late the heartbeat
  task woke, each time, past the moment it asked to wake (a blocked or starved loop wakes
  every timer late; the worker's answers wait unread in the pipe meanwhile);
* the host's CPU stall over that silence (:class:`CpuStall`): the growth of the kernel's
  ``some`` stall counter in ``/proc/pressure/cpu`` (time in which at least one runnable task
  waited for a CPU; no file, no discount), in real seconds, so none under a mock clock.

(The larger, not the sum: a starved host makes both at once.) The discount is bounded: past
``MAX_STRETCH`` times the timeout a silent worker is hung whatever the discount, so that a
truly hung worker on a host under constant pressure is still killed. A SIGSTOPped worker on
an idle host is hung after the timeout, as before.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = ["MAX_STRETCH", "CpuStall", "LoopLag", "Verdict", "judge", "parse_cpu_stall",
           "read_cpu_stall"]

#: The discount extends the hang deadline to at most this many times the timeout.
MAX_STRETCH = 3.0

#: The kernel's CPU pressure (Linux 4.20+, with PSI on).
PRESSURE_FILE = "/proc/pressure/cpu"


@dataclass(frozen=True)
class Verdict:
    """:func:`judge`'s answer: whether the worker is hung, what to say, and whether the
    discount is what kept (``excused``) a worker silent past the timeout alive."""

    hung: bool
    excused: bool
    reason: str


def judge(silent: float, timeout: float, loop_late: float, cpu_stalled: float,
          stretch: float = MAX_STRETCH) -> Verdict:
    """The verdict on a worker not heard for ``silent`` seconds, of which the frontend's
    loop was ``loop_late`` seconds late and the host's CPU stalled ``cpu_stalled`` seconds
    (see the module docstring)."""
    discount = min(max(loop_late, cpu_stalled, 0.0), silent)
    why = []
    if loop_late >= 0.05:
        why.append(f"the frontend's loop was late {loop_late:.1f} s")
    if cpu_stalled >= 0.05:
        why.append(f"the host's CPU was under pressure {cpu_stalled:.1f} s")
    said = f"no answer for {silent:.1f} s"
    if why:
        said += ", of which " + " and ".join(why)
    if silent - discount > timeout:
        return Verdict(True, False, f"{said} (hung)")
    if silent > timeout * stretch:
        return Verdict(True, False, f"{said} (hung: past {stretch:g} times the heartbeat "
                                    "timeout, whatever the frontend or the host made of it)")
    return Verdict(False, silent > timeout, f"{said}: not taken for hung yet")


class LoopLag:
    """How late the frontend's loop woke a periodic task (the heartbeat), over a window.

    :meth:`woke` after each sleep with how late it woke; :meth:`within` the lateness that
    fell after a moment. Records older than ``keep`` seconds are dropped."""

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self._wakes: collections.deque[tuple[float, float]] = collections.deque()

    def woke(self, now: float, late: float) -> None:
        wakes = self._wakes
        if late > 0:
            wakes.append((now, late))
        while wakes and wakes[0][0] < now - self.keep:
            wakes.popleft()

    def within(self, since: float) -> float:
        """Seconds of lateness after ``since`` (a wake late by L at t covers [t - L, t])."""
        return sum(min(late, t - since) for t, late in self._wakes if t > since)


class CpuStall:
    """The host's CPU stall counter (:func:`read_cpu_stall`), sampled at each heartbeat.

    :meth:`sample` with the clock's time and the counter (None: nothing is kept);
    :meth:`within` the counter's growth since the first sample at or after a moment (a
    conservative reading: the stall before that sample is not counted)."""

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self._samples: collections.deque[tuple[float, float]] = collections.deque()

    def sample(self, now: float, total: float | None) -> None:
        samples = self._samples
        if total is None:
            samples.clear()
            return
        samples.append((now, total))
        while len(samples) > 1 and samples[0][0] < now - self.keep:
            samples.popleft()

    def within(self, since: float) -> float:
        samples = self._samples
        if not samples:
            return 0.0
        for t, total in samples:
            if t >= since:
                return max(0.0, samples[-1][1] - total)
        return 0.0


def parse_cpu_stall(text: str) -> float | None:
    """The ``some`` line's ``total`` (microseconds) of ``/proc/pressure/cpu``, in seconds."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for field in fields[1:]:
                key, _, value = field.partition("=")
                if key == "total" and value.isdigit():
                    return int(value) / 1e6
    return None


def read_cpu_stall(path: str = PRESSURE_FILE) -> float | None:
    """The host's CPU stall so far, seconds (None where the kernel does not report it)."""
    try:
        with open(path) as f:
            return parse_cpu_stall(f.read())
    except OSError:
        return None
