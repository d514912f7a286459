"""Every private name of vLLM that the vllm engine relies on, in one module.

Why: the worker drives vLLM's ``LLMEngine`` step by step beside its own pipe, and a few
things it needs have no public API in vLLM (docs/vllm.md): waiting on the engine core's
outputs without blocking, tying the engine core's process to the worker, exiting without
vLLM's garbage collections, niced grammar threads, and vLLM's own detokenizer for a resumed
request. Those names may change in any vLLM release. So:

* **Only this module names them.** :mod:`.core`, :mod:`.engine`, :mod:`.resume` and
  :mod:`.torch_threads` call the functions below.
* **The versions are checked.** :data:`WRITTEN_FOR` lists the vLLM releases this was
  written and tested against (pyproject.toml allows the same range; the newest is in
  ``.venv``, the oldest in run-tests' ``vllm-oldest`` stage). At the engine's start,
  :func:`problems` names a release not in the table and any name below that is missing;
  the worker prints them on one line (stderr) and starts all the same, each use then
  falling back as its row says.
* **Tested**: tests/test_vllm_private_api.py fails when the installed vLLM is not in the
  table or lacks a name, so a vLLM update breaks a test rather than a deployment.

=========================================  ==============================  =====================
name (vLLM 0.31-0.32)                      relied on for                   without it
=========================================  ==============================  =====================
``LLMEngine.engine_core`` (the client),    the worker waits on the core's  ``--engine-core
``SyncMPClient.outputs_queue`` (a          outputs with its pipe, never    process`` refused at
``queue.Queue``; its class swapped for     blocking in ``step()``          start (``worker``
one that writes a byte to a pipe),         (:class:`.core.CoreProcess`)    still works)
``MPClient.ensure_alive``;
``LLMEngine.engine_core.shutdown``         stopping the engine (no public  (nothing stops it)
                                           shutdown)
``EngineCoreProc.run_engine_core`` (a      the core process dies with its  not tied: one line on
static method, the core process's          worker, even one SIGKILLed      stderr, the engine
target), wrapped while the engine is       (:func:`tying`)                 starts
built
``EngineCoreProc.shutdown``, replaced in   the core's last shutdown skips  the collections run
the core's own process                     garbage collections
``gc.collect``, ``gc.unfreeze``: no-ops    vLLM's shutdown collects twice  (nothing missing: a
process-wide around vLLM's shutdown in a   (~1-2 s of CPU) in a process    vLLM that stops
worker about to exit                       about to exit                   collecting is faster)
``InprocClient.engine_core.                grammars compile in niced       grammar threads at
structured_output_manager.executor`` and   threads, so that steps go first the steps' priority
its ``ThreadPoolExecutor._max_workers``    (:func:`replace_grammar_pool`)
``IncrementalDetokenizer.                  a resumed request's text is     the engine does not
from_new_request`` given a                 exactly vLLM's                  resume requests
``SimpleNamespace`` for its                (:func:`new_detokenizer`)
``EngineCoreRequest`` (``request_id``,
``prompt_token_ids``, ``prompt_embeds``,
``sampling_params``); its ``update``,
``get_next_output_text``,
``num_output_tokens``, ``output_text``
``BaseRenderer._mm_processor_only_cache``  an image vLLM has processed is  every image
(the processor cache ``render_cmpl(        not decompressed again          decompressed, then
skip_mm_cache=True)`` uses), its           (:func:`processed_images`;      found in vLLM's
``is_cached_item`` (vLLM 0.32: images)     server.engines.vllm.images)     cache all the same
``vllm.utils.ompmultiprocessing.           the cores vLLM's CPU build      torch's threads left
OMPProcessManager`` (``cpu_lists``,        binds its model to              as they are
``skip_setup``), the mark                  (:mod:`.torch_threads`); vLLM's
``VLLM_OMP_NUM_THREADS_SET_BY_VLLM``;      CPU worker made torch's public
``torch._C.set_num_threads``               setter a no-op
=========================================  ==============================  =====================

The history of each (what was measured, which issue) is in docs/vllm.md.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import inspect
import os
import queue
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

__all__ = [
    "OMP_SET_BY_VLLM",
    "WRITTEN_FOR",
    "announce_outputs",
    "core_alive",
    "detokenizer_class",
    "engine_core_class",
    "missing_names",
    "new_detokenizer",
    "omp_cpu_bound",
    "outputs_queue",
    "problems",
    "processed_images",
    "replace_grammar_pool",
    "set_torch_threads",
    "shut_down",
    "stop_announcing",
    "tied_to_this_process",
    "tying",
    "version_problem",
    "without_collections",
]

#: The vLLM releases (major.minor) this module's names were written and tested against.
WRITTEN_FOR = ("0.31", "0.32")


def version_problem(installed: str | None, written_for: tuple[str, ...] = WRITTEN_FOR) -> str | None:
    """Why vLLM ``installed`` (its ``__version__``; None: not installed) is not a release
    this module was written for, or None. Sans-IO."""
    if installed is None:
        return "vLLM not installed"
    release = ".".join(installed.split("+")[0].split(".")[:2])
    if release in written_for:
        return None
    return f"vLLM {installed} (written for {', '.join(written_for)})"


def _assigned_in(cls: type, name: str) -> bool:
    """Whether a method of ``cls`` sets ``self.<name>`` (an instance attribute: there is no
    class attribute to look for)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"self\.{name}\s*[:=]", source) is not None


def missing_names() -> list[str]:
    """The names of the table above that the installed vLLM lacks (vLLM is imported)."""
    missing: list[str] = []
    try:
        from vllm.v1.engine.core import EngineCore, EngineCoreProc
        from vllm.v1.engine.core_client import InprocClient, MPClient, SyncMPClient
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:
        return [f"vllm: {exc}"]
    for cls, name in [(LLMEngine, "engine_core"), (SyncMPClient, "outputs_queue"),
                      (InprocClient, "engine_core"), (EngineCore, "structured_output_manager"),
                      (StructuredOutputManager, "executor")]:
        if not _assigned_in(cls, name):
            missing.append(f"{cls.__qualname__}.{name}")
    if not isinstance(inspect.getattr_static(EngineCoreProc, _ENTRY, None), staticmethod):
        missing.append(f"EngineCoreProc.{_ENTRY}")
    for cls, names in [(MPClient, ("ensure_alive",)), (EngineCore, ("shutdown",)),
                       (IncrementalDetokenizer, ("from_new_request", "update",
                                                 "get_next_output_text", "num_output_tokens"))]:
        missing.extend(f"{cls.__qualname__}.{name}" for name in names if not hasattr(cls, name))
    with ThreadPoolExecutor(1) as pool:
        if not isinstance(getattr(pool, "_max_workers", None), int):
            missing.append("ThreadPoolExecutor._max_workers")
    try:  # (images are on from 0.32, whose renderer this is)
        from vllm.renderers.base import BaseRenderer
    except ImportError:
        pass
    else:
        if not _assigned_in(BaseRenderer, "_mm_processor_only_cache"):
            missing.append("BaseRenderer._mm_processor_only_cache")
        else:
            from vllm.multimodal.cache.base import MultiModalProcessorOnlyCache
            if not hasattr(MultiModalProcessorOnlyCache, "is_cached_item"):
                missing.append("MultiModalProcessorOnlyCache.is_cached_item")
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager
    except ImportError:
        missing.append("vllm.utils.ompmultiprocessing.OMPProcessManager")
    else:
        if not (_assigned_in(OMPProcessManager, "cpu_lists")
                and _assigned_in(OMPProcessManager, "skip_setup")):
            missing.append("OMPProcessManager.cpu_lists, skip_setup")
    return missing


@functools.cache
def problems() -> str | None:
    """Why this vLLM is not one the table was checked against, on one line, or None
    (checked once per process, at the engine's start)."""
    import vllm

    found = [version_problem(getattr(vllm, "__version__", None))]
    missing = missing_names()
    if missing:
        found.append("missing: " + ", ".join(missing))
    return "; ".join(filter(None, found)) or None


# -- images ----------------------------------------------------------------------------------


def processed_images(llm) -> Callable[[str], bool] | None:
    """Whether vLLM's processor cache holds an image's processed form, by the image's uuid
    (its SHA-256: server.engines.vllm.images); None where this vLLM has no such cache (or
    it is off: ``mm_processor_cache_gb=0``)."""
    cache = getattr(getattr(llm, "renderer", None), "_mm_processor_only_cache", None)
    held = getattr(cache, "is_cached_item", None)
    return held if callable(held) else None


# -- the engine core's outputs (multiprocess client) ------------------------------------------


def outputs_queue(llm) -> queue.Queue | None:
    """The multiprocess client's queue of the engine core's outputs (None: the core runs
    in this process, or this vLLM has none)."""
    return getattr(getattr(llm, "engine_core", None), "outputs_queue", None)


def shut_down(llm) -> None:
    """Stop vLLM's engine core and the processes it started (``LLMEngine`` has no public
    shutdown of its own)."""
    core = getattr(llm, "engine_core", None)
    if core is not None:
        core.shutdown()


def core_alive(llm) -> bool:
    """False once vLLM's client saw its engine core process die (its ``ensure_alive``,
    fed by vLLM's monitor thread); True where this vLLM cannot say."""
    check = getattr(llm.engine_core, "ensure_alive", None)
    if check is None:
        return True
    try:
        check()
    except Exception:
        return False
    return True


class _AnnouncingQueue(queue.Queue):
    """vLLM's outputs queue, which also writes a byte to ``_wake_fd`` per item."""

    _wake_fd: int

    def _put(self, item) -> None:
        super()._put(item)
        try:
            os.write(self._wake_fd, b"\0")
        except OSError:  # full (a wakeup is pending anyway), or closed at shutdown
            pass


def announce_outputs(llm, wake_fd: int) -> queue.Queue:
    """Make the client's outputs queue write a byte to ``wake_fd`` per output (its class
    swapped); returns the queue. RuntimeError where this vLLM has no such queue."""
    outputs = outputs_queue(llm)
    if type(outputs) is not queue.Queue or not callable(getattr(llm.engine_core, "ensure_alive",
                                                                 None)):
        raise RuntimeError(
            f"this vLLM's multiprocess client ({type(llm.engine_core).__name__}) has no "
            "outputs_queue to wait on: use --engine-core worker")
    outputs._wake_fd = wake_fd  # type: ignore[attr-defined]
    outputs.__class__ = _AnnouncingQueue
    return outputs


def stop_announcing(outputs: queue.Queue) -> None:
    """Undo :func:`announce_outputs`."""
    outputs.__class__ = queue.Queue
    outputs._wake_fd = -1  # type: ignore[attr-defined]


# -- the engine core's process, tied to its worker --------------------------------------------

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


def engine_core_class() -> type | None:
    """vLLM's ``EngineCoreProc`` (None where this vLLM has no such class)."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return None
    return EngineCoreProc


@contextmanager
def tied_to_this_process() -> Iterator[None]:
    """While inside, an engine core process that vLLM starts gets SIGKILL from the kernel
    when this process dies (docs/vllm.md). Only from the main thread: the kernel sends a
    parent-death signal when the *thread* that forked ends, and the main thread lasts as
    long as the process; from another thread nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with tying(engine_core_class()):
        yield


@contextmanager
def tying(cls: type | None) -> Iterator[None]:
    """While inside, ``cls.run_engine_core`` (vLLM's ``EngineCoreProc``: the target of the
    engine core's process, forked or spawned) first asks the kernel for SIGKILL when its
    parent dies (``prctl(PR_SET_PDEATHSIG)``, which survives a spawn's exec). Where ``cls``
    has no such static method, its own or inherited, nothing is changed and one line on
    stderr says so: the engine still starts, but its core may outlive a SIGKILLed worker.

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
    shutdown in a process that exits next, where they only give memory back to a process
    about to end (about 2 s of CPU for a tiny model; measured in docs/vllm.md). The
    rest of vLLM's shutdown runs in its order; the functions are restored after."""
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect = lambda generation=2: 0  # type: ignore[assignment]
    gc.unfreeze = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze


# -- grammar threads ----------------------------------------------------------------------------


def replace_grammar_pool(llm, initializer: Callable[..., object], initargs: tuple) -> bool:
    """Replace the thread pool in which vLLM's engine core (in this process) compiles
    grammars by one of as many threads that run ``initializer(*initargs)`` first. Returns
    whether it was (not with the core in a process of its own)."""
    core = getattr(getattr(llm, "engine_core", None), "engine_core", None)
    manager = getattr(core, "structured_output_manager", None)
    old = getattr(manager, "executor", None)
    if not isinstance(old, ThreadPoolExecutor):
        return False
    manager.executor = ThreadPoolExecutor(  # type: ignore[union-attr]
        max_workers=old._max_workers, thread_name_prefix="grammar",
        initializer=initializer, initargs=initargs)
    old.shutdown(wait=False)
    return True


# -- the detokenizer of a resumed request -------------------------------------------------------


def detokenizer_class():
    """vLLM's incremental detokenizer class, or None where this vLLM has no such class
    (then the engine does not resume)."""
    try:
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    except ImportError:
        return None
    return IncrementalDetokenizer if hasattr(IncrementalDetokenizer, "from_new_request") else None


def new_detokenizer(tokenizer, prompt_ids: list[int], sampling):
    """vLLM's incremental detokenizer for a request of ``prompt_ids`` and ``sampling``
    (its ``SamplingParams``), as vLLM's output processor builds it: from the four fields
    it reads of an ``EngineCoreRequest``, which has no public constructor."""
    cls = detokenizer_class()
    assert cls is not None
    request = SimpleNamespace(request_id="resume", prompt_token_ids=list(prompt_ids),
                              prompt_embeds=None, sampling_params=sampling)
    return cls.from_new_request(tokenizer, request)


# -- torch's threads on vLLM's CPU build --------------------------------------------------------


#: vLLM's mark on an OMP_NUM_THREADS it chose itself (vllm.utils.torch_utils).
OMP_SET_BY_VLLM = "VLLM_OMP_NUM_THREADS_SET_BY_VLLM"


def omp_cpu_bound(vllm_config) -> int | None:
    """The cores vLLM's CPU build binds its model's first rank to (its own computation:
    ``OMPProcessManager``), None with ``nobind`` or where it cannot say."""
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        manager = OMPProcessManager(vllm_config)
        return len(manager.cpu_lists[0]) if not manager.skip_setup else None
    except Exception:  # another vLLM version, an odd topology: as vLLM would, leave it
        return None


def set_torch_threads(count: int) -> None:
    """Torch's intra-op threads in this process (torch's own setter: vLLM's CPU worker
    replaced ``torch.set_num_threads`` by a no-op)."""
    import torch

    torch._C.set_num_threads(count)
