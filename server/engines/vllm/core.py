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

This touches one attribute that vLLM does not document (``outputs_queue`` of its sync
client, a ``queue.Queue`` since the V1 engine); a version without it is refused at start
with one line (``--engine-core worker`` then still works).

**The core dies with its worker** (:func:`tied_to_this_process`), even a worker killed by
SIGKILL with no one to kill its process group (a listening worker started on its own): vLLM
starts the core with ``multiprocessing`` (fork on CPU, spawn once CUDA is initialised) and
target ``EngineCoreProc.run_engine_core``. While the engine is built, that target is
wrapped, on vLLM's class and only for that while (reentrant: the last tie to end restores
exactly what the class held), by :func:`_run_tied`, which first asks the
kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, which survives the
spawn's exec), then runs vLLM's own (:func:`tying`; the wrapper carries the worker's pid
and the class, which a spawn pickles by name). A vLLM without that static method, on the
class or inherited (moved or renamed), is not tied: one line on stderr says so and the
engine starts all the same. What the core starts itself (tensor-parallel workers) vLLM ties
to the core (its workers' death pipe).
In the core's process the wrapper also makes vLLM's shutdown there skip its garbage
collections (:func:`without_collections`: the process exits right after). Nothing else
changes in any process.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import inspect
import os
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CoreProcess", "LIVENESS", "tied_to_this_process", "tying", "without_collections"]

#: While requests are held, how often (seconds) the loop asks whether the core is alive
#: when it has not heard from it.
LIVENESS = 1.0


class _AnnouncingQueue(queue.Queue):
    """vLLM's outputs queue, which also writes a byte to ``_wake_fd`` per item."""

    _wake_fd: int

    def _put(self, item) -> None:
        super()._put(item)
        try:
            os.write(self._wake_fd, b"\0")
        except OSError:  # full (a wakeup is pending anyway), or closed at shutdown
            pass


class CoreProcess:
    """The readiness of a multiprocess ``LLMEngine``'s outputs, as a file descriptor."""

    def __init__(self, llm) -> None:
        client = llm.engine_core
        outputs = getattr(client, "outputs_queue", None)
        if type(outputs) is not queue.Queue or not callable(getattr(client, "ensure_alive", None)):
            raise RuntimeError(
                f"this vLLM's multiprocess client ({type(client).__name__}) has no "
                "outputs_queue to wait on: use --engine-core worker")
        self._client = client
        self._queue = outputs
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        outputs._wake_fd = self._write  # type: ignore[attr-defined]
        outputs.__class__ = _AnnouncingQueue
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
        try:
            self._client.ensure_alive()
        except Exception:
            return False
        return True

    def close(self) -> None:
        """After vLLM's client is shut down: stop announcing, close the pipe."""
        self._queue.__class__ = queue.Queue
        self._queue._wake_fd = -1  # type: ignore[attr-defined]
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass


_PR_SET_PDEATHSIG = 1
#: The name of vLLM's engine core entry point (a static method of ``EngineCoreProc``).
_ENTRY = "run_engine_core"
#: What a class held under :data:`_ENTRY` in its own ``__dict__`` before it was tied, where
#: it held nothing (the static method was inherited).
_ABSENT = object()
#: Each class tied now -> [its ties open, what its __dict__ held before, vLLM's function].
#: A forked core finds vLLM's function here (its copy of the class holds the wrapper); a
#: spawned one imports vLLM afresh, whose class is vLLM's own.
_tied: dict[type, list] = {}
_tied_lock = threading.Lock()


@contextmanager
def tied_to_this_process() -> Iterator[None]:
    """While inside, an engine core process that vLLM starts gets SIGKILL from the kernel
    when this process dies (see the module docstring). Only from the main thread: the
    kernel sends a parent-death signal when the *thread* that forked ends, and the main
    thread lasts as long as the process; from another thread nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    core: type | None = None  # (without it, the engine's build says what is missing)
    try:
        from vllm.v1.engine.core import EngineCoreProc

        core = EngineCoreProc
    except ImportError:
        pass
    with tying(core):
        yield


@contextmanager
def tying(cls: type | None) -> Iterator[None]:
    """While inside, ``cls.run_engine_core`` (vLLM's ``EngineCoreProc``: the target of the
    engine core's process) first ties the process it runs in to this one. Where ``cls``
    has no such static method, its own or inherited (a vLLM that moved or renamed it),
    nothing is changed and one line on stderr says so: the engine still starts, but its
    core may outlive a worker killed by SIGKILL.

    Reentrant, and safe from several threads: the first tie of a class wraps its entry
    point, the last to end puts back exactly what the class held (its own static method,
    or nothing where it inherited one), whatever the order the ties end in."""
    tie = None
    if cls is not None:
        with _tied_lock:
            tie = _tied.get(cls)
            if tie is not None:
                tie[0] += 1
            else:
                found = inspect.getattr_static(cls, _ENTRY, None)
                if isinstance(found, staticmethod):
                    tie = _tied[cls] = [1, cls.__dict__.get(_ENTRY, _ABSENT), found.__func__]
                    setattr(cls, _ENTRY, staticmethod(
                        functools.partial(_run_tied, os.getpid(), cls)))
    if tie is None:
        where = "vllm.v1.engine.core.EngineCoreProc" if cls is None else cls.__qualname__
        print(f"trio-llm-server worker: this vLLM has no {where}.run_engine_core (a static "
              "method) to wrap: its engine core process is not tied to this worker and may "
              "outlive it if the worker is SIGKILLed", file=sys.stderr, flush=True)
        yield
        return
    assert cls is not None
    try:
        yield
    finally:
        with _tied_lock:
            tie[0] -= 1
            if tie[0] == 0:
                del _tied[cls]
                if tie[1] is _ABSENT:
                    delattr(cls, _ENTRY)
                else:
                    setattr(cls, _ENTRY, tie[1])


def _run_tied(parent: int, cls: type, *args, **kwargs) -> None:
    """In the engine core's process: die with ``parent`` (the worker), then be vLLM's core
    (``cls``'s entry point as it was before :func:`tying`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the worker died before prctl took effect
        os._exit(1)
    tie = _tied.get(cls)
    # (forked: the copy of _tied holds vLLM's function; spawned: cls is vLLM's class as
    # imported afresh here, its entry point vLLM's own)
    run = tie[2] if tie is not None else getattr(cls, _ENTRY)
    _shut_down_for_exit(cls)
    run(*args, **kwargs)


def _shut_down_for_exit(cls: type) -> None:
    """In the engine core's process, which exits once vLLM's ``run_engine_core`` has shut
    its engine down: that shutdown (``cls.shutdown``, where there is one) without its
    garbage collections (:func:`without_collections`). This process's class only."""
    shutdown = getattr(cls, "shutdown", None)
    if shutdown is None:
        return

    @functools.wraps(shutdown)
    def shutdown_for_exit(self, *args, **kwargs) -> None:
        with without_collections():
            shutdown(self, *args, **kwargs)

    cls.shutdown = shutdown_for_exit  # type: ignore[attr-defined]


@contextmanager
def without_collections() -> Iterator[None]:
    """While inside, ``gc.collect()`` and ``gc.unfreeze()`` do nothing: around vLLM's
    shutdown in a worker whose process exits next (``VLLMEngine.close_before_exit``).

    vLLM's shutdown of an engine core in this process (``InprocClient.shutdown`` ->
    ``EngineCore.shutdown``) also gives its memory back for reuse in the same process: the
    model runner drops its KV cache and runs ``gc.collect()``, and after the distributed
    teardown ``gc.unfreeze()`` (vLLM froze every object made at startup) and a second
    ``gc.collect()`` walk every object vLLM and torch made, about 790,000 for a tiny model.
    Measured (bench/shutdown_time.py, the tiny model, load average 4): 0.8-1.1 s and 1.3 s of
    the worker's CPU, all of it undone by the exit a moment later, and together longer than
    the frontend's ``shutdown_grace`` (2 s): the worker was SIGTERMed inside the second
    collection (a signal's handler waits for it: it is one C call) and the server took
    2.2-2.8 s to exit with ``--shutdown-timeout 0`` and nothing in flight (4.5 s at a load
    average of 10). Everything else of vLLM's shutdown still runs, in its order (the KV
    event publisher's socket, KV connectors, the profiler, the distributed teardown); only
    the collections, which free nothing the exit does not, are skipped. The process exits
    after, so nothing needs them back; they are restored all the same."""
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect = lambda generation=2: 0  # type: ignore[assignment]
    gc.unfreeze = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze
