"""vLLM's engine core in a process of its own (``--engine-core process``), waited on with
the worker's pipe.

Example (what :class:`~server.engines.vllm.engine.VLLMEngine` does with a multiprocess
``LLMEngine``)::

    core = CoreProcess(llm)                 # llm: LLMEngine(..., multiprocess_mode=True)
    selector.register(core.fileno(), EVENT_READ)   # beside the pipe from the frontend
    if core.pending():                      # outputs wait: LLMEngine.step() will not block
        outputs = llm.step()
    core.alive()                            # False once vLLM saw its engine core die

Theory of operation
-------------------
With its multiprocess client (``SyncMPClient``), vLLM's ``LLMEngine`` runs the engine core
(scheduler, model runner) as a busy-looping process of its own, as ``vllm serve`` does:
the core schedules and runs step *n+1* while this process turns step *n*'s outputs into
text (detokenizing, stop strings) and serves the pipe. The client's socket thread puts each
of the core's outputs on a ``queue.Queue`` (``outputs_queue``), and ``LLMEngine.step()``
takes one from it, *blocking* until there is one. The worker's loop must never block there:
it waits on file descriptors (the pipe, the preparation threads'), and a step would also
block for ever once the core is gone (vLLM's client notices a dead core, marks itself
dead and stops its socket thread, but wakes no one waiting on the queue).

So the queue is made to announce itself: its class becomes a subclass whose ``_put`` (the
hook ``queue.Queue`` subclasses override) also writes a byte to a pipe of ours, and
:meth:`pending` says whether an output waits (then ``step()`` returns at once). The loop
selects on :meth:`fileno` beside its pipe, with a deadline of :data:`LIVENESS` seconds
while requests are held, at which :meth:`alive` asks vLLM's client whether it saw its
core die (``ensure_alive``, vLLM's monitor thread watches the core's process sentinel).

The queue and its class are vLLM's internals (:mod:`.private_api`): a vLLM without them is
refused at start with one line (``--engine-core worker`` then still works).

**The core dies with its worker**, even a worker killed by SIGKILL with no one to kill its
process group: :func:`~.private_api.tied_to_this_process` while the engine is built
(docs/vllm.md).
"""

from __future__ import annotations

import os

from .private_api import announce_outputs, core_alive, stop_announcing, tied_to_this_process

__all__ = ["CoreProcess", "LIVENESS", "tied_to_this_process"]

#: While requests are held, how often (seconds) the loop asks whether the core is alive
#: when it has not heard from it.
LIVENESS = 1.0


class CoreProcess:
    """The readiness of a multiprocess ``LLMEngine``'s outputs, as a file descriptor."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        try:
            outputs = self._queue = announce_outputs(llm, self._write)
        except BaseException:
            os.close(self._read)
            os.close(self._write)
            raise
        if outputs.qsize():  # (what arrived before the swap announced nothing)
            os.write(self._write, b"\0")

    def fileno(self) -> int:
        """Readable when the core has sent an output (or :meth:`pending` was not asked
        since)."""
        return self._read

    def pending(self) -> int:
        """How many outputs wait (``LLMEngine.step()`` takes one each, without blocking);
        consumes the wakeups."""
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        return self._queue.qsize()

    def alive(self) -> bool:
        """False once vLLM's client saw the core process die (its ``ensure_alive``)."""
        return core_alive(self._llm)

    def close(self) -> None:
        """After vLLM's client is shut down: stop announcing, close the pipe."""
        stop_announcing(self._queue)
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
