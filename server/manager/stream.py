"""Per-request state and the consumer's stream: the hot path of the frontend.

Theory of operation
-------------------
A request has one :class:`Choice` per sub-request on the engine (``n`` samples of each
prompt), all sharing one :class:`Waker`. A choice is registered in its worker's table *when
the request is dispatched*, before the consumer first looks, so a sub-request that finishes
at once still delivers everything: its state lives as long as the stream that holds it,
whether or not the worker's table still names it.

The worker's router task (one per worker, not per request) calls :meth:`Choice.push` for
each output of an engine step. ``push`` merges the new text into the choice's pending slot
(so a slow consumer costs one growing string per choice, never a queue), marks the choice
ready if it was not, and wakes the consumer if it is parked. That is at most one wakeup per
request per engine step, with no task, lock or cancel scope per chunk.

The consumer (:class:`RequestStream`, used with ``async for``) takes one merged
:class:`~server.outputs.RequestOutput` per ready choice. When nothing is ready it parks with
``wait_task_rescheduled``; cancellation of the consumer's scope is delivered right into that
wait. Cancellation is the monitor: no task watches for it.

Cleanup (:meth:`RequestStream.aclose`, also run when the ``async for`` is cancelled or the
``async with`` exits) sends exactly one abort per unfinished choice, then waits, shielded and
bounded by the drain deadline, for the worker to confirm. A worker that does not confirm in
time is cut off: its table forgets the choice, and its late output is dropped.

End of stream is a value: a choice's last output has ``finish_reason`` set, and the stream
ends (``StopAsyncIteration``) when every choice has delivered its last output. Nothing here
stores an exception, and nothing refers back to the stream, so a finished request is freed by
reference counting alone.

One consumer at a time, as with Trio's own streams: a second task that waits on a stream
while another is waiting raises ``trio.BusyResourceError`` (the waker has one slot).
:meth:`RequestStream.aclose` from another task evicts a parked consumer from that slot with
``trio.ClosedResourceError`` before it parks there itself, and a second ``aclose`` meanwhile
waits for the first.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import outcome
import trio

from ..errors import ServerError
from ..outputs import RequestOutput
from ..worker_protocol import wire
from .deadlines import QUEUE_TIMEOUT, queue_timeout_error

if TYPE_CHECKING:
    from .pacing import Pacer
    from .worker import WorkerClient

__all__ = ["Choice", "RequestStream", "Waker"]

log = logging.getLogger("server.stream")

_Abort = trio.lowlevel.Abort
_current_task = trio.lowlevel.current_task
_reschedule = trio.lowlevel.reschedule
_wait_task_rescheduled = trio.lowlevel.wait_task_rescheduled
_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
_current_time = trio.current_time
_perf_counter = time.perf_counter


class Waker:
    """The consumer side shared by a request's choices: who is parked, and who has news.

    Pacing: with a stream interval, news that is not terminal wakes the consumer at most
    once per interval; *when* is its worker's :class:`~server.manager.pacing.Pacer`'s
    decision (this asks it to defer the wakeup, or to make it soon).
    """

    __slots__ = (
        "task", "ready", "closed", "pacer", "interval", "not_before", "deferred", "sink"
    )

    def __init__(self, pacer: Pacer) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.ready: deque[Choice] = deque()
        self.closed = False  # the stream was released: late output is not queued
        self.pacer = pacer
        self.interval = pacer.interval  # read on every notify: one attribute lookup less
        self.not_before = 0.0  # trio time before which news is deferred (when pacing)
        self.deferred = False  # in a worker's deferred list
        #: The consumer's direct writer of plain text (see :meth:`RequestStream.set_sink`).
        self.sink: Callable[[Choice], bool] | None = None

    def wake(self) -> None:
        task = self.task
        if task is not None:
            self.task = None
            _reschedule(task)

    def notify(self) -> None:
        """Wake the consumer for news, unless pacing says to wait (then defer it)."""
        task = self.task
        if task is None:
            return
        if self.interval and self.not_before:  # paced, and it already had news
            pacer = self.pacer
            # frame_time: when the router read the frame being routed (one clock read per
            # frame rather than one per output)
            if pacer.frame_time < self.not_before:
                self.defer()
            else:
                pacer.wake_soon(self)
            return
        self.task = None
        _reschedule(task)

    def wake_paced(self) -> None:
        """A paced wakeup whose time has come (the pacer calls it): with a sink, the sink
        writes what is ready and the consumer sleeps on; else (or for an end, or what the
        sink did not take) the consumer is woken."""
        sink = self.sink
        if sink is not None and self.task is not None:
            ready = self.ready
            try:
                while ready:
                    choice = ready[0]
                    if choice.done or not (choice.text or choice.ntok) or not sink(choice):
                        break  # the consumer's: an end, or what the sink did not take (all)
                    ready.popleft()
                    choice.queued = False
                else:
                    self.not_before = _current_time() + self.interval
                    return
            except Exception:  # a sink must not raise; if one does, the router goes on
                self.sink = None
                log.exception("a stream's sink failed; its consumer takes over")
        self.wake()

    def defer(self) -> None:
        """Wait for ``not_before`` (once: a waker is deferred at most once at a time)."""
        if not self.deferred:
            self.deferred = True
            self.pacer.defer(self)

    def taken(self) -> None:
        """The consumer took its news: pace the next wake from now."""
        if self.interval:
            self.not_before = _current_time() + self.interval

    def _on_cancel(self, raise_cancel) -> _Abort:
        self.task = None
        return _Abort.SUCCEEDED

    async def park(self) -> None:
        """Sleep until the router has news (or the caller's scope is cancelled)."""
        self.task = _current_task()
        await _wait_task_rescheduled(self._on_cancel)


class Choice:
    """One sub-request on one worker: pending output, counters and its terminal state.

    Written by the worker's router (plain ``def`` methods that never block), read by the
    stream. ``rid`` is the id on the wire; ``index`` the OpenAI choice index.
    """

    __slots__ = (
        "rid",
        "index",
        "worker",
        "waker",
        "text",
        "ntok",
        "prompt_tokens",
        "completion_tokens",
        "accepted",
        "accepted_at",
        "done",
        "queued",
        "abort_sent",
        "finish_reason",
        "error_kind",
        "error",
        "error_param",
        "cached_tokens",
        "logprobs",
        "prompt_logprobs",
        "prompt",
        "params",
        "token_ids",
        "ids_taken",
        "prompt_ids",
        "text_chars",
        "migrations",
        "adapter",
        "batch",
    )

    def __init__(self, rid: int, index: int, worker: WorkerClient, waker: Waker,
                 prompt: object = None, params: dict | None = None,
                 adapter: str | None = None) -> None:
        self.rid = rid
        self.index = index
        #: The worker that holds it now (another one after a migration).
        self.worker = worker
        self.waker = waker
        #: The prompt and the request's wire params (to resume it elsewhere:
        #: server.manager.migration; its worker was sent them with a batch line's priority
        #: where it honours one: ``batch``), the ids of the tokens it produced (None: not
        #: asked for), the characters of text pushed, and how many times it moved.
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] | None = (
            [] if params is not None and params.get("token_ids") else None
        )
        #: For a request that asked for ids (``return_token_ids``: params'
        #: ``prompt_token_ids``), how many of ``token_ids`` went out, and the prompt's ids
        #: until they go out (with the first output); None: not asked.
        self.ids_taken: int | None = (
            0 if params is not None and params.get("prompt_token_ids") else None
        )
        self.prompt_ids: list[int] | None = None
        self.text_chars = 0
        self.migrations = 0
        #: The LoRA adapter it runs with (None: the base model), for a resubmission too.
        self.adapter = adapter
        #: A batch line's (server.manager.batch_priority): its priority is the frontend's.
        self.batch = False
        self.text = ""
        self.ntok = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.accepted = False
        #: When the router saw the engine accept it (``time.perf_counter()``), for metrics.
        self.accepted_at: float | None = None
        self.done = False  # the worker (or the cut-off) ended it
        self.queued = False  # in waker.ready
        self.abort_sent = False
        self.finish_reason: str | None = None
        self.error_kind: str | None = None
        self.error: str | None = None
        #: The client's field a worker's refusal named (a three-item ``err``), or None.
        self.error_param: str | None = None
        #: Prompt tokens the engine found in its prefix cache (None: it does not say).
        self.cached_tokens: int | None = None
        #: Logprob entries of the pending tokens (only for requests that asked), and of the
        #: prompt (``echo`` with logprobs): see RequestOutput.
        self.logprobs: list | None = None
        self.prompt_logprobs: list | None = None

    # -- router side -------------------------------------------------------------------------

    def accept(self, prompt_tokens: int) -> None:
        if not self.accepted:  # (a resumed request's prompt counts its tokens too)
            self.accepted = True
            self.accepted_at = _perf_counter()
            self.prompt_tokens = prompt_tokens
        self.waker.wake()

    def note(self, note: wire.Note) -> None:
        """Details the engine sent about this choice (before its outputs of that step)."""
        unset = wire.UNSET
        ids = note.token_ids
        if ids is not unset and self.token_ids is not None:
            self.token_ids += ids
        prompt_ids = note.prompt_token_ids
        if prompt_ids is not unset and self.ids_taken is not None and not self.migrations:
            self.prompt_ids = prompt_ids  # (a resumed one's prompt holds generated tokens)
        cached = note.cached_tokens
        if cached is not unset:
            # resumed: of a prompt that holds the tokens generated before; usage counts
            # the client's prompt
            self.cached_tokens = min(cached, self.prompt_tokens) if self.migrations else cached
        entries = note.logprobs
        if entries is not unset:
            if self.logprobs is None:
                self.logprobs = entries
            else:
                self.logprobs.extend(entries)
        if note.prompt_logprobs is not unset:
            self.prompt_logprobs = note.prompt_logprobs
        if note.times is not unset:  # the engine's own times of the finished request
            self.worker.report.finished(wire.as_dict(note.times))

    def push(self, text: str, ntok: int, finish: str | None, err: list | None) -> None:
        """Merge one engine step's output into the pending slot and wake the consumer."""
        if self.done:
            return
        if text:
            self.text += text
            self.text_chars += len(text)
        if ntok:
            self.ntok += ntok
            self.completion_tokens += ntok
        if finish is not None:
            self.done = True
            self.finish_reason = finish
            if err is not None:  # [kind, message] or [kind, message, param]
                self.error_kind, self.error = err[0], err[1]
                if len(err) > 2:
                    self.error_param = err[2]
        waker = self.waker
        if not self.queued and not waker.closed:
            # A consumer parked with nothing ready, that gave its stream a sink: the sink
            # writes the text now (to the client's socket), and the consumer sleeps on.
            # A token without text (a detokenizer holding part of a character back) too:
            # its event has empty text, as the consumer's would. Paced: only once its time
            # has come (else the text waits, merged, for it).
            sink = waker.sink
            if (
                sink is not None and finish is None and waker.task is not None
                and (self.text or self.ntok)
                and (not waker.interval or waker.pacer.frame_time >= waker.not_before)
            ):
                try:
                    if sink(self):
                        if waker.interval:
                            waker.not_before = waker.pacer.frame_time + waker.interval
                        return
                except Exception:  # a sink must not raise; if one does, the router goes on
                    waker.sink = None
                    log.exception("a stream's sink failed; its consumer takes over")
            self.queued = True
            waker.ready.append(self)
        if finish is None:
            waker.notify()
        else:
            waker.wake()

    def end(self, finish: str, kind: str | None = None, message: str | None = None) -> None:
        """End the choice from the frontend side (worker died, or cut off after an abort)."""
        self.push("", 0, finish, None if kind is None else [kind, message])

    # -- consumer side -----------------------------------------------------------------------

    def take(self) -> RequestOutput:
        out = RequestOutput(
            self.index,
            self.text,
            self.ntok,
            self.prompt_tokens,
            self.completion_tokens,
            self.finish_reason,
            self.error_kind,
            self.error,
            self.cached_tokens,
            self.error_param,
        )
        if self.logprobs is not None or self.prompt_logprobs is not None:
            out.logprobs, self.logprobs = self.logprobs, None
            out.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        taken = self.ids_taken
        if taken is not None and self.token_ids is not None:  # (only requests that asked)
            out.token_ids = self.token_ids[taken:]
            self.ids_taken = len(self.token_ids)
            out.prompt_token_ids, self.prompt_ids = self.prompt_ids, None
        self.text = ""
        self.ntok = 0
        self.queued = False
        return out


def _error_of(out: RequestOutput) -> ServerError:
    """The exception of an error output (which always carries its kind)."""
    exc = out.exception()
    assert exc is not None
    return exc


class RequestStream:
    """The outputs of one request, in the order they arrive, one merged output per choice.

    Iterate it with ``async for``; leave it with ``async with`` (or call :meth:`aclose`) when
    the loop body may be cancelled while it is not waiting on the stream::

        async with engine.generate("Hello", SamplingParams(max_tokens=8)) as stream:
            async for out in stream:
                print(out.index, out.text, out.finish_reason)

    A request that fails raises its error from the loop: a
    :class:`~server.errors.ClientError` when the engine refused it as the client's fault
    (a prompt over the context), an :class:`~server.errors.EngineError` when the engine
    failed (:class:`~server.errors.WorkerDied` when its worker went away). The other choices
    are aborted, and the output that carried the error (with any text merged into it before
    the failure) is the exception's ``output``. With ``errors_as_outputs`` (the HTTP layer,
    which writes errors as events), such an output is returned instead, with
    ``finish_reason == "error"``.

    Cancelling the consumer's scope aborts every unfinished choice on the engine, once.
    :meth:`abort` is the server's own abort (a timeout, a shutdown): the stream keeps going
    until the engine confirms or the drain deadline passes, and every open choice ends with
    ``finish_reason == "abort"``.
    """

    __slots__ = (
        "_choices",
        "_waker",
        "_open",
        "_released",
        "_drain_timeout",
        "_drain_deadline",
        "_on_release",
        "_busy",
        "_closing",
        "abort_cause",
        "errors_as_outputs",
        "__weakref__",
    )

    def __init__(
        self,
        choices: list[Choice],
        waker: Waker,
        drain_timeout: float,
        on_release,
        errors_as_outputs: bool = False,
    ):
        self._choices = choices
        self._waker = waker
        self._open = len(choices)  # choices whose last output the consumer has not taken
        self._released = False
        self._drain_timeout = drain_timeout
        self._drain_deadline: float | None = None
        self._on_release = on_release
        self._busy = False  # a task is in __anext__ or wait_started (one consumer at a time)
        self._closing: trio.Event | None = None  # set once the aclose in progress is done
        #: Why the server aborted this stream ("timeout", "shutdown", ...), or None.
        self.abort_cause: str | None = None
        #: Return an output with ``finish_reason == "error"`` instead of raising its error.
        self.errors_as_outputs = errors_as_outputs

    # -- iteration ---------------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        waker = self._waker
        ready = waker.ready
        if self._busy:
            raise trio.BusyResourceError("another task is already waiting on this stream")
        self._busy = True
        try:
            while True:
                if ready:
                    if not waker.interval or self._paced_due():
                        break
                    # Paced, and news came while we were busy: wait for its time (or for a
                    # last output), merging whatever arrives meanwhile.
                    waker.defer()
                elif self._open == 0 or self._released:
                    self._release()
                    raise StopAsyncIteration
                await self._park()
            await _checkpoint_if_cancelled()
        except BaseException as exc:
            if not isinstance(exc, StopAsyncIteration):
                await self.aclose()
            raise
        finally:
            self._busy = False
        waker.taken()
        out = ready.popleft().take()
        if out.finish_reason is not None:
            self._open -= 1
            if out.finish_reason == "error" and not self.errors_as_outputs:
                await self._raise_error(out)
        return out

    async def _raise_error(self, out: RequestOutput) -> None:
        """End the stream with ``out``'s error (the library's view of a failed request).

        The exception's traceback holds this frame: the local goes before it propagates,
        or exception and frame would form a cycle that only the collector frees (and the
        stream with them)."""
        exc = _error_of(out)
        exc.output = out
        await self.aclose()
        try:
            raise exc
        finally:
            del exc

    def _paced_due(self) -> bool:
        """With pacing on and news ready: may it go out now? (Always, once aborted, when a
        choice has ended, or when the interval has passed.)"""
        waker = self._waker
        if self._drain_deadline is not None or _current_time() >= waker.not_before:
            return True
        return any(c.done for c in waker.ready)

    async def next_batch(self) -> list[RequestOutput]:
        """The next outputs: waits for one, then takes every other output ready now (one per
        choice with news), so that they can go out together; ``[]`` once the stream ended.
        Errors as in ``async for``: raised, unless ``errors_as_outputs``."""
        try:
            out = await self.__anext__()
        except StopAsyncIteration:
            return []
        outs = self.take_ready_nowait()
        if not outs:
            return [out]
        outs.insert(0, out)
        if not self.errors_as_outputs:
            for o in outs:
                if o.finish_reason == "error":
                    await self._raise_error(o)
        return outs

    def set_sink(self, sink: Callable[[Choice], bool] | None) -> bool:
        """Let ``sink`` take text the moment it arrives, instead of waking the consumer.

        For a consumer that turns each output into bytes for one client (the HTTP layer's
        plain streams). While the consumer is parked waiting for this stream and nothing
        is ready, the worker's router calls ``sink(choice)`` for a choice with new text that
        did not end. The sink either takes the news (it clears ``choice.text`` and
        ``choice.ntok``, and returns True: the consumer is not woken) or leaves the choice
        as it found it, or with less (returns False: the choice goes to the consumer as
        usual). It runs in the router: it must never block, raise or wait. Ends, errors and
        everything while the stream closes go to the consumer; :meth:`aclose` drops the sink.
        With pacing (a stream interval), the sink is called when the consumer would have
        been woken: at most once per interval, with what merged meanwhile. Returns whether
        the sink was installed.
        """
        waker = self._waker
        waker.sink = sink if not self._released else None
        return waker.sink is not None

    def take_ready_nowait(self) -> list[RequestOutput]:
        """Every output that is ready now, without waiting (possibly none), errors included
        as outputs (see :meth:`next_batch` for the usual way to take several)."""
        ready = self._waker.ready
        if not ready:
            return []
        outs = []
        while ready:
            out = ready.popleft().take()
            if out.finish_reason is not None:
                self._open -= 1
            outs.append(out)
        return outs

    async def wait_started(self, timeout: float = math.inf) -> list[int] | None:
        """Wait until the engine accepted every choice and produced the first output; return
        the prompt token count of each choice. Returns None when ``timeout`` seconds passed
        first; the stream stays open (call again to go on waiting).

        Raises the request's error instead (after closing the stream) when a choice ended
        with an error before producing a token: a client fault such as a prompt over the
        context limit (:class:`~server.errors.ClientError`), or an engine failure
        (:class:`~server.errors.EngineError`). Raises
        :class:`~server.errors.ServiceUnavailable` (``server_overloaded``) when the
        queue-time limit aborted the request before it started, whatever the engine sent
        meanwhile (``abort_cause == "queue_timeout"``: :meth:`Engine.generate_many`'s
        ``queue_timeout``). The HTTP layer calls this before it sends the first
        byte, so that such errors are answered with a status instead of a stream.
        """
        choices = self._choices
        deadline = trio.current_time() + timeout
        if self._busy:
            raise trio.BusyResourceError("another task is already waiting on this stream")
        self._busy = True
        try:
            while True:
                if self.abort_cause == QUEUE_TIMEOUT:
                    await self.aclose()  # (waits, bounded, for the engine's abort)
                    raise queue_timeout_error()
                for c in choices:
                    if c.done and c.error_kind is not None and c.completion_tokens == 0:
                        out = RequestOutput(0, "", 0, 0, 0, "error", c.error_kind, c.error,
                                            None, c.error_param)
                        await self.aclose()
                        # No local holds the exception: with the traceback holding this
                        # frame, that would be a cycle only the collector frees.
                        raise _error_of(out)
                if self._waker.ready and all(c.accepted or c.done for c in choices):
                    return [c.prompt_tokens for c in choices]
                if deadline == math.inf:
                    await self._park()
                    continue
                with trio.move_on_at(deadline):
                    await self._park()
                    continue
                return None
        except ServerError:
            raise
        except BaseException:
            await self.aclose()
            raise
        finally:
            self._busy = False

    # -- ending ------------------------------------------------------------------------------

    def abort(self, cause: str = "abort") -> None:
        """Abort every unfinished choice on the engine and start the drain deadline.

        Never blocks. The consumer keeps iterating: output already produced drains, and when
        the engine confirms (or at the deadline) each open choice ends with ``abort``.
        ``cause`` is kept in :attr:`abort_cause` (the HTTP layer maps "timeout" to 504).
        """
        if self._released or self._drain_deadline is not None or self.finished:
            return
        self.abort_cause = cause
        for c in self._choices:
            c.worker.abort_nowait(c)
        self._drain_deadline = trio.current_time() + self._drain_timeout
        self._waker.wake()  # a consumer parked without a deadline re-parks with this one

    async def _park(self) -> None:
        """Wait for news; once aborted, only until the drain deadline (then cut off).
        Raises ``trio.ClosedResourceError`` while another task closes the stream."""
        if self._closing is not None:
            raise trio.ClosedResourceError("another task closed this stream")
        if self._drain_deadline is None:
            await self._waker.park()
        else:
            await self._park_draining()

    async def _park_draining(self) -> None:
        assert self._drain_deadline is not None
        with trio.move_on_at(self._drain_deadline):
            await self._waker.park()
            return
        self.cut_off()

    def cut_off(self) -> None:
        """End every choice the worker has not ended, as ``abort``, and forget them there
        (the drain deadline passed; or the engine stops and cannot wait for the workers)."""
        for c in self._choices:
            if not c.done:
                c.worker.forget(c)
                c.end("abort")

    async def aclose(self) -> None:
        """Abort what is unfinished and free the request; shielded, bounded by the drain
        deadline. Safe to call more than once, from a cancelled scope, and from another task
        than the consumer's: a consumer waiting on the stream then raises
        ``trio.ClosedResourceError``, and an ``aclose`` while one is in progress waits for
        it. Iterating a closed stream ends at once."""
        if self._released:
            return
        closing = self._closing
        if closing is not None:  # another task is closing it: bounded there
            with trio.CancelScope(shield=True):
                await closing.wait()
            return
        self._closing = closing = trio.Event()
        waker = self._waker
        try:
            waker.sink = None  # what drains now is not written to the client
            parked = waker.task
            if parked is not None:  # the consumer, in another task: its stream is closed
                waker.task = None
                _reschedule(parked, outcome.Error(
                    trio.ClosedResourceError("another task closed this stream")))
            choices = self._choices
            if any(not c.done for c in choices):
                for c in choices:
                    c.worker.abort_nowait(c)
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + self._drain_timeout
                    if self._drain_deadline is not None:
                        scope.deadline = min(scope.deadline, self._drain_deadline)
                    while any(not c.done for c in choices):
                        await waker.park()
                self.cut_off()
            self._release()
        finally:
            if not self._released:  # (interrupted: a later aclose tries again)
                self._closing = None
            closing.set()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._waker.ready.clear()
            self._waker.closed = True
            self._waker.sink = None
            self._on_release(self)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Safety net for a stream dropped without aclose (an ``async for`` whose body was
        # cancelled outside the stream): queue the aborts; the worker confirms later.
        if not self._released:
            self._released = True
            self._waker.ready.clear()
            self._waker.closed = True
            for c in self._choices:
                c.worker.abort_nowait(c)
            self._on_release(self)

    # -- introspection -----------------------------------------------------------------------

    @property
    def choices(self) -> int:
        return len(self._choices)

    @property
    def started(self) -> bool:
        """Whether the engine started the request: the worker sent a choice's first
        output (a token, or its end). What the queue-time limit waits for; a request
        still in the engine's queue (accepted or not) has not started."""
        return any(c.completion_tokens or c.done for c in self._choices)

    def choice_states(self) -> list[Choice]:
        """The request's choices, in index order, to read (never to change) how each ended:
        ``finish_reason``, ``error_kind``, token counts, ``accepted_at``. The HTTP layer
        reads them once, after the stream is closed, for metrics and the request's log line."""
        return list(self._choices)

    @property
    def finished(self) -> bool:
        """True once every choice has ended on the engine side."""
        return all(c.done for c in self._choices)

    @property
    def ending(self) -> bool:
        """True once the consumer took every choice's last output (or the stream was
        released): the next batch is the end, ``[]``, without waiting."""
        return self._open == 0 or self._released
