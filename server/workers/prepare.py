"""The preparation stage of a worker: a request's slow setup off the engine loop.

Tokenizing a prompt (megabytes of text), rendering a chat template and compiling a grammar
(a ``response_format`` schema, or a forced tool call) can take seconds. Done inside the
worker's loop, they would stop every other stream on the worker for that long, and past
the frontend's heartbeat timeout the worker would be declared hung and killed. So an engine
that can splits its ``add`` in two (see :mod:`server.workers.base`)::

    prepare(prompt, params) -> prepared     any thread; touches no engine state
    add_prepared(rid, prepared) -> int      the loop's thread; quick (prompt_tokens)

Theory of operation
-------------------
A :class:`Preparer` owns a small pool of threads. ``submit`` hands ``engine.prepare`` to
the pool and remembers the request as *preparing*; it holds no batch slot. A finished
preparation appends itself to a deque and writes one byte to a self-pipe, whose read end
the loop watches with its selector next to its input, so the loop wakes at once (its other
deadline, the engine's, is unchanged). The loop then calls :meth:`Preparer.collect`, which
admits each prepared request with ``engine.add_prepared`` (its accept goes out in the
loop's next STEP frame) or turns its :class:`~server.workers.base.Rejected` into the usual
error output. ``/tokenize`` requests (CALL) run in the same pool; their RESULT
replies come from ``collect`` too.

An ABORT of a request still preparing is answered at once (it is forgotten; the pool's
late result finds it gone and is dropped), so every request is answered exactly once. A
resubmitted id is told apart by its future. The tokenizers' encode and xgrammar's compile
release the GIL, so the loop keeps stepping while they run; pure-Python work (a chat
template) shares the GIL in 5 ms slices. The pool's size bounds the memory and CPU that
preparation can take; what waits for a thread waits in the pool's queue.
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import sys
import threading
from concurrent.futures import CancelledError, Future

from ..worker_protocol import wire
from ..worker_protocol.wire import AcceptRow, OutputRow
from .base import Rejected

__all__ = ["DaemonPool", "Preparer", "PREPARE_THREADS", "admit", "tokenize_reply"]

#: Threads preparing requests in a worker: a few, so that one huge prompt does not stall
#: the others, and few, so that a flood of them cannot take the machine from the model.
PREPARE_THREADS = 4


class DaemonPool:
    """A fixed pool of daemon threads running submitted calls, each with a Future.

    Not ``concurrent.futures.ThreadPoolExecutor``: the interpreter joins its threads at
    exit, so a worker told to stop would wait for a grammar that takes a minute to compile
    (work that cannot be interrupted). A worker's process ends with its loop; these threads
    end with it."""

    def __init__(self, threads: int, name: str, nice: int = 0) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._nice = nice
        for i in range(threads):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()
        self._threads = threads

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Queued calls are cancelled; running ones are not waited for."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._threads):
            self._queue.put(None)

    def _run(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # the future carries it to whoever waits
                future.set_exception(exc)
            else:
                future.set_result(result)


def lower_priority(nice: int) -> bool:
    """Add ``nice`` to the calling thread's nice value (Linux, where it is a thread's own;
    elsewhere nothing: True when done). The kernel then gives this thread's CPU time to
    the others of the process first when a core is contended; it cannot be undone without
    privileges, so only threads made for it call this.

    Not used by the worker (``Preparer``'s ``nice`` is 0): a niced thread that holds the
    GIL while other processes saturate the core is scheduled rarely, and the loop waits
    for the GIL that long (measured: a worker declared hung; docs/changelog.md, 2026-12-01,
    "Why the transformers rows miss the target"). ``bench/step_contention.py --prepare-nice`` measures it."""
    if sys.platform != "linux" or nice <= 0:
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # a sandbox that forbids it: run at the same priority
        return False
    return True


def admit(rid: int, add, accepts: list, outputs: list, params: dict | None = None) -> None:
    """Run ``add()`` (an engine's add for ``rid``, whose SUBMIT had ``params``): its
    prompt_tokens become an accept, a :class:`Rejected` or any other failure an error
    output for ``rid`` alone (naming the field at fault when the params ask)."""
    try:
        accepts.append(AcceptRow(rid, add()))
    except Rejected as exc:
        outputs.append(OutputRow(rid, "", 0, "error", exc.err(params)))
    except Exception as exc:  # a request the engine chokes on fails alone
        message = f"the engine could not take this request: {exc!r:.200}"
        outputs.append(OutputRow(rid, "", 0, "error", ["engine_error", message]))


def tokenize_reply(seq, tokenize, request: dict) -> list:
    """The RESULT message answering CALL ``seq`` with ``tokenize(request)``; a
    result with a list of more than :data:`wire.SLICE` items (token ids, or their strings)
    comes packed already (:func:`wire.pack_sliced`: in the preparation thread, a slice at a
    time)."""
    try:
        result = tokenize(request)
        if type(result) is wire.Packed:  # from the helper process, packed there
            return [wire.RESULT, seq, result, None]
        if type(result) is dict and any(type(value) is list and len(value) > wire.SLICE
                                        for value in result.values()):
            # (long ids as a list, or long token_strs beside ids packed as an array)
            return [wire.RESULT, seq, wire.pack_sliced(result), None]
        return [wire.RESULT, seq, result, None]
    except Rejected as exc:
        return [wire.RESULT, seq, None, exc.err(request)]
    except Exception as exc:
        message = f"the engine could not tokenize: {exc!r:.200}"
        return [wire.RESULT, seq, None, ["engine_error", message]]


class Preparer:
    """The preparation stage of one engine (see the module docstring). Made by the loop
    for an engine that has ``prepare``; :meth:`close` when the loop ends."""

    def __init__(self, engine, threads: int = PREPARE_THREADS, nice: int = 0) -> None:
        self.engine = engine
        start = getattr(engine, "start_helper", None)
        if start is not None:  # its helper process, for the heaviest preparations
            start()
        self._pool = DaemonPool(threads, "prepare", nice)
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()  # no wake-up write once close() closed the pipe
        self._closed = False
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: finished work, appended by the pool's threads: ("submit" | "tokenize", id,
        #: future, the SUBMIT's params or the CALL request)
        self._done: collections.deque[tuple[str, int, Future, dict]] = collections.deque()
        #: requests being prepared: rid -> their future
        self._preparing: dict[int, Future] = {}
        self._prepared_total = 0
        self._aborted_total = 0
        self._dropped_total = 0

    def fileno(self) -> int:
        """Readable when a preparation has finished: register it with the loop's selector."""
        return self._wake_r

    def preparing(self) -> int:
        """Requests being prepared (they count as waiting)."""
        return len(self._preparing)

    def statistics(self) -> dict:
        """Requests preparing now; prepared (admitted or refused); aborted while preparing;
        of those, the ones whose preparation has ended (cancelled before it ran, or its
        late result dropped)."""
        return {"preparing": len(self._preparing), "prepared_total": self._prepared_total,
                "aborted_total": self._aborted_total, "dropped_total": self._dropped_total}

    def submit(self, rid: int, prompt: object, params: dict) -> None:
        """Prepare request ``rid`` in the pool; :meth:`collect` admits it."""
        future = self._pool.submit(self.engine.prepare, prompt, params)
        self._preparing[rid] = future
        future.add_done_callback(lambda f: self._finished("submit", rid, f, params))

    def tokenize(self, seq, request: dict) -> None:
        """Answer CALL ``seq`` in the pool; :meth:`collect` returns its reply."""
        future = self._pool.submit(tokenize_reply, seq, self.engine.tokenize, request)
        future.add_done_callback(lambda f: self._finished("tokenize", seq, f, request))

    def abort(self, rid: int) -> bool:
        """Forget ``rid`` if it is being prepared (True); its result will be dropped."""
        future = self._preparing.pop(rid, None)
        if future is None:
            return False
        if future.cancel():  # not started yet: it never runs
            self._dropped_total += 1
        self._aborted_total += 1
        return True

    def collect(self, accepts: list, outputs: list) -> list:
        """Admit every request prepared since the last call (accepts and error outputs
        go to ``accepts`` and ``outputs``); returns the RESULT replies to send."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        replies = []
        done = self._done
        while done:
            kind, key, future, params = done.popleft()
            if kind == "tokenize":
                replies.append(_result(future, key))
            elif self._preparing.get(key) is future:  # not aborted (nor replaced) meanwhile
                del self._preparing[key]
                self._prepared_total += 1
                admit(key, functools.partial(_add_prepared, self.engine, key, future),
                      accepts, outputs, params)
            else:  # aborted while preparing: answered then
                self._dropped_total += 1
        return replies

    def close(self) -> None:
        """Stop the pool: queued work is dropped; running work is not waited for. The
        engine's helper process (if any) is killed."""
        self._pool.shutdown()
        stop = getattr(self.engine, "stop_helper", None)
        if stop is not None:
            stop()
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _finished(self, kind: str, key, future: Future, request: dict) -> None:
        """In a pool thread (or the loop's, for a cancelled future): queue it, wake the loop."""
        if future.cancelled():
            return
        self._done.append((kind, key, future, request))
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                pass


def _add_prepared(engine, rid: int, future: Future) -> int:
    """Admit ``rid`` with its preparation's result (which raises the preparation's error)."""
    return engine.add_prepared(rid, future.result())


def _result(future: Future, seq) -> list:
    try:
        return future.result()
    except CancelledError:  # pragma: no cover - a cancelled future is never queued
        raise
    except Exception as exc:  # tokenize_reply catches the engine's; this is the pool's
        return [wire.RESULT, seq, None, ["engine_error", f"cannot tokenize: {exc!r:.200}"]]
