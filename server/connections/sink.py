"""The text events of a plain stream, written by the worker's router (no task wakeup).

Theory of operation
-------------------
A streamed event normally costs a trip through Trio's scheduler: the router merges an
engine step's text into the request's :class:`~server.manager.stream.Choice` and wakes the
request's task, which encodes one SSE event and writes it. For the most common stream (one
choice, plain text: no logprobs, reasoning split, tools or continuous usage) the router can
write the event itself: when the request's task is parked waiting for news and the
connection offers :class:`~server.connections.http11.DirectBody`, :class:`TextSink` encodes the
text and hands the chunk to the kernel right there. The task sleeps on, and is woken only
for what only it does: the end of the stream, an error, an abort, a client that stopped
reading (a socket buffer that does not take the chunk at once). It is also woken for the
rest of a chunk the kernel took only part of (``torn``: it goes out before anything else).

Nothing changes hands: the task still starts the response, owns its end and its errors,
and the cancellation of its scope (a disconnect) still ends the request, since the task
never stops waiting on its stream. The sink is dropped when the stream closes, so nothing
written while it drains an abort reaches the client. Events are byte for byte those the task
would write, and each still carries one engine step: the sink changes who writes, never what
or when.
"""

from __future__ import annotations

import time

from ..openai.encode import ChunkEncoder
from .http11 import DirectBody

__all__ = ["TextSink"]

_now = time.perf_counter


class TextSink:
    """The router's writer of one plain stream's text (``RequestStream.set_sink``)."""

    __slots__ = ("_body", "_delta", "_observe_itl", "last", "torn")

    def __init__(self, body: DirectBody, enc: ChunkEncoder, observe_itl, last: float) -> None:
        self._body = body
        self._delta = enc.delta
        self._observe_itl = observe_itl
        #: When the last event with tokens went out (perf_counter), for inter-token latency;
        #: shared with the task, which writes the others.
        self.last = last
        #: The rest of a chunk the kernel took only part of, which the task must send next.
        self.torn = b""

    def __call__(self, choice) -> bool:
        try:
            data = self._delta(choice.index, choice.text)
        except Exception:  # a bug of ours: the task meets it too, and ends the stream with
            return False  # an error event; the router (every other stream) goes on
        rest = self._body.write_nowait(data)
        if rest is None:
            return False  # not written: the task sends it the usual way
        # Written (maybe in part): from here the choice must say so, whatever follows.
        self.torn = rest
        tokens = choice.ntok
        choice.text = ""
        choice.ntok = 0
        if tokens:
            now = _now()
            self._observe_itl(now - self.last)
            self.last = now
        # Torn: the task wakes, for an output without text or tokens, and sends the rest.
        return not rest
