"""A big answer in parts, so that the STEP frames of every other stream go between them.

Theory of operation
-------------------
A worker's loop writes its frames with blocking writes, and a frame goes out whole. While a
14 MB RESULT (a ``/tokenize`` answer of 3.5M packed ids) crosses the pipe, the loop waits
for the frontend to read all of it, and every stream on that worker waits with it (~0.1 s
on a shared core; docs/changelog.md, 2026-12-02, "Isolation: A big answer in parts"). A
non-blocking write would let the loop step on, but its STEP frames would still queue
behind the big frame.

So a pipe worker started with ``"parts": true`` (the frontend's worker argument,
server.config), or a listening worker to a connection that subscribed to
:data:`~server.worker_protocol.wire.PARTS_TOPIC`, sends a RESULT frame of
:data:`~server.worker_protocol.wire.BIG_FRAME` or more as PART messages instead,
:data:`PART_BYTES` of its body each::

    [PART, data, more]     data: bytes, the next piece of one frame body; more: bool,
                           False on the last piece

and at most :data:`PARTS_PER_PASS` of them per pass of its loop (:class:`PartQueue`),
whatever else that pass wrote: the STEP frames of the next passes go between the parts, so
a stream waits for at most ~1 MiB of the answer, not for all of it. Only answers to round
trips (RESULT) are sent so: STEPs keep their order, as the routing of outputs requires.
One answer is in parts at a time (a second waits its turn, whole answers stay in order).
Each PART is a whole frame, so anything else may come between two of them, the worker's
pulse (an unasked PONG from another thread during a long step) included. Past
:data:`MAX_QUEUED_PARTS` queued (many big answers asked at once) the worker writes down to
that bound at once, pushing back on its frontend as whole frames did; at a SHUTDOWN, or when
its engine breaks, it writes every part left before it ends. A listening worker
(server.workers.listen) never blocks on a frontend: it adds a connection's next parts to
that connection's output once the socket has taken everything before them, at most
:data:`PARTS_PER_PASS` at a time, and counts the parts left against its
``--max-buffer-bytes`` as it counts the output waiting.

The frontend's :class:`PartsDecoder` joins the pieces into the frame body they came from,
which comes out of :meth:`~PartsDecoder.frames` in the place of the last piece, as if the
frame had arrived whole then: the router decodes it as any big frame (aside, in a thread).
Pieces that are not ``[PART, bytes, bool]`` (``wire.Part``), or a body that grows past
:data:`~server.worker_protocol.wire.MAX_FRAME`, are a protocol violation (the session
ends, as for any garbage). Nothing else changes: a frontend that does not ask for parts
gets whole frames; an older worker ignores the key it does not know.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, cast

import msgpack

from . import wire

__all__ = ["PART_BYTES", "PARTS_PER_PASS", "MAX_QUEUED_PARTS", "PartQueue", "PartsDecoder",
           "split", "is_big_answer"]

#: The body bytes one PART carries: its frame stays below ``wire.BIG_FRAME``, so the
#: frontend decodes it inline (a copy), never in a thread.
PART_BYTES = 256 * 1024
#: The most PARTs a worker writes per pass of its loop: 1 MiB of the answer, what the
#: other streams may wait for between two of their STEPs (the frontend reads ~1 MiB in a
#: few milliseconds, ~0.1 s for 14 MB on a shared core).
PARTS_PER_PASS = 4

#: The most parts queued before :meth:`PartQueue.write_some` writes past its share (32 MiB):
#: a worker asked for many big answers at once pushes back on its frontend, as a blocking
#: write of whole frames did, instead of piling them up in its memory.
MAX_QUEUED_PARTS = 128

#: A PART frame body's first bytes: an array of three items, the first PART.
_PART_HEAD = b"\x93" + msgpack.packb(wire.PART)
_PART = wire.reader(wire.PART)


def is_big_answer(frame: bytes) -> bool:
    """Whether ``frame`` (from :func:`wire.encode`: its 4-byte length first) is a RESULT
    of :data:`wire.BIG_FRAME` or more: one that goes in parts."""
    return len(frame) - 4 >= wire.BIG_FRAME and frame.startswith(wire.RESULT_HEAD, 4)


def split(frame: bytes, size: int = PART_BYTES) -> Iterator[bytes]:
    """``frame`` (from :func:`wire.encode`) as PART frames of ``size`` body bytes each,
    made one at a time (a copy of ``size`` bytes each, not of the whole frame)."""
    body = memoryview(frame)[4:]
    end = len(body)
    for start in range(0, end, size):
        stop = start + size
        yield wire.encode(wire.Part(body[start:stop], stop < end))  # type: ignore[arg-type]


class PartQueue:
    """The big answers a worker's loop has yet to write, in parts (sans-IO but for the
    ``write`` it is given: a blocking write of one whole frame)."""

    __slots__ = ("_write", "_queue", "_current", "_parts")

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._queue: deque[bytes] = deque()
        self._current: Iterator[bytes] | None = None
        self._parts = 0  # parts left to write, queued answers included

    def add(self, frame: bytes) -> None:
        """Queue ``frame`` (a whole RESULT frame), to go after those queued before."""
        self._queue.append(frame)
        self._parts += -(-(len(frame) - 4) // PART_BYTES)

    def take_big(self, frames: list[bytes]) -> list[bytes]:
        """Queue the big answers among ``frames`` (:func:`is_big_answer`); the others, to
        be written whole, in their order."""
        whole = []
        for frame in frames:
            if is_big_answer(frame):
                self.add(frame)
            else:
                whole.append(frame)
        return whole

    def pending(self) -> bool:
        """Whether any part is yet to be written (the loop must not sleep meanwhile)."""
        return self._parts > 0

    def queued_bytes(self) -> int:
        """About the bytes of the parts yet to be written (a bound on them)."""
        return self._parts * PART_BYTES

    def write_some(self, limit: int = PARTS_PER_PASS, pile: int | None = MAX_QUEUED_PARTS
                   ) -> None:
        """Write up to ``limit`` parts: one pass's share; more while over ``pile`` are left
        (None: never more)."""
        written = 0
        while written < limit or (pile is not None and self._parts > pile):
            if self._current is None:
                if not self._queue:
                    return
                self._current = split(self._queue.popleft())
            frame = next(self._current, None)
            if frame is None:
                self._current = None
                continue
            self._write(frame)
            self._parts -= 1
            written += 1

    def flush(self) -> None:
        """Write every part left (the loop ends: a SHUTDOWN after answers in flight)."""
        while self.pending():
            self.write_some()


class PartsDecoder(wire.FrameDecoder):
    """A :class:`wire.FrameDecoder` that joins PART frames into the frame body they came
    from (the frontend's, for a worker asked for parts). While :attr:`joining` is False (a
    listening worker, until it is asked by SUBSCRIBE) PART frames pass as they are, for the
    router to refuse."""

    __slots__ = ("_joined", "joining")

    def __init__(self, reader: wire.Reader | None = None, *, joining: bool = True) -> None:
        super().__init__(reader)
        self._joined = bytearray()
        self.joining = joining

    def frames(self, data: bytes | bytearray) -> list[bytes]:
        error: wire.ProtocolError | None = None
        try:
            bodies = super().frames(data)
        except wire.ProtocolError as exc:
            bodies, error = exc.frames, exc
        if self.joining and any(body.startswith(_PART_HEAD) for body in bodies):
            bodies = self._join(bodies)
        if error is not None:
            error.frames = bodies
            raise error
        return bodies

    def _join(self, bodies: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for body in bodies:
            if not body.startswith(_PART_HEAD):
                out.append(body)
                continue
            try:
                part = cast(wire.Part, _PART.decode(body))
            except wire.ProtocolError as exc:
                exc.frames = out
                raise
            joined = self._joined
            if len(joined) + len(part.data) > wire.MAX_FRAME:
                raise self._error(f"a frame in parts exceeds the {wire.MAX_FRAME} limit", out)
            joined += part.data
            if not part.more:
                out.append(cast(bytes, joined))  # (a bytearray: handed on, not copied)
                self._joined = bytearray()
        return out

    @staticmethod
    def _error(text: str, frames: list[bytes]) -> wire.ProtocolError:
        exc = wire.ProtocolError(text)
        exc.frames = frames
        return exc

    @property
    def buffered(self) -> int:
        """As :attr:`wire.FrameDecoder.buffered`, but while a frame in parts is being
        joined, :data:`wire.BIG_FRAME` at least: the next read may hold its last piece and
        complete a big frame, which the router must decode aside, not inline."""
        joined = len(self._joined)
        held = super().buffered + joined
        return max(held, wire.BIG_FRAME) if joined else held
