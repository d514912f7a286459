"""The engine worker process: a plain blocking loop around one engine. No trio here.

Started by the frontend as ``python -m server.workers '<json config>'``. The protocol runs on
the pipes the process was given as stdin and stdout; at startup they are moved to private
file descriptors and fds 0/1 are pointed at /dev/null and stderr, so a stray ``print`` in an
engine library cannot corrupt a frame.

Theory of operation
-------------------
One thread, one loop::

    wait for pipe input, a finished preparation or the engine's wakeup_fd, at most until
        engine.next_deadline()
    handle every complete message (submit, abort, ping, tokenize, shutdown)
    admit the requests prepared meanwhile (server.workers.prepare)
    write the replies; of the big answers (a /tokenize of millions of ids), a few PART
        frames (server.worker_protocol.parts; the wait is 0 while parts are left)
    if the deadline has passed: outputs += engine.step(now)
    write one STEP frame with every accept and output gathered in this iteration

Pings are answered between steps; while one step, or a CALL answered on the loop,
runs long, a thread beside the loop (:mod:`server.workers.pulse`) sends unasked PONGs, so
that a worker making progress is not taken for hung.

A request's slow setup (tokenizing, a chat template, a grammar) runs in a few threads of
:mod:`server.workers.prepare` for an engine that splits its ``add``: the loop never waits
for it.

End of input (the frontend closed the pipe or died) ends the worker: a worker never outlives
its frontend. SIGINT is ignored (a Ctrl-C in the terminal reaches the whole process group;
the frontend decides how its workers stop); SIGTERM ends it, after the engine's cleanup.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from ..worker_protocol import wire
from ..worker_protocol.parts import PartQueue
from ..worker_protocol.wire import OutputRow
from .base import (
    EngineBroken, Rejected, WorkerCrash, WorkerGarbage, WorkerHang, one_line, refuse_fault,
)
from .embed import embed_request
from .lora import LORA_OPS, lora_request
from .prepare import Preparer, admit, tokenize_reply
from .pulse import Pulse

__all__ = ["build_engine", "close_before_exit", "exit_without_teardown", "freeze_startup_heap",
           "handle_message", "main", "open_preparer", "run_as_worker", "serve", "step_message"]


def build_engine(config: dict):
    """The engine named by ``config["engine"]``, built with ``config["options"]``."""
    kind = config.get("engine", "sim")
    options = dict(config.get("options") or {})
    if kind == "sim":
        from ..engines.sim.engine import SimEngine

        return SimEngine(**options)
    if kind == "transformers":
        from ..engines.transformers.embed import TransformersEmbedder, is_embedding_model

        if is_embedding_model(options.get("model_path") or ""):
            return TransformersEmbedder(**options)
        from ..engines.transformers.engine import TransformersEngine

        return TransformersEngine(**options)
    if kind == "vllm":
        from ..engines.vllm.engine import VLLMEngine

        return VLLMEngine(**options)
    raise SystemExit(f"unknown engine {kind!r}")


def freeze_startup_heap(engine) -> None:
    """After the engine's start (its warm-up included), before HELLO: collect, then move
    every object alive (the libraries, the model, what the warm-up set up) out of the
    collector's sight (:func:`gc.freeze`). Otherwise each full collection while serving
    walks them all: 41-81 ms pauses of the step loop in the vllm worker, every stream held.
    Only a worker process's entry points call this (its process is this server's own);
    ``engine.info["gc_frozen"]`` says how many objects it froze. What is frozen is never
    collected: an object of it that later becomes cyclic garbage (say, of an adapter loaded
    at startup and unloaded) stays, which is the price of not walking them all."""
    gc.collect()
    gc.freeze()
    engine.info["gc_frozen"] = gc.get_freeze_count()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def handle_message(engine, msg: list, accepts: list, outputs: list,
                   preparer: Preparer | None = None) -> list | None:
    """Apply one message from the frontend (not SHUTDOWN: the loop ends on that) to
    ``engine``. A SUBMIT adds its accept to ``accepts`` (or, refused, an error output to
    ``outputs``); an ABORT of a request the engine still had adds its abort output. Returns
    the reply to send at once (the PONG of a PING; the RESULT of a CALL), else None.
    With a ``preparer`` (:mod:`server.workers.prepare`), a SUBMIT and a CALL are
    prepared in its threads instead: their accept, error or reply comes from its
    ``collect``. Plain and sans-IO: the test suite's in-memory workers (tests/fakes.py) run
    it too."""
    kind = msg[0]
    if kind == wire.SUBMIT:
        rid, prompt, params = msg[1], msg[2], msg[3]
        if params.get("fault") is not None:  # (the sim's test hook: refused elsewhere)
            try:
                refuse_fault(engine, params["fault"])
            except Rejected as exc:
                outputs.append(OutputRow(rid, "", 0, "error", exc.err(params)))
                return None
        if len(msg) > 4:  # a LoRA adapter: the engine's, or this request's 404
            if not engine.info.get("lora"):
                outputs.append(OutputRow(rid, "", 0, "error", wire.error(
                    "model_not_found", f"The model '{msg[4]:.256}' does not exist.", "model",
                    params)))
                return None
            params = {**params, "lora": msg[4]}
        if preparer is not None:
            preparer.submit(rid, prompt, params)
        else:
            admit(rid, lambda: engine.add(rid, prompt, params), accepts, outputs, params)
    elif kind == wire.ABORT:
        if (preparer is not None and preparer.abort(msg[1])) or engine.abort(msg[1]):
            outputs.append(OutputRow(msg[1], "", 0, "abort", None))
    elif kind == wire.PING:
        preparing = preparer.preparing() if preparer is not None else 0
        pong = [wire.PONG, msg[1], engine.running(), engine.waiting() + preparing]
        engine_stats = getattr(engine, "engine_stats", None)
        stats = engine_stats() if engine_stats is not None else None
        if stats:  # the engine's own statistics (wire.ENGINE_STATS), last
            pong.append(stats)
        return pong
    elif kind == wire.CALL:
        request = msg[2]
        if isinstance(request, dict) and request.get("op") == "embed":
            return [wire.RESULT, msg[1], *embed_request(engine, request)]
        if isinstance(request, dict) and _is_lora_op(request.get("op")):  # between steps
            return [wire.RESULT, msg[1], *lora_request(engine, request)]
        tokenize = getattr(engine, "tokenize", None)
        if tokenize is None:
            name = engine.info.get("engine", "this")
            message = (f"Tokenizing is not supported by the {name} engine: it has no tokenizer "
                       "(/tokenize, /detokenize, /tokenizer_info and echo of token-id prompts "
                       "need one); the transformers and vllm engines have one")
            return [wire.RESULT, msg[1], None, ["invalid_request", message]]
        if preparer is not None:
            preparer.tokenize(msg[1], request)
            return None
        return tokenize_reply(msg[1], tokenize, request)
    return None


def open_preparer(engine) -> Preparer | None:
    """The preparation stage for ``engine``, if it splits its add (``prepare`` and
    ``add_prepared``); None for an engine whose add is quick (sim)."""
    if hasattr(engine, "prepare") and hasattr(engine, "add_prepared"):
        return Preparer(engine)
    return None


def step_message(engine, accepts: list, outputs: list) -> list:
    """The STEP message of one loop iteration: ``[STEP, accepts, outputs]``, plus the
    engine's notes (``[rid, dict]`` rows, such as a request's cached prompt tokens) as a
    fourth item when it has any. Takes the notes (the engine's list is emptied)."""
    notes = getattr(engine, "notes", None)
    if notes:
        message = [wire.STEP, accepts, outputs, list(notes)]
        notes.clear()
        return message
    return [wire.STEP, accepts, outputs]


#: How long a LoRA adapter's load (or unload) may wait without computing, on a slow disk or
#: on vLLM's engine core process, while the pulse speaks for the worker; a load blocked for
#: longer is taken for hung (server.workers.pulse).
LORA_WAIT = 60.0


def _is_lora_op(op: object) -> bool:
    """Whether a CALL request's ``op`` loads or unloads an adapter (any value may
    arrive: an unhashable one is simply not one)."""
    return type(op) is str and op in LORA_OPS


def handle_in_pulse(pulse: Pulse, engine, msg: list, accepts: list, outputs: list,
                    preparer: Preparer | None):
    """:func:`handle_message`, with the pulse speaking for the loop while a CALL is
    answered on it. An embedding's forward pass (up to the engine's padded-token bound), a
    LoRA adapter's load, or a tokenize without a preparer computes as long as a step may,
    and a worker computing is not hung. A LoRA load may also wait without computing, for
    up to :data:`LORA_WAIT` (its disk; vLLM's engine core process, which loads it with
    ``--engine-core process``). (Nothing the pulse writes is touched here: the replies are
    written by the loop afterwards.)"""
    if msg[0] != wire.CALL:
        return handle_message(engine, msg, accepts, outputs, preparer)
    request = msg[2]
    lora = isinstance(request, dict) and _is_lora_op(request.get("op"))
    pulse.enter(LORA_WAIT if lora else 0.0)
    try:
        return handle_message(engine, msg, accepts, outputs, preparer)
    finally:
        pulse.leave()


#: What a pipe worker takes (wire.REQUESTS), each message handed on as its list.
_REQUESTS = wire.REQUESTS.as_lists()


def serve(engine, fd_in: int, fd_out: int, pulse_period: float = 1.0,
          parts: bool = False, image_stats: bool = False) -> None:
    """Run the loop until the input ends or a SHUTDOWN arrives. While one engine step runs
    longer than ``pulse_period`` seconds, a thread beside the loop writes an unasked PONG
    every ``pulse_period`` (:mod:`server.workers.pulse`). With ``parts`` (the frontend
    asked), a big RESULT goes out in PART frames between the loop's passes
    (:mod:`server.worker_protocol.parts`). Without ``image_stats`` (the frontend reads
    them), PONGs leave out the image-cache counters (``wire.pong_for``)."""
    preparer = open_preparer(engine)
    pong = [wire.encode([wire.PONG, 0, 0, 0])]  # the last answer's counts, unasked
    pulse = Pulse(lambda: _write_all(fd_out, pong[0]), pulse_period)
    pulse.start()
    try:
        with cleanup_uncut():
            _serve(engine, preparer, fd_in, fd_out, pulse, pong, parts, image_stats)
    finally:
        pulse.close()
        if preparer is not None:
            preparer.close()


def _serve(engine, preparer: Preparer | None, fd_in: int, fd_out: int, pulse: Pulse,
           pong: list[bytes], parts: bool = False, image_stats: bool = False) -> None:
    clock = time.monotonic
    # Big answers, written a few parts per pass (None: whole frames, as they come).
    queue = PartQueue(lambda frame: _write_all(fd_out, frame)) if parts else None
    decoder = wire.FrameDecoder(_REQUESTS)  # a malformed message ends the loop
    # select(2) takes a timeout in microseconds, epoll in whole milliseconds (rounded up): a
    # sim engine's first token would be up to 1 ms late. Two descriptors: select is as cheap.
    fds = [fd_in] if preparer is None else [fd_in, preparer.fileno()]
    wakeup = getattr(engine, "wakeup_fd", None)  # (an engine whose work runs elsewhere)
    engine_fd = wakeup() if wakeup is not None else None
    if engine_fd is not None:
        fds.append(engine_fd)
    small = max(fds) < 1024
    selector = selectors.SelectSelector() if small else selectors.DefaultSelector()
    for fd in fds:
        selector.register(fd, selectors.EVENT_READ)
    _write_all(fd_out, wire.encode([wire.HELLO, wire.hello_info(engine.info)]))
    accepts: list = []
    outputs: list = []
    while True:
        deadline = engine.next_deadline()
        if deadline is None:
            timeout = None
        else:
            timeout = deadline - clock()
            if timeout < 0:
                timeout = 0
        if queue is not None and queue.pending():
            timeout = 0  # (the parts' writes are what waits: for the frontend to read)
        replies: list[bytes] = []
        for key, _ in selector.select(timeout):
            if key.fd != fd_in:
                continue
            data = os.read(fd_in, 1 << 20)
            if not data:
                return
            for msg in decoder.feed(data):
                if msg[0] == wire.SHUTDOWN:  # the answers already made go first
                    if queue is not None:
                        queue.flush()
                    if replies:
                        _write_all(fd_out, b"".join(replies))
                    return
                reply = handle_in_pulse(pulse, engine, msg, accepts, outputs, preparer)
                if reply is not None:
                    if reply[0] == wire.PONG:  # what the pulse repeats, unasked
                        reply = wire.pong_for(reply, image_stats)
                        pong[0] = wire.encode([wire.PONG, 0, *reply[2:]])
                    replies.append(wire.encode(reply))
        if preparer is not None:  # requests prepared meanwhile join the engine now
            replies.extend(wire.encode(r) for r in preparer.collect(accepts, outputs))
        if queue is not None:
            replies = queue.take_big(replies)
        if replies:
            _write_all(fd_out, b"".join(replies))
        if queue is not None:
            queue.write_some()
        deadline = engine.next_deadline()
        if deadline is not None and clock() >= deadline:
            broken = None
            pulse.enter()  # (the pulse speaks for the loop while this step runs long)
            try:
                outputs.extend(engine.step(clock()))
            except EngineBroken as exc:  # its requests end with errors; then this worker
                broken = exc
            finally:
                pulse.leave()
            if broken is not None:
                outputs.extend(broken.outputs)
                if queue is not None:  # (the pipe still works: answers that are ready go)
                    queue.flush()
                _write_all(fd_out, wire.encode(step_message(engine, accepts, outputs)))
                raise broken
        if accepts or outputs or getattr(engine, "notes", None):  # (notes: KV events)
            _write_all(fd_out, wire.encode(step_message(engine, accepts, outputs)))
            accepts = []
            outputs = []


class _Terminated(BaseException):
    """SIGTERM arrived: unwind (running the engine's cleanup), then die of the signal."""


#: Set once a _Terminated has left a worker loop (:func:`cleanup_uncut`): the engine's
#: cleanup runs now, and a repeated SIGTERM must not cut it short.
_unwinding = False


def terminate(signum, frame) -> None:
    """SIGTERM's handler in a worker: unwind, unless the cleanup runs already."""
    # A repeat while the cleanup runs (a supervisor signalling the whole group, then the
    # frontend) is ignored; before that, every SIGTERM raises: one raised inside a
    # finalizer is swallowed ("Exception ignored"), and the next must try again. The
    # unwind ends in SIGTERM's default action (run_as_worker); SIGKILL ends a cleanup that
    # hangs.
    if not _unwinding:
        raise _Terminated


@contextmanager
def cleanup_uncut() -> Iterator[None]:
    """Around a worker loop: once SIGTERM's _Terminated goes by, repeats are ignored, so
    the cleanup outside (the engine's, the connections') runs uncut."""
    global _unwinding
    try:
        yield
    except _Terminated:
        _unwinding = True
        raise


def cleanup_begins() -> None:
    """A worker loop ended normally (a listening worker's completed leave): SIGTERM is
    ignored from now on, so the cleanup after it (the engine's: seconds for vLLM) runs
    uncut. A supervisor that signals the whole group sends one then."""
    global _unwinding
    _unwinding = True


def close_before_exit(engine) -> None:
    """The engine's cleanup in a worker whose process exits next: its ``close_before_exit``
    where it has one (which may skip what only frees this process's memory: the vllm
    engine's), else its ``close``, if any."""
    close = getattr(engine, "close_before_exit", None) or getattr(engine, "close", None)
    if close is not None:
        close()


def main(argv: list[str] | None = None) -> None:
    run_as_worker(_main, sys.argv[1:] if argv is None else argv)


def run_as_worker(body, argv: list[str]) -> None:
    """``body(argv)`` with a worker's signals: SIGINT ignored (the frontend decides how its
    workers stop), SIGTERM unwinds first, so that an engine that started processes of its
    own (vLLM's tensor-parallel workers) stops them; then the process dies of the signal.
    A body that returns or raises ``SystemExit`` (its cleanup done) ends the process at
    once (:func:`exit_without_teardown`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, terminate)
    try:
        body(argv)
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    except SystemExit as exc:
        exit_without_teardown(exc.code)
    exit_without_teardown(0)


def exit_without_teardown(code: int | str | None) -> NoReturn:
    """End this worker process with ``code`` (as ``SystemExit(code)`` would) as the
    interpreter's exit does (non-daemon threads joined, ``atexit`` handlers run, Python's
    and C's buffered output flushed), but without the interpreter's teardown after that.

    Why: that teardown frees every object of a process about to end, and in a vllm worker
    it outlasted the frontend's ``shutdown_grace``, which then SIGTERMed the worker
    (measured in docs/vllm.md). This worker's own cleanup is done by then, in its
    ``finally`` blocks; a SIGTERM from here on can only cut a library's ``atexit`` handler
    short."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if code is None:
        code = 0
    elif not isinstance(code, int):  # (SystemExit("message"): the message, then 1)
        print(code, file=sys.stderr)
        code = 1
    # What the interpreter's exit does first, by its own function: it tells the threads of
    # a ThreadPoolExecutor nobody shut down to end (a library's), then joins every
    # non-daemon thread; a plain join of those would wait for ever.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:  # (None: started with that descriptor closed)
                stream.flush()
        except (OSError, ValueError):  # (closed, or its reader gone: nothing to keep)
            pass
    ctypes.CDLL(None).fflush(None)  # C's stdio buffers (a library's printf)
    os._exit(code & 0xFF)  # (the status an exit(code) leaves)


def _main(argv: list[str]) -> None:
    fd_in = os.dup(0)
    fd_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    config = json.loads(argv[0]) if argv else {}
    if config.get("visible_devices") is not None:  # --devices-per-worker: before any import
        os.environ["CUDA_VISIBLE_DEVICES"] = config["visible_devices"]
    try:
        engine = build_engine(config)
    except Exception as exc:  # a clear line for the operator, not a traceback
        print(f"trio-llm-server worker: cannot start engine: {one_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    freeze_startup_heap(engine)
    try:
        serve(engine, fd_in, fd_out, float(config.get("pulse", 1.0)),
              parts=config.get("parts") is True, image_stats=config.get("image_stats") is True)
    except EngineBroken as exc:
        print(f"trio-llm-server worker: engine failed, restarting: {exc.message}", file=sys.stderr)
        raise SystemExit(3) from None
    except WorkerCrash:
        os._exit(17)
    except WorkerHang:
        while True:
            time.sleep(3600)
    except WorkerGarbage:
        _write_all(fd_out, b"\xff\xff\xff\xffthis is not a frame")
        while True:
            time.sleep(3600)
    except BrokenPipeError:
        raise SystemExit(1) from None
    except wire.ProtocolError as exc:  # the frontend is broken: so is this pipe
        print(f"trio-llm-server worker: protocol violation by the frontend, exiting: {exc}",
              file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        close_before_exit(engine)
