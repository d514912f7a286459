"""When to restart a child that ended: an engine worker the frontend spawned or connects to,
or a child of the ``--api-servers`` supervisor. Sans-IO.

The policy (docs/operations.md, "Worker supervision"):

* **Backoff.** A restart waits ``first`` seconds after a death, doubling up to ``cap``; it
  starts over once the child lived ``window`` seconds.
* **The budget.** More than ``limit`` deaths within ``window`` put the child *over its
  budget*: from then on each restart waits ``cap``, and the caller logs one error for the
  episode (:attr:`Restart.over_budget_now`), not one per retry. The child is never given
  up on: a worker left down stays down until someone restarts the whole server, while one
  retried at the cap comes back by itself once what killed it has passed (a memory
  pressure, a bad batch, a flood of connections that took the descriptors). The episode
  ends when the child lives ``window`` seconds: it then gets its normal backoff back, and
  a later crash loop is a new episode (a new error line). ``limit`` None: no budget (a
  remote worker, restarted by whoever runs it, not by us: reconnected to at the backoff).
* **Not the child's fault.** A start that failed for the starter's own reasons
  (:func:`starter_fault`: out of descriptors, memory or processes in the frontend) is a
  death that is not *charged*: it backs off as any, but does not count against the budget.
  Else a connection flood that took every descriptor would spend the budget in seconds.
"""

from __future__ import annotations

import errno
from collections import deque
from dataclasses import dataclass

__all__ = ["Restart", "Restarts", "STARTER_ERRNOS", "starter_fault"]

#: The errors of a failed spawn that are the spawning process's own state, not the child's:
#: out of file descriptors (the process's, the system's) for its pipes, out of memory or of
#: processes for the fork.
STARTER_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})


def starter_fault(exc: OSError) -> bool:
    """Whether a spawn that raised ``exc`` failed for the spawning process's own reasons."""
    return exc.errno in STARTER_ERRNOS


@dataclass(frozen=True)
class Restart:
    """What to do after a death: wait ``delay`` seconds, then start the child again."""

    delay: float
    #: This death put the child over its budget: say so (once for the episode).
    over_budget_now: bool = False


class Restarts:
    """The restart policy of one child (module docstring)."""

    def __init__(self, limit: int | None, *, window: float = 60.0, first: float = 0.1,
                 cap: float = 5.0) -> None:
        self.limit = limit
        self.window = window
        self.first = first
        self.cap = cap
        #: Over its budget: restarted at the cap until it lives ``window`` seconds.
        self.over_budget = False
        self._delay = first
        self._deaths: deque[float] = deque()

    def charged(self) -> int:
        """The deaths counted against the budget within the window (as of the last)."""
        return len(self._deaths)

    def died(self, now: float, lived: float, *, charged: bool = True) -> Restart:
        """The restart of a child that died (or could not be started) at ``now`` after
        ``lived`` seconds; ``charged``: the death counts against the budget."""
        if lived >= self.window:
            self._delay = self.first
            self.over_budget = False
        if charged:
            self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - self.window:
            self._deaths.popleft()
        now_over = (self.limit is not None and not self.over_budget
                    and len(self._deaths) > self.limit)
        self.over_budget = self.over_budget or now_over
        delay = self.cap if self.over_budget else self._delay
        self._delay = min(self._delay * 2, self.cap)
        return Restart(delay, now_over)
