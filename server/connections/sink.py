"""The text events of a plain stream, and a Responses stream's deltas, written by the
worker's router (no task wakeup).

Theory of operation
-------------------
A streamed event normally costs a trip through Trio's scheduler: the router merges an
engine step's text into the request's :class:`~server.manager.stream.Choice` and wakes the
request's task, which encodes one SSE event and writes it. For the most common stream (one
choice, plain text: no logprobs, reasoning split, tools or continuous usage) the router can
write the event itself: when the request's task is parked waiting for news and the
connection offers :class:`~server.connections.http11.DirectBody`, :class:`TextSink` encodes the
text and hands the chunk to the kernel right there (a step whose token made no text yet,
a part of a character that the detokenizer holds back, is an event with empty text, as the
task writes it: the sink writes that too). The task sleeps on, and is woken only
for what only it does: the end of the stream, an error, an abort, a client that stopped
reading (a socket buffer that does not take the chunk at once). It is also woken for the
rest of a chunk the kernel took only part of (``torn``: it goes out before anything else).

Nothing changes hands: the task still starts the response, owns its end and its errors,
and the cancellation of its scope (a disconnect) still ends the request, since the task
never stops waiting on its stream. The sink is dropped when the stream closes, so nothing
written while it drains an abort reaches the client. Events are byte for byte those the task
would write, and each still carries one engine step: the sink changes who writes, never what
or when.

A ``/v1/responses`` stream (:class:`ResponseSink`) has one choice but richer events: its
:class:`~server.openai.responses_events.ResponseEvents` numbers them (``sequence_number``)
and may split the text into reasoning, message and function call items. The sink feeds
the text to those events, as the task would, and writes what they make when it is only
deltas of the item already open (``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.reasoning_text.delta``). A feed that
closes an item or opens one, or a chunk the connection does not take, has made its events
all the same: they are ``held`` for the task, which sends them before anything else, so
every event goes out once, numbered, in the order it was made.
"""

from __future__ import annotations

import logging
import time

from ..openai.encode import ChunkEncoder, text_json
from ..openai.responses_events import ResponseEvents
from .http11 import DirectBody

__all__ = ["ResponseSink", "TextSink"]

log = logging.getLogger("server.http")

_now = time.perf_counter


class TextSink:
    """The router's writer of one plain stream's text (``RequestStream.set_sink``).

    It writes what ``enc.delta(index, text)`` would make, built from parts made once
    (:meth:`ChunkEncoder.text_parts`): per event, only the text is encoded."""

    __slots__ = ("_body", "_enc", "_index", "_head", "_tail", "_observe_itl", "last", "torn")

    def __init__(self, body: DirectBody, enc: ChunkEncoder, observe_itl, last: float) -> None:
        self._body = body
        self._enc = enc
        self._index = 0
        self._head, self._tail = enc.text_parts(0)
        self._observe_itl = observe_itl
        #: When the last event with tokens went out (perf_counter), for inter-token latency;
        #: shared with the task, which writes the others.
        self.last = last
        #: The rest of a chunk the kernel took only part of, which the task must send next.
        self.torn = b""

    def __call__(self, choice) -> bool:
        if choice.index != self._index:  # (a plain stream has one choice: not met)
            self._index = choice.index
            self._head, self._tail = self._enc.text_parts(choice.index)
        try:
            text = text_json(choice.text)
        except Exception:  # a bug of ours: the task meets it too, and ends the stream with
            return False  # an error event; the router (every other stream) goes on
        rest = self._body.write_parts_nowait(self._head, text, self._tail)
        if rest is None:
            return False  # not written: the task sends it the usual way
        # Written (maybe in part): from here the choice must say so, whatever follows.
        choice.text = ""
        return _written(self, choice, rest)


class ResponseSink:
    """The router's writer of a ``/v1/responses`` stream's deltas (``RequestStream.set_sink``).

    The task that installs it reads its state each time it wakes, before anything else:
    ``failed``, then ``torn`` (through :meth:`DirectBody.send_torn`), then ``held`` (the
    events the sink made but did not write), then ``last``.
    """

    __slots__ = ("_body", "_events", "_observe_itl", "_sent", "last", "torn", "held", "failed")

    def __init__(self, body: DirectBody, events: ResponseEvents, observe_itl, last: float,
                 sent: list[bytes] | None) -> None:
        self._body = body
        self._events = events
        self._observe_itl = observe_itl
        #: Where the events written go too, for a stored response (None: not stored).
        self._sent = sent
        #: When the last event with tokens went out (perf_counter), shared with the task.
        self.last = last
        #: The rest of a chunk the kernel took only part of, which the task must send next.
        self.torn = b""
        #: Events made from text already fed, that the task must send next (after ``torn``).
        self.held = b""
        #: The events failed on the sink's text (a bug of ours, logged): the task ends the
        #: stream as it does for its own failures.
        self.failed = False

    def __call__(self, choice) -> bool:
        events = self._events
        item = events.open_item
        try:
            data = events.feed(choice.text)
        except Exception:  # the task ends the stream (response.failed); the router goes on
            log.exception("a Responses stream's events failed in the router")
            self.failed = True
            return False
        choice.text = ""  # fed: from here the events hold it, whatever follows
        if not data:  # (a parser holds the text back: nothing to write yet)
            rest: bytes | None = b""
        elif events.open_item is not item:  # an item closed or opened: the task's events
            rest = None
        else:
            rest = self._body.write_nowait(data)
        if rest is None:
            # Not written: the task sends it, and accounts for the tokens (choice.ntok).
            self.held += data
            return False
        if data and self._sent is not None:
            self._sent.append(data)
        return _written(self, choice, rest)


def _written(sink: TextSink | ResponseSink, choice, rest: bytes) -> bool:
    """A sink wrote ``choice``'s events, all but ``rest``: its tokens are accounted for
    here (inter-token latency) and ``rest`` is left for the task. Whether the router may
    leave the task asleep: not when torn (it wakes for an output without text or tokens,
    and sends the rest)."""
    sink.torn = rest
    tokens = choice.ntok
    choice.ntok = 0
    if tokens:
        now = _now()
        sink._observe_itl(now - sink.last)
        sink.last = now
    return not rest
