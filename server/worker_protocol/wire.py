"""The worker wire protocol, sans-IO: frames in, messages out, and back. No trio here.

Theory of operation
-------------------
Each direction of the pipe carries *frames*: a 4-byte big-endian length, then that many bytes
of msgpack. Every frame holds one message, an array whose first item is the message type. The
frontend may write several frames in one ``write``; the worker writes at most one STEP frame
per loop iteration, however many requests advanced in it. See ``docs/protocol.md``.

The messages are types (:mod:`server.worker_protocol.messages`, msgspec ``Struct`` classes
that travel as those arrays): frontend -> worker SUBMIT, ABORT, PING, CALL, SHUTDOWN (and, to a
listening worker, SUBSCRIBE); worker -> frontend HELLO, STEP, PONG, RESULT, PART; the
handshake's CHALLENGE, AUTH, REFUSED (:mod:`server.worker_protocol.handshake`). CALL is a
round trip to the engine besides generation, its request's ``op`` the method: tokenize,
detokenize, info, embed, load_lora, unload_lora; RESULT answers it. (They were named
TOKENIZE and TOKENIZED: the numbers and bytes are the same.)

*Shapes.* A receiver decodes each frame with the :class:`Reader` of what it takes there
(:data:`REQUESTS` in a pipe worker, :data:`LISTENER_REQUESTS` in a listening one,
:data:`REPLIES` in a frontend after HELLO, :func:`reader` for the handshake's). A message of
a type it does not expect, with the wrong number of items, or an item of the wrong type
raises :class:`ProtocolError`. Its text names the message and shows it clipped, and the
receiver ends that connection only. The *content* of a well-formed SUBMIT or CALL (the
prompt's items, the params' values) is the engine's to judge: it answers a request it
cannot take with an error output, as for any client fault. A peer that sends a frame over
:data:`MAX_FRAME`, or bytes that are not msgpack, is broken: the same.

Integers beyond msgpack's 64 bits (legal in JSON payloads the frontend passes on: tool-call
arguments, schemas, template variables) travel as the extension type :data:`BIG_INT`, their
decimal digits, and come out as the same ``int``.

*Packed ids.* A long list of token ids (:data:`PACK_MIN` or more, each below 2**32) may
travel as the extension type :data:`PACKED_IDS`, little-endian uint32s, and comes out as
the same ``list`` of ints. The sender wraps it with :func:`pack_ids`, and only towards a
peer that can read it (a worker says ``"packed_ids": true`` in its HELLO,
:func:`hello_info`; a frontend asks for a packed /tokenize answer with ``"packed_ids":
true`` in the CALL's request). 3.5M ids decode in a few hundred milliseconds of
``array.tolist`` instead of seconds of msgpack item by item (:func:`decode_sliced`), and
pack in a ``memcpy``. A payload whose length is not a multiple of 4 is a protocol violation.
"""

from __future__ import annotations

import array
import functools
import reprlib
import re
import struct
import sys
from typing import Any, Callable, Iterable, Iterator, Union

import msgpack
import msgspec

from .messages import (
    ABORT, AUTH, CALL, CHALLENGE, FINISHES, HELLO, IMAGE_STATS, IMAGE_STATS_TOPIC,
    ITERATION_TOKEN_BUCKETS, LEAVING,
    LEAVING_KIND, LEAVING_TOPIC, NAMES, PART, PARTS_TOPIC, PING, PONG, REFUSED, RESULT,
    ROUTED_MAX, SHUTDOWN, STEP, SUBMIT, SUBSCRIBE, UNSET, Abort, AcceptRow, Auth, Call,
    Challenge, EngineStats, Hello, KvEvent, Leaving, Message, Note, NoteRow, OutputRow,
    Part, Ping, PipeSubmit, Pong, Refused, Result,
    Shutdown, Step, Submit, Subscribe, Times, as_dict, final_ok, note_ok,
)

__all__ = [
    # the message types and their classes (server.worker_protocol.messages)
    "HELLO", "SUBMIT", "ABORT", "PING", "PONG", "SHUTDOWN", "STEP", "CALL", "RESULT",
    "CHALLENGE", "AUTH", "REFUSED", "SUBSCRIBE", "PART", "LEAVING", "NAMES", "Message",
    "Hello", "Submit", "PipeSubmit", "Abort", "Ping", "Pong", "Shutdown", "Step", "Call",
    "Result", "Challenge", "Auth", "Refused", "Subscribe", "Part", "Leaving", "AcceptRow",
    "OutputRow",
    "NoteRow", "Note", "Times", "KvEvent", "EngineStats", "FINISHES", "UNSET", "final_ok",
    "note_ok", "as_dict",
    "ITERATION_TOKEN_BUCKETS", "ROUTED_MAX", "PARTS_TOPIC", "LEAVING_TOPIC", "LEAVING_KIND",
    "IMAGE_STATS_TOPIC", "IMAGE_STATS", "IMAGE_STATS_KEY", "pong_for",
    # keys, limits, encoding and decoding
    "RESULT_HEAD", "clip", "ROUTED_KEY", "PARTS_KEY", "LEAVING_KEY", "routed_topic", "MAX_FRAME",
    "PACKED_IDS", "PACK_MIN", "pack_ids", "hello_info", "ERROR_PARAM_KEY", "error",
    "ProtocolError", "Oversized", "FrameDecoder", "peek_kind", "peek_head", "unpack_ext",
    "encode", "as_list", "pack_sliced", "decode_sliced", "release_sliced", "is_result",
    "BIG_FRAME", "Packed", "SLICE", "Reader", "REQUESTS", "LISTENER_REQUESTS", "REPLIES",
    "reader", "check", "check_request", "check_listener_request", "check_reply",
    "malformed",
]

#: The key of a listening worker's HELLO info saying that it takes a SUBMIT's block names
#: and passes them on, as the worker note ``{"routed": [name, ...]}``, to every other
#: frontend that subscribed to the same naming (``[SUBSCRIBE, [routed_topic(N)]]``, N the
#: version of the frontend's block naming): a *routed notice*, so that each frontend's
#: routing prediction knows what the others sent it (docs/routing.md).
ROUTED_KEY = "routed_notices"
#: The key of a listening worker's HELLO info saying that a frontend may subscribe to
#: :data:`PARTS_TOPIC`: its big answers then come as PART frames between the STEPs of its
#: other streams (server.worker_protocol.parts), not whole, ahead of them.
PARTS_KEY = "answer_parts"
#: The key of a listening worker's HELLO info saying that a frontend may subscribe to
#: :data:`LEAVING_TOPIC`: told to stop (SIGTERM), the worker then sends it LEAVING first,
#: and refuses its later SUBMITs with the err kind :data:`LEAVING_KIND` (docs/protocol.md).
LEAVING_KEY = "leaving_notice"
#: The key of a listening worker's HELLO info saying that a frontend may subscribe to
#: :data:`IMAGE_STATS_TOPIC`: its PONG maps then hold the image-cache counters.
IMAGE_STATS_KEY = "image_stats"


def pong_for(pong: list, image_stats: bool) -> list:
    """A PONG (as a list) for a frontend: its engine map without the image-cache counters
    (:data:`IMAGE_STATS`) unless the frontend asked for them. An older frontend refuses a
    map with a key it does not know, and drops the worker."""
    stats = pong[-1]
    if image_stats or not isinstance(stats, dict) or not any(k in stats for k in IMAGE_STATS):
        return pong
    kept = {k: v for k, v in stats.items() if k not in IMAGE_STATS}
    return pong[:-1] + [kept] if kept else pong[:-1]


def routed_topic(naming: int) -> str:
    """The topic of the routed notices whose block names are of version ``naming``: a
    worker passes a SUBMIT's names only to the frontends subscribed to its sender's topic,
    so that frontends naming blocks differently never mix their predictions."""
    return f"routed/{naming}"


#: Largest frame either side accepts (64 MiB): a bigger length prefix means garbage.
MAX_FRAME = 64 * 1024 * 1024

_HEADER = struct.Struct(">I")

#: msgpack extension type of an integer beyond 64 bits, as its decimal digits. Such
#: integers are legal JSON and reach the engine only inside client payloads it passes on
#: (tool-call arguments in the history, schemas, template variables): carried exactly.
BIG_INT = 1
#: A sign and Python's default int_max_str_digits (4,300): the most the frontend's JSON
#: parser lets through, and the most ``int()`` turns back without raising.
_MAX_BIG_INT_DIGITS = 4301


#: msgpack extension type of a long list of token ids: little-endian uint32s, 4 bytes an id.
PACKED_IDS = 2
#: The fewest ids :func:`pack_ids` packs. Shorter lists stay msgpack arrays: under ~20 KB
#: they cost a tenth of a millisecond either way, stay readable in a clipped log line, and
#: the hot path's one-id notes never pay a conversion; from a few thousand ids on, packing
#: is 3-4 times cheaper to build and, on the frontend's big-frame path, avoids decoding a
#: list an item per call (seconds for millions of ids).
PACK_MIN = 4096
#: The key of a HELLO's info (and of a CALL's request) saying the sender reads PACKED_IDS.
PACKED_IDS_KEY = "packed_ids"

#: An array typecode of 4-byte unsigned items (``I`` on every platform CPython runs on).
_U32 = "I" if array.array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder == "big"  # (the wire is little-endian)


def pack_ids(ids: object) -> object:
    """``ids`` as they should travel: a list of :data:`PACK_MIN` or more ints in
    ``0..2**32-1`` as a uint32 array (which :func:`encode` sends as :data:`PACKED_IDS`),
    anything else as it is (a short list, or one that does not fit: the receiver judges its
    content; a prompt that is not ids). Only for a peer that reads PACKED_IDS (see the
    module's docstring)."""
    if type(ids) is not list or len(ids) < PACK_MIN:
        return ids
    packed = array.array(_U32)
    try:
        # (a slice per call: 3.5M ids in one call hold the GIL for 0.05-0.15 s, and a
        # worker packs its answer in a preparation thread beside its step loop)
        for start in range(0, len(ids), SLICE):
            packed.fromlist(ids[start:start + SLICE])
    except (OverflowError, TypeError):  # a negative, a huge or a non-int item
        return ids
    return packed


#: The key of a SUBMIT's params and of a CALL's request saying the frontend reads an
#: ``err`` of three items, ``[kind, message, param]`` (:func:`error`). A worker sends the
#: third item only to a request that asks, so that an older frontend (which ends the
#: connection on a three-item ``err``) keeps working; an older worker ignores the key.
ERROR_PARAM_KEY = "error_param"


def error(kind: str, message: str, param: str | None, request: object) -> list:
    """The ``err`` of a refusal answering ``request`` (a SUBMIT's params, a CALL's
    request): ``[kind, message, param]`` when the request asks (:data:`ERROR_PARAM_KEY`)
    and ``param`` (the client's field at fault) is known, else ``[kind, message]``. Only
    refusals pay for it: the flag is read when one is built."""
    if param is not None and type(request) is dict and request.get(ERROR_PARAM_KEY) is True:
        return [kind, message, param]
    return [kind, message]


def hello_info(info: dict) -> dict:
    """A worker's HELLO info: the engine's, saying that this worker reads and sends packed
    ids (:data:`PACKED_IDS`)."""
    return {**info, PACKED_IDS_KEY: True}


def _pack_default(value):
    """msgpack's ``default``: called for what it cannot pack itself (big ints, packed ids)."""
    if type(value) is array.array and value.typecode == _U32:
        if _SWAP:
            value = array.array(_U32, value)
            value.byteswap()
        return msgpack.ExtType(PACKED_IDS, value.tobytes())
    if isinstance(value, int) and not isinstance(value, bool):
        return msgpack.ExtType(BIG_INT, str(value).encode("ascii"))
    raise TypeError(f"cannot send a {type(value).__name__} to a worker")


def _ids_array(data: bytes | memoryview) -> array.array:
    if len(data) % 4:
        raise ValueError(f"packed ids of {len(data)} bytes (not a multiple of 4)")
    ids = array.array(_U32)
    ids.frombytes(data)
    if _SWAP:
        ids.byteswap()
    return ids


def unpack_ext(code: int, data: bytes | memoryview):
    """msgpack's ``ext_hook``: this protocol's extension values (BIG_INT, PACKED_IDS)."""
    return _unpack_ext(code, data)


def _unpack_ext(code: int, data: bytes | memoryview):
    if code == PACKED_IDS:
        return _ids_array(data).tolist()
    if code != BIG_INT or len(data) > _MAX_BIG_INT_DIGITS or not _DIGITS.fullmatch(data):
        raise ValueError(f"bad extension value (type {code})")
    return int(bytes(data))  # (msgspec hands a memoryview)


class _Deferred:
    """:func:`_unpack_ext` for :func:`decode_sliced`, but packed ids as their array, which
    the walk makes a list a slice per call (``tolist`` of 3.5M ids holds the GIL for
    0.2-0.4 s); ``count``: how many it made, so that a long list is searched for them only
    when it holds some."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, code: int, data: bytes):
        if code == PACKED_IDS:
            self.count += 1
            return _ids_array(data)
        return _unpack_ext(code, data)


def _undefer(value):
    """``value`` with each packed ids' array in it made a list (a slice per call)."""
    kind = type(value)
    if kind is array.array:
        return _list_sliced(value)
    if kind is list:
        return [_undefer(item) for item in value]
    if kind is dict:
        return {key: _undefer(item) for key, item in value.items()}
    return value


def release_sliced(value) -> None:
    """Empty the long lists in ``value`` (a decoded message's result, held nowhere else) a
    slice per call, from their ends. Why: freeing a list of 3.5M ids is one call of 70-110
    ms that holds the GIL throughout, in whichever thread drops the last reference; emptied
    a slice at a time, the event loop beside that thread gets its turn between slices."""
    items = value.values() if type(value) is dict else value if type(value) is list else ()
    for item in items:
        if type(item) is list and len(item) > SLICE:
            while item:
                del item[-SLICE:]


def _list_sliced(ids: array.array) -> list:
    out: list = []
    for start in range(0, len(ids), SLICE):
        out += ids[start:start + SLICE].tolist()
    return out


_DIGITS = re.compile(rb"-?[0-9]+")


_packb = msgpack.Packer(use_bin_type=True, default=_pack_default).pack


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame; the connection cannot be trusted.

    From :meth:`FrameDecoder.feed`, ``messages`` holds the valid messages that the same
    bytes completed before the bad one: a peer's last words before the garbage (a worker's
    outputs, say) are still its words."""

    messages: list = []  # (replaced, never appended to)
    #: From :meth:`FrameDecoder.frames`: the complete frames before an oversized one.
    frames: list[bytes] = []
    #: From :class:`Reader`: a malformed STEP's rows before its first bad one.
    partial: Step | None = None


class Oversized(Exception):
    """A SUBMIT or CALL (``kind``) that its reader's limits would not decode
    (:mod:`server.worker_protocol.limits`): refused as request ``ident``'s own error
    (``message``, for the client), the connection kept. Collected in
    :attr:`FrameDecoder.refused`, in the order they came."""

    def __init__(self, kind: int, ident: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.ident = ident
        self.message = message


def _enc_hook(value):
    """msgspec's ``enc_hook``: packed ids (a uint32 array, :func:`pack_ids`)."""
    if type(value) is array.array and value.typecode == _U32:
        if _SWAP:
            value = array.array(_U32, value)
            value.byteswap()
        return msgspec.msgpack.Ext(PACKED_IDS, value.tobytes())
    raise TypeError(f"cannot send a {type(value).__name__} to a worker")


_encode = msgspec.msgpack.Encoder(enc_hook=_enc_hook).encode


def encode(message: list | Message) -> bytes:
    """One message as one frame: a :class:`Message`, or the list it travels as (packed
    as it is, malformed ones included: a test's). A RESULT whose result is
    :class:`Packed` (packed beforehand by :func:`pack_sliced`) has it spliced in as it is:
    the same bytes.

    >>> FrameDecoder().feed(encode(Ping(7)))
    [[3, 7]]
    """
    typed = type(message) is not list
    items: list = as_list(message) if typed else message  # type: ignore[arg-type,assignment]
    if items[0] == RESULT and len(items) == 4 and type(items[2]) is Packed:
        body = b"".join((RESULT_HEAD, _packb(items[1]), items[2].data, _packb(items[3])))
    elif typed:
        try:
            body = _encode(items)
        except OverflowError:  # an integer beyond 64 bits, in a client's payload: BIG_INT
            body = _packb(items)
    else:
        body = _packb(items)
    return _HEADER.pack(len(body)) + body


#: The items of a long list that :func:`pack_sliced` packs per call: about 2 ms of msgpack.
SLICE = 16384

#: A RESULT message's first bytes: an array of four items, the first RESULT.
RESULT_HEAD = b"\x94" + msgpack.packb(RESULT)

_headers = msgpack.Packer(autoreset=True)


class Packed:
    """One value's msgpack bytes (from :func:`pack_sliced`), for :func:`encode`."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def pack_sliced(value) -> Packed:
    """``value`` (a RESULT's result) packed as :func:`encode` would pack it, the same
    bytes, but a list of more than :data:`SLICE` items (3.5M token ids) a slice per call.

    Why: msgpack holds the GIL for a whole call, 0.4 s for 3.5M ids; a worker packs such a
    reply in a preparation thread, slice by slice, so that its step loop gets the GIL
    between slices, and the loop's thread only writes the bytes."""
    parts: list = []
    _pack_into(value, parts)
    return Packed(b"".join(parts))


def _pack_into(value, parts: list) -> None:
    if type(value) is dict:
        parts.append(_headers.pack_map_header(len(value)))
        for key, item in value.items():
            parts.append(_packb(key))
            _pack_into(item, parts)
    elif type(value) is list and len(value) > SLICE:
        parts.append(_headers.pack_array_header(len(value)))
        for start in range(0, len(value), SLICE):
            piece = value[start:start + SLICE]
            head = len(_headers.pack_array_header(len(piece)))
            parts.append(memoryview(_packb(piece))[head:])
    else:
        parts.append(_packb(value))


#: A frame at least this large is decoded by :meth:`FrameDecoder.decode_sliced` (the
#: frontend: in a thread). msgpack holds the GIL for a whole call: 0.3 s for a RESULT of
#: 1.9M token ids, during which a thread beside the event loop stops it as surely as the
#: loop's own call; decoded an item (of a long list) per call, the loop gets its turn
#: every few milliseconds. Smaller frames take under a few milliseconds in one call.
BIG_FRAME = 1 << 20

def is_result(body: bytes) -> bool:
    """Whether a frame body starts as a RESULT message does (an array of four items, the
    first RESULT): an answer to one round trip, which the frontend may decode beside the
    frames after it (:mod:`server.manager.worker`); whether the rest is one is for the
    decoding to find."""
    return body.startswith(RESULT_HEAD)


#: First bytes of msgpack's array and map headers (fix, 16-bit and 32-bit counts).
ARRAY_HEADS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
MAP_HEADS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))
CONTAINER_HEADS = ARRAY_HEADS | MAP_HEADS

#: :func:`peek_kind`: the frame's first bytes are not all in yet.
MORE = -1
#: msgpack's integer formats after a one-byte marker: struct formats.
_INT_FORMATS = {
    0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
    0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
}


def peek_kind(buf: bytes | bytearray, start: int, end: int) -> int | None:
    """The message type of the frame body that starts at ``buf[start]`` (``buf[start:end]``
    arrived so far), from its first bytes, before the rest arrives: :data:`MORE` until
    enough are in (6 at most), None for a body that does not start as a message (an array
    of one item or more whose first is a type, a positive fixint: what :func:`encode` writes).

    >>> peek_kind(encode([PING, 7]), 4, 6), peek_kind(b"\\x90", 0, 1)
    (3, None)
    """
    if end <= start:
        return MORE
    first = buf[start]
    if 0x91 <= first <= 0x9F:
        at = start + 1
    elif first == 0xDC or first == 0xDD:
        at = start + (3 if first == 0xDC else 5)
        if end < at:
            return MORE
        if not any(buf[start + 1:at]):  # (an empty array)
            return None
    else:
        return None
    if at >= end:
        return MORE
    kind = buf[at]
    return kind if kind < 0x80 else None


def peek_head(body: bytes) -> tuple[int | None, int | None]:
    """A whole frame body's message type and, if its second item is an integer, that
    (a SUBMIT's rid, a CALL's seq), read from its first bytes without decoding the
    rest: ``(None, None)`` for what is not a message's start."""
    kind = peek_kind(body, 0, len(body))
    if kind is None or kind == MORE:
        return None, None
    first = body[0]
    if first <= 0x9F:
        count, at = first - 0x90, 2
    elif first == 0xDC:
        count, at = int.from_bytes(body[1:3], "big"), 4
    else:
        count, at = int.from_bytes(body[1:5], "big"), 6
    if count < 2 or at >= len(body):
        return kind, None
    marker = body[at]
    if marker < 0x80:
        return kind, marker
    if marker >= 0xE0:
        return kind, marker - 0x100
    fmt = _INT_FORMATS.get(marker)
    if fmt is None or len(body) < at + 1 + struct.calcsize(fmt):
        return kind, None
    return kind, struct.unpack_from(fmt, body, at + 1)[0]


def decode_sliced(body: bytes) -> object:
    """A frame body's msgpack value, as ``msgpack.unpackb`` decodes it (with this
    protocol's options), but walked: arrays and maps a header at a time, a list of more
    than :data:`SLICE` items an item per call, so that no one call holds the GIL for long.
    ProtocolError for what ``unpackb`` refuses (bad bytes, trailing bytes, a map key that
    is not a string)."""
    deferred = _Deferred()
    unpacker = msgpack.Unpacker(use_list=True, raw=False, ext_hook=deferred,
                                max_buffer_size=max(1, len(body)))
    unpacker.feed(body)
    try:
        value = _walk(unpacker, body, deferred)
        if unpacker.tell() != len(body):
            raise ValueError("extra data after the message")
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack's errors, a RecursionError of absurd nesting
        raise ProtocolError(f"undecodable frame: {exc!r:.200}") from None
    return value


def _walk(unpacker: msgpack.Unpacker, body: bytes, deferred: _Deferred) -> object:
    if unpacker.tell() >= len(body):
        raise ValueError("the frame ends inside its message")
    first = body[unpacker.tell()]
    if first in ARRAY_HEADS:
        count = unpacker.read_array_header()
        if count > SLICE:  # (a long list's items are small: token ids, rows)
            unpack = unpacker.unpack
            before = deferred.count
            items = [unpack() for _ in range(count)]
            if deferred.count != before:  # (packed ids among them, at any depth)
                items = _undefer(items)
            return items
        return [_walk(unpacker, body, deferred) for _ in range(count)]
    if first in MAP_HEADS:
        out = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if type(key) is not str and type(key) is not bytes:  # (unpackb's strict keys)
                raise ValueError(f"a map key of type {type(key).__name__}")
            out[key] = _walk(unpacker, body, deferred)
        return out
    value = unpacker.unpack()
    return _list_sliced(value) if type(value) is array.array else value


class FrameDecoder:
    """Turns the bytes of a pipe, in pieces of any size, into messages.

    ``feed`` returns the messages completed by the new bytes (often none, sometimes many):
    with a ``reader`` (:class:`Reader`, such as :data:`REPLIES`), each decoded into its type
    (:mod:`server.worker_protocol.messages`), or :class:`ProtocolError`; without one, as
    lists (a test's, or a reader of any message). With ``limits`` (a
    :class:`server.worker_protocol.limits.Limits`: a reader whose peer may be hostile), a
    frame longer than its type allows is refused from its first bytes, a big one is
    decoded within the limits' budget, and a request over it is not returned but put in
    :attr:`refused` (:class:`Oversized`) for its reader to answer.
    """

    __slots__ = ("_buf", "reader", "limits", "refused")

    def __init__(self, reader: Reader | Callable[[list], object] | None = None,
                 limits=None) -> None:
        self._buf = bytearray()
        #: What the peer may send (None: any list); may be replaced between feeds (a
        #: handshake's, then a connection's).
        self.reader = reader
        #: The bounds of what a frame may cost (None: MAX_FRAME only); may be replaced
        #: between feeds (a handshake's, then a connection's).
        self.limits = limits
        #: The requests refused by the limits, for the reader to answer and clear.
        self.refused: list[Oversized] = []

    def feed(self, data: bytes | bytearray) -> list:
        error: ProtocolError | None = None
        try:
            bodies = self.frames(data)
        except ProtocolError as exc:
            bodies, error = exc.frames, exc
        messages: list = []
        try:
            for body in bodies:
                try:
                    messages.append(self.decode(body))
                except Oversized as refusal:
                    self.refused.append(refusal)
        except ProtocolError as exc:
            if exc.partial is not None:  # a STEP's rows before its bad one
                messages.append(exc.partial)
            exc.messages = messages  # the good ones before the bad one
            raise
        if error is not None:
            error.messages = messages
            raise error
        return messages

    def frames(self, data: bytes | bytearray) -> list[bytes]:
        """The bodies of the frames completed by ``data``, undecoded (:meth:`decode` or
        :func:`decode_sliced` each). A length over :data:`MAX_FRAME` raises
        :class:`ProtocolError`, whose ``frames`` are the complete ones before it."""
        buf = self._buf
        buf += data
        bodies: list[bytes] = []
        pos = 0
        end = len(buf)
        limits = self.limits
        while end - pos >= 4:
            (length,) = _HEADER.unpack_from(buf, pos)
            if length > MAX_FRAME:
                exc = ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME} limit")
                exc.frames = bodies
                raise exc
            if limits is not None and length > limits.least:
                kind = peek_kind(buf, pos + 4, end)
                if kind == MORE:
                    break
                cap = limits.cap(kind)
                if length > cap:
                    what = NAMES.get(kind, f"type {kind}") if kind is not None else (
                        "non-message")
                    exc = ProtocolError(f"a {what} frame of {length} bytes exceeds its "
                                        f"limit of {cap}")
                    exc.frames = bodies
                    raise exc
            if end - pos - 4 < length:
                break
            start = pos + 4
            bodies.append(bytes(buf[start : start + length]))
            pos = start + length
        if pos:
            del buf[:pos]
        return bodies

    def decode(self, body: bytes) -> Any:
        """One frame's message; ProtocolError if it is not one (with limits:
        :class:`Oversized` for a request over them)."""
        reader = self.reader
        limits = self.limits
        if limits is not None and limits.walks(body):
            message = limits.decode(body)
        elif isinstance(reader, Reader):
            return reader.decode(body)
        else:
            try:
                message = msgpack.unpackb(body, use_list=True, raw=False,
                                          ext_hook=_unpack_ext)
            except Exception as exc:
                raise ProtocolError(f"undecodable frame: {exc}") from None
        return self._checked(message)

    def decode_sliced(self, body: bytes) -> Any:
        """:meth:`decode`, the same message, but a list of more than :data:`SLICE` items
        an item per call (:func:`decode_sliced`): for a frame of :data:`BIG_FRAME` or more,
        in a thread beside an event loop."""
        return self._checked(decode_sliced(body))

    def _checked(self, message: object) -> Any:
        reader = self.reader
        if isinstance(reader, Reader):
            return reader.convert(message)
        if type(message) is not list or not message or type(message[0]) is not int:
            raise ProtocolError(f"malformed message: {clip(message)}")
        if reader is not None:
            reader(message)  # type: ignore[operator]
        return message

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


# -- readers: what each side takes, typed ---------------------------------------------------

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxlist = _repr.maxdict = 6
_repr.maxstring = _repr.maxother = 40
_repr.maxlong = 24


def clip(message: object) -> str:
    """A bounded repr of a peer's message, for a log line (a 64 MiB frame stays short)."""
    text = _repr.repr(message)
    return text if len(text) <= 200 else text[:197] + "..."


def malformed(message: object) -> ProtocolError:
    """The error for a ``message`` of a known type with a wrong shape."""
    kind = message[0] if type(message) is list else message.kind  # type: ignore[attr-defined]
    if type(message) is not list:
        message = as_list(message)  # type: ignore[arg-type]
    return ProtocolError(f"malformed {NAMES[kind]}: {clip(message)}")


_astuple = msgspec.structs.astuple


def as_list(message: Message) -> list:
    """``message`` as the array it travels as (its absent items left out: they come last,
    but for a PONG's ``mine``, absent before the statistics that take its place)."""
    items = [message.kind, *_astuple(message)]
    if UNSET in items:
        return [item for item in items if item is not UNSET]
    return items


class Reader:
    """The messages one side takes from its peer at one point (after the handshake: a
    worker's requests, a frontend's replies; during it: one type), decoded straight into
    their types (:mod:`server.worker_protocol.messages`), shapes checked on the way.

    What is not one of them raises :class:`ProtocolError`: "unexpected NAME" for a type
    not taken here, "malformed NAME: <the message, clipped>" for a wrong shape,
    "malformed message" for what is not a message, "undecodable frame" for what is not
    msgpack. From a STEP whose accepts and notes are well formed, the error keeps the
    output rows before the first bad one (``partial``), as the frames before a bad frame
    are kept: they reached the frontend before the garbage did."""

    __slots__ = ("types", "kinds", "lists", "_decoder", "_union")

    def __init__(self, *types: type[Message], lists: bool = False) -> None:
        self.types = {t.kind: t for t in types}
        self.kinds = frozenset(self.types)
        #: Whether it hands each message on as the list it travels as (:func:`as_list`),
        #: checked as its type: for a reader written for lists (the worker loops).
        self.lists = lists
        self._union = Union[types]  # type: ignore[valid-type]
        self._decoder = msgspec.msgpack.Decoder(self._union, ext_hook=_unpack_ext)

    def as_lists(self) -> Reader:
        """This reader, handing messages on as lists."""
        return Reader(*self.types.values(), lists=True)

    def __contains__(self, kind: object) -> bool:
        return kind in self.kinds

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.kinds))

    def decode(self, body: bytes | bytearray) -> Message:
        """One frame body's message."""
        try:
            message = self._decoder.decode(body)
            return as_list(message) if self.lists else message  # type: ignore[return-value]
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            try:
                message = msgpack.unpackb(body, use_list=True, raw=False,
                                          ext_hook=_unpack_ext)
            except Exception:
                raise ProtocolError(f"undecodable frame: {str(exc):.200}") from None
            raise self._refusal(message) from None

    def convert(self, message: object) -> Message:
        """A message already decoded as lists and maps (:func:`decode_sliced`, the
        limits' walk), typed as :meth:`decode` types it."""
        try:
            typed = msgspec.convert(message, self._union)
        except (msgspec.ValidationError, ValueError, TypeError):
            raise self._refusal(message) from None
        return as_list(typed) if self.lists else typed  # type: ignore[return-value]

    def _refusal(self, message: object) -> ProtocolError:
        if type(message) is not list or not message or type(message[0]) is not int:
            return ProtocolError(f"malformed message: {clip(message)}")
        kind = message[0]
        if kind not in self.kinds:
            name = NAMES.get(kind)
            return ProtocolError(
                f"unexpected message type {kind!r}" if name is None else f"unexpected {name}")
        error = malformed(message)
        if kind == STEP and 3 <= len(message) <= 4 and type(message[2]) is list:
            error.partial = _salvage(message)
        return error


def _salvage(message: list) -> Step | None:
    """A malformed STEP's accepts and notes, with its output rows before the first bad one
    (None if its accepts or notes are bad)."""
    try:
        step = msgspec.convert([STEP, message[1], [], *message[3:]], Step)
    except (msgspec.ValidationError, ValueError, TypeError):
        return None
    for item in message[2]:
        try:
            row = msgspec.convert(item, OutputRow)
        except (msgspec.ValidationError, ValueError, TypeError):
            break
        if not final_ok(row.finish, row.error):
            break
        step.outputs.append(row)
    return step


#: What a pipe worker takes from its frontend.
REQUESTS = Reader(PipeSubmit, Abort, Ping, Call, Shutdown)
#: What a listening worker takes from a frontend once it authenticated: SUBSCRIBE too, and
#: a SUBMIT with block names (:data:`ROUTED_KEY`).
LISTENER_REQUESTS = Reader(Submit, Abort, Ping, Call, Shutdown, Subscribe)
#: What a frontend takes from a worker after its HELLO. A STEP's rows are typed; whether
#: each row's ``finish`` and ``err`` agree (:func:`final_ok`) is for its reader to check
#: as it reads them (the router: one pass over the rows).
REPLIES = Reader(Step, Pong, Result, Leaving)

_ALL: dict[int, type[Message]] = {
    HELLO: Hello, SUBMIT: PipeSubmit, ABORT: Abort, PING: Ping, PONG: Pong,
    SHUTDOWN: Shutdown, STEP: Step, CALL: Call, RESULT: Result, CHALLENGE: Challenge,
    AUTH: Auth, REFUSED: Refused, SUBSCRIBE: Subscribe, PART: Part, LEAVING: Leaving,
}


@functools.lru_cache(maxsize=None)
def reader(*kinds: int) -> Reader:
    """The reader of messages of ``kinds`` (the handshake's: one or two types)."""
    return Reader(*(_ALL[kind] for kind in kinds))


def _rules(message: list, typed: Message, rows: bool = True) -> list:
    """``message`` (a list, ``typed`` as its reader typed it) if a STEP's notes, and with
    ``rows`` its output rows, keep the rules across their items (:func:`note_ok`,
    :func:`final_ok`); else :func:`malformed`."""
    if type(typed) is Step:
        if typed.notes is not UNSET and not all(note_ok(*note) for note in typed.notes):
            raise malformed(message)
        if rows and not all(final_ok(row.finish, row.error) for row in typed.outputs):
            raise malformed(message)
    return message


def check(message: list, allowed: Iterable[int]) -> list:
    """``message`` (a decoded list) if it is of one of the ``allowed`` types and has that
    type's shape; else :class:`ProtocolError` saying which.

    >>> check([PING, 7], REQUESTS)
    [3, 7]
    >>> check([PONG, 7], REPLIES)
    Traceback (most recent call last):
    ...
    server.worker_protocol.wire.ProtocolError: malformed PONG: [4, 7]
    """
    read = allowed if isinstance(allowed, Reader) else reader(*sorted(allowed))
    return _rules(message, read.convert(message))


def check_request(message: list) -> list:
    """A message from a frontend to a pipe worker: one of :data:`REQUESTS`, well formed."""
    REQUESTS.convert(message)
    return message


def check_listener_request(message: list) -> list:
    """A message from a frontend to a listening worker: one of :data:`LISTENER_REQUESTS`."""
    LISTENER_REQUESTS.convert(message)
    return message


def check_reply(message: list, *, rows: bool = True) -> list:
    """A message from a worker after its HELLO: one of :data:`REPLIES`, well formed; with
    ``rows=False`` a STEP's output rows only a list (the caller checks each)."""
    if not rows and type(message) is list and message and message[0] == STEP and (
            3 <= len(message) <= 4 and type(message[2]) is list):
        return _rules(message, REPLIES.convert([STEP, message[1], [], *message[3:]]))
    return _rules(message, REPLIES.convert(message))
