"""The reading side of the load: one task reads the responses of all connections.

:class:`Reactor` waits, through Trio, on a private epoll set holding every socket with a
response in flight, then reads and parses each ready socket with a single ``os.read`` (Trio's
``receive_some`` would cost a failing ``recv``, an exception and a task switch per event).
:class:`ResponseReader` is the state of one response: HTTP parser, SSE parser, stream tracker.
"""

from __future__ import annotations

import os
import select
import time
from typing import TYPE_CHECKING

import trio

from .http11 import HTTPResponseParser, ProtocolError
from .openai_api import StreamTracker
from .sse import SSEParser
from .target import RECV_SIZE

if TYPE_CHECKING:
    from .client import Context
    from .stats import Result

_perf = time.perf_counter
_os_read = os.read
_wait_readable = trio.lowlevel.wait_readable

MAX_ERROR_BODY = 64 * 1024


class Reactor:
    """Reads the responses of all connections in one task.

    Each connection with a response in flight is registered (level-triggered) in a private
    epoll set; the reactor task waits until that set's fd is readable (through Trio, so it is
    an ordinary checkpoint), then reads and parses every ready socket. A trickling stream thus
    costs one ``os.read`` and the parsing per event, and the Trio scheduler runs once per batch
    of ready sockets instead of once per event; the client task is woken once per response.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._readers: dict[int, ResponseReader] = {}
        self._EPOLLIN = select.EPOLLIN
        self.wakeups = 0  # batches of ready sockets handled
        self.reads = 0  # os.read calls on sockets

    def add(self, reader: ResponseReader) -> None:
        self._readers[reader.fd] = reader
        self._epoll.register(reader.fd, self._EPOLLIN)

    def remove(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):  # pragma: no cover - fd or epoll set closed
                pass  # (ValueError: the reactor task was cancelled before its clients)

    async def run(self) -> None:
        epfd = self._epoll.fileno()
        poll = self._epoll.poll
        readers = self._readers
        try:
            while True:
                await _wait_readable(epfd)
                ready = poll(0)
                self.wakeups += 1
                self.reads += len(ready)
                for fd, _mask in ready:
                    reader = readers.get(fd)
                    if reader is not None:
                        reader.on_readable()
        finally:
            self._epoll.close()


class ResponseReader:
    """The state of one response being read; driven by :class:`Reactor`.

    Once the head is in, the body goes to ``sse`` (an :class:`SSEParser` feeding ``tracker``
    for a 200 response, else ``errbody``, which keeps the start of the error body). When the
    response is complete, or the connection failed (``exc``), ``finished`` is set.
    """

    __slots__ = ("ctx", "fd", "res", "parser", "sse", "tracker", "errbody", "got_any", "exc",
                 "finished")

    def __init__(self, ctx: Context, fd: int, res: Result) -> None:
        self.ctx = ctx
        self.fd = fd
        self.res = res
        self.parser = HTTPResponseParser(method="POST")
        self.sse: SSEParser | ErrorBody | None = None
        self.tracker: StreamTracker | None = None
        self.errbody: ErrorBody | None = None
        self.got_any = False
        self.exc: BaseException | None = None
        self.finished = trio.Event()

    def _finish(self, exc: BaseException | None = None) -> None:
        self.exc = exc
        self.ctx.reactor.remove(self.fd)
        self.finished.set()

    def on_readable(self) -> None:
        try:
            data = _os_read(self.fd, RECV_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(exc)
            return
        now = _perf()
        parser = self.parser
        try:
            if not data:
                parser.feed_eof()
                self._finish()
                return
            self.got_any = True
            body = parser.feed(data)
            sse = self.sse
            if sse is None and parser.head is not None:
                sse = self._start()
            if body and sse is not None:
                events = sse.feed(body)
                if events:
                    tracker = self.tracker
                    before = tracker.content_events
                    on_event = tracker.on_event
                    for ev, d in events:
                        on_event(ev, d, now)
                    self.ctx.live_events += tracker.content_events - before
            if parser.done:
                self._finish()
        except ProtocolError as exc:
            self._finish(exc)
        except Exception as exc:  # a bug here must not kill the other streams silently
            self._finish(exc)

    def _start(self) -> SSEParser | ErrorBody:
        """The head is in: pick what reads the body."""
        status = self.parser.head.status
        self.res.status = status
        if status == 200:
            self.tracker = self.res.tracker = StreamTracker(chat=self.ctx.chat,
                                                          responses=self.ctx.responses)
            self.sse = SSEParser()
        else:
            self.sse = self.errbody = ErrorBody()
        return self.sse


class ErrorBody:
    """Collects (a bounded amount of) a non-200 response body in place of the SSE parser."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def feed(self, data: bytes) -> list:
        if self.size < MAX_ERROR_BODY:
            self.parts.append(data)
            self.size += len(data)
        return []

    def body(self) -> bytes:
        return b"".join(self.parts)
