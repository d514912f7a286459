"""What one frame may cost the process that decodes it when its sender may be hostile (a
listening worker's frontends). Sans-IO; no trio here.

Why
---
msgpack turns bytes into Python objects many times their size: an empty array is one byte
and becomes a 56-byte list in an 8-byte slot. One 24 MB frame of 24M empty arrays took a
listening worker from 33 MB to 1.77 GB and held its loop ~19 s, long enough for every
frontend to take it for hung (issue 42). A frame's length prefix bounds its bytes, not
what they become.

Theory of operation
-------------------
Two bounds, both applied before the objects exist (``wire.FrameDecoder(limits=...)``):

* *Frame size by message type.* A message is an array whose first item is its type, a
  small integer: the body's first bytes say the type (:func:`wire.peek_kind`) before the
  rest has arrived. Only SUBMIT and CALL carry prompts (up to ``wire.MAX_FRAME``);
  every other type, and a body that does not start as an array whose first item is a
  type byte, must fit in :data:`SMALL`. A frame over its type's bound is refused as soon
  as its first bytes are in, before its body is buffered.
* *Values per frame.* A frame of more than :data:`PLAIN` bytes is decoded by a walk
  (:meth:`Limits.decode`) that reads arrays and maps a header at a time. It charges each
  header's count to its budgets before it builds anything:

  - :data:`VALUES` values (array items, map keys and values: ~72 bytes each at most);
  - :data:`CONTAINERS` arrays and maps (a step of Python each);
  - :data:`IDS` packed token ids (~36 bytes each);
  - nested :data:`MAX_DEPTH` deep at most.

  So a frame costs at most ~250 MB of objects beyond its own bytes (~75 MB of values,
  ~150 MB of ids), and about a second of walking on a busy core. A smaller frame decodes in
  one msgpack call: 16 KiB become ~1 MB at most.

What legitimate frames need:

* a prompt is a string (one value, however long: the 3.5 MB ``/tokenize`` prompt of
  tests/test_worker_prepare.py), packed token ids (a frontend packs any list of 4,096 ids
  or more for a worker that says ``packed_ids``: a 4M-token prompt fits) or chat messages;
* params, tools and schemas are JSON of at most the frontend's ``--max-body-bytes`` (4 MiB:
  far fewer values than the budget unless built to be absurd);
* LoRA names, block names (16,384 at most) and SUBSCRIBE's topics are small.

A SUBMIT or CALL over the budget or the depth is refused as that request's error
(:class:`wire.Oversized`: the worker answers ``invalid_request``, as for any request it
cannot take), not as a protocol violation: a frontend passes on what its HTTP clients
sent, and one client's absurd body must not end every stream its frontend has on the
worker. Any other frame over a bound ends the connection.

The frontend's reader has no such limits: its peer proved it knows the secret (or is its
own child process), and its frames (a STEP of a full batch, a RESULT of millions of
ids, in PART frames) are the big ones. Nor has a pipe worker's: its frontend is its parent.
"""

from __future__ import annotations

import msgpack

from . import wire

__all__ = [
    "Limits", "SMALL", "PLAIN", "VALUES", "CONTAINERS", "IDS", "MAX_DEPTH", "REQUESTS",
    "HANDSHAKE",
]

#: The largest frame of any type but SUBMIT and CALL (a PING is ~12 bytes, a SUBSCRIBE
#: of 8 topics ~100, an AUTH 70).
SMALL = 4096
#: Frames up to this size are decoded in one msgpack call (at most ~72 bytes of objects a
#: byte: ~1 MB).
PLAIN = 16 << 10
#: The most values a bigger frame may decode to: array items, map keys and values (~72
#: bytes each at most; a leaf costs ~0.3 us to walk).
VALUES = 1 << 20
#: ... of which arrays and maps (a step of Python each: ~3 us).
CONTAINERS = 1 << 16
#: The most token ids packed in it (``wire.PACKED_IDS``: ~36 bytes each, decoded in C).
IDS = 1 << 22
#: The deepest nesting of arrays and maps in it (JSON schemas nest tens deep).
MAX_DEPTH = 256

_HEADS = wire.CONTAINER_HEADS


class _Over(Exception):
    """The walk passed a bound (its text says which)."""


class Limits:
    """The bounds of one reader: ``caps``, the largest frame of a message type (by type;
    others: ``small``); the walk's budgets (see the module's docstring)."""

    __slots__ = ("caps", "small", "least", "values", "containers", "ids", "depth")

    def __init__(self, caps: dict[int, int], *, small: int = SMALL, values: int = VALUES,
                 containers: int = CONTAINERS, ids: int = IDS, depth: int = MAX_DEPTH,
                 ) -> None:
        self.caps = caps
        self.small = small
        #: No frame up to this size needs its type looked at.
        self.least = min([small, *caps.values()])
        self.values = values
        self.containers = containers
        self.ids = ids
        self.depth = depth

    def cap(self, kind: int | None) -> int:
        """The largest frame of message type ``kind`` (None: not a message's start)."""
        return self.caps.get(kind, self.small) if kind is not None else self.small

    @staticmethod
    def walks(body: bytes) -> bool:
        """Whether ``body`` is decoded by :meth:`decode`'s walk: over :data:`PLAIN` bytes
        (a smaller one is decoded in one call, by its reader)."""
        return len(body) > PLAIN

    def decode(self, body: bytes) -> object:
        """``body``'s msgpack value, as lists and maps (for its reader to type), walked
        within the bounds: past one, :class:`wire.Oversized` for a SUBMIT or CALL with an
        integer id, else :class:`wire.ProtocolError`."""
        try:
            walk = _Walk(body, self)
            value = walk.value(0)
            if walk.unpacker.tell() != len(body):
                raise ValueError("extra data after the message")
        except _Over as exc:
            raise _refusal(body, str(exc)) from None
        except MemoryError:
            raise
        except Exception as exc:  # msgpack's errors, a bad extension value
            raise wire.ProtocolError(f"undecodable frame: {str(exc):.200}") from None
        return value


class _Walk:
    """One bounded decoding (see the module's docstring)."""

    __slots__ = ("body", "limits", "unpacker", "values", "containers", "ids")

    def __init__(self, body: bytes, limits: Limits) -> None:
        self.body = body
        self.limits = limits
        # what is left of each budget
        self.values = limits.values
        self.containers = limits.containers
        self.ids = limits.ids
        self.unpacker = msgpack.Unpacker(use_list=True, raw=False, ext_hook=self._ext,
                                         max_buffer_size=len(body))
        self.unpacker.feed(body)

    def _ext(self, code: int, data: bytes):
        if code == wire.PACKED_IDS:
            self.ids -= len(data) // 4
            if self.ids < 0:
                raise _Over(f"more than {self.limits.ids:,} token ids")
        return wire.unpack_ext(code, data)

    def _container(self, depth: int, items: int) -> None:
        """Charge an array or a map of ``items`` values at ``depth``."""
        self.values -= items
        self.containers -= 1
        limits = self.limits
        if self.values < 0:
            raise _Over(f"more than {limits.values:,} values")
        if self.containers < 0:
            raise _Over(f"more than {limits.containers:,} arrays and maps")
        if depth >= limits.depth:
            raise _Over(f"arrays and maps nested more than {limits.depth} deep")

    def value(self, depth: int) -> object:
        unpacker = self.unpacker
        body = self.body
        pos = unpacker.tell()
        if pos >= len(body):
            raise ValueError("the frame ends inside its message")
        first = body[pos]
        if first in wire.ARRAY_HEADS:
            count = unpacker.read_array_header()
            self._container(depth, count)
            # (a leaf in one call, an array or a map walked)
            tell, unpack, nested = unpacker.tell, unpacker.unpack, self.value
            return [nested(depth + 1) if body[tell()] in _HEADS else unpack()
                    for _ in range(count)]
        if first in wire.MAP_HEADS:
            count = unpacker.read_map_header()
            self._container(depth, 2 * count)
            out = {}
            for _ in range(count):
                if body[unpacker.tell()] in _HEADS:
                    raise ValueError("a map key that is an array or a map")
                key = unpacker.unpack()
                if type(key) is not str and type(key) is not bytes:  # (unpackb's keys)
                    raise ValueError(f"a map key of type {type(key).__name__}")
                out[key] = self.value(depth + 1)
            return out
        return unpacker.unpack()  # (a string, bytes, a number, nil, an extension value)


def _refusal(body: bytes, reason: str) -> Exception:
    """What a frame over a bound of the walk gets: the request's own error, when it is a
    SUBMIT or CALL whose id is readable; else the end of the connection."""
    kind, ident = wire.peek_head(body)
    if kind in (wire.SUBMIT, wire.CALL) and ident is not None:
        return wire.Oversized(kind, ident, f"the request is too large for the worker to "
                              f"decode: {reason}")
    return wire.ProtocolError(f"a frame over the decoding limits: {reason}")


#: A listening worker's reader once its frontend authenticated.
REQUESTS = Limits({wire.SUBMIT: wire.MAX_FRAME, wire.CALL: wire.MAX_FRAME})
#: ... and before: the AUTH message only.
HANDSHAKE = Limits({})
