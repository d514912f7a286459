"""The worker wire protocol, sans-IO: frames in, messages out, and back. No trio here.

Theory of operation
-------------------
Each direction of the pipe carries *frames*: a 4-byte big-endian length, then that many bytes
of msgpack. Every frame holds one message, a list whose first item is the message type. The
frontend may write several frames in one ``write``; the worker writes at most one STEP frame
per loop iteration, however many requests advanced in it. See ``docs/protocol.md``.

Frontend -> worker::

    [SUBMIT, rid, prompt, params]   prompt: str, list[int], or {"messages": [...]} for chat
    [SUBMIT, rid, prompt, params, adapter]   run with the LoRA adapter of that name
    [SUBMIT, rid, prompt, params, adapter | nil, names]   to a listening worker whose HELLO
                                    says "routed_notices": the prompt's block names, which
                                    it passes on to its other frontends (ROUTED_KEY)
    [SUBSCRIBE, ["routed/N"]]       to such a worker: send me the others' routed notices
                                    of block naming N (and take my names as of naming N)
    [SUBSCRIBE, ["parts"]]          to a listening worker whose HELLO says "answer_parts": send
                                    me big answers in PART frames (PARTS_KEY); one
                                    SUBSCRIBE may name both topics
    [ABORT, rid]                    unknown or finished rid: a no-op
    [PING, seq]
    [TOKENIZE, seq, request]        {"op": "tokenize", "prompt": str | {"messages": [...]},
                                    "add_special_tokens": bool} or {"op": "detokenize",
                                    "tokens": [int, ...]} or {"op": "info"} or
                                    {"op": "embed", "input": [str | [int, ...], ...],
                                    "dimensions": int | None} or {"op": "load_lora",
                                    "name": str, "path": str} or {"op": "unload_lora",
                                    "name": str} (server.workers.lora)
    [SHUTDOWN]

Worker -> frontend::

    [HELLO, info]                   once, when the engine is loaded (info: dict)
    [STEP, accepts, outputs]        accepts: [[rid, prompt_tokens], ...]
                                    outputs: [[rid, text, ntok, finish, err], ...]
    [STEP, accepts, outputs, notes] notes: [[rid, {"cached_tokens": n}], ...], only when
                                    the engine has any (they precede the outputs); also
                                    {"token_ids": [...]}: the ids of the row's new tokens,
                                    for a request whose params ask (``token_ids: true``);
                                    {"prompt_token_ids": [...]}: the prompt's, once, for a
                                    request whose params ask (``prompt_token_ids: true``);
                                    [nil, {"kv_events": [...]}]: no request's, the blocks
                                    the engine's KV cache stored and removed in this
                                    step (server.worker_protocol.kv_blocks);
                                    [nil, {"routed": [name, ...]}]: another frontend
                                    sent this worker a prompt of those blocks
    [PONG, seq, running, waiting]   seq 0: unasked, while one engine step runs long (the
                                    worker's pulse); a listening worker adds the requests
                                    this connection holds;
                                    an engine that reports its own statistics (vllm) adds
                                    a map last: ENGINE_STATS
    [TOKENIZED, seq, result, err]   result: {"tokens": [...], "max_model_len": n},
                                    {"prompt": str} or {"data": [float32 LE bytes, ...],
                                    "prompt_tokens": n}; or err: [kind, message] (or
                                    [kind, message, param]: see ERROR_PARAM_KEY)
    [PART, data, more]              a worker asked for parts (a pipe worker by its
                                    argument, a listening one by SUBSCRIBE) sends a
                                    TOKENIZED of BIG_FRAME or more as the pieces of its
                                    body, between its STEPs (server.worker_protocol.parts)

A worker started with ``--listen`` opens each connection with a handshake first
(CHALLENGE, AUTH, then HELLO or REFUSED; see :mod:`server.worker_protocol.handshake`).

The rows of a STEP are :class:`AcceptRow` and :class:`OutputRow` (sent as arrays in their
field order; the frontend unpacks them in that order). In an output, ``finish`` is None or
one of stop/length/abort/error and ``err`` is None or ``[kind, message]`` (kinds in
:data:`server.errors.WIRE_KINDS`), or ``[kind, message, param]`` (the client's field at
fault, or nil) for a request whose params asked with :data:`ERROR_PARAM_KEY` (a TOKENIZED's
``err`` too, for a TOKENIZE request that asked). A request that is rejected
(client fault, such as a prompt over the context limit) gets a terminal output with
``finish="error"`` and no accept. An abort of a request the worker holds is answered by a
terminal ``abort`` output in the worker's next frame; of any other rid, by nothing.

Integers beyond msgpack's 64 bits (legal in JSON payloads the frontend passes on: tool-call
arguments, schemas, template variables) travel as the extension type :data:`BIG_INT`, their
decimal digits, and come out as the same ``int``.

*Packed ids.* A long list of token ids (:data:`PACK_MIN` or more, each below 2**32) may
travel as the extension type :data:`PACKED_IDS`, little-endian uint32s, and comes out as
the same ``list`` of ints: the sender wraps it with :func:`pack_ids`, and only towards a
peer that can read it (a worker says ``"packed_ids": true`` in its HELLO,
:func:`hello_info`; a frontend asks for a packed /tokenize answer with ``"packed_ids":
true`` in the TOKENIZE request). 3.5M ids decode in a few hundred milliseconds of
``array.tolist`` instead of seconds of msgpack item by item (:func:`decode_sliced`), and
pack in a ``memcpy``. A payload whose length is not a multiple of 4 is a protocol violation.

A peer that sends a frame over :data:`MAX_FRAME`, or bytes that are not msgpack, is broken:
:class:`ProtocolError` is raised and the connection must be dropped.

*Shapes.* Every message a side receives is checked against the table above before anything
reads it: :func:`check_request` (what a worker accepts from a frontend),
:func:`check_reply` (what a frontend accepts from a worker once it said HELLO) and
:func:`check` (the handshake's messages). A message of a type the receiver does not expect
there, with the wrong number of items, or an item of the wrong type (a rid that is not an
integer, a row that is not ``[rid, text, ntok, finish, err]``, a count below zero, an
``err`` that is not ``[kind, message]`` or ``[kind, message, param]``...) raises
:class:`ProtocolError`, whose text names the message and shows it clipped: the receiver
ends that connection only. The *content* of a
well-formed SUBMIT or TOKENIZE (the prompt's items, the params' values) is the engine's to
judge: it answers a request it cannot take with an error output, as for any client fault.
"""

from __future__ import annotations

import array
import functools
import operator
import reprlib
import re
import struct
import sys
from typing import Callable, Iterable, NamedTuple

import msgpack

from .kv_blocks import CLEARED, DIGEST_BYTES, REMOVED, STORED

__all__ = [
    "AcceptRow",
    "OutputRow",
    "HELLO",
    "SUBMIT",
    "ABORT",
    "PING",
    "PONG",
    "SHUTDOWN",
    "STEP",
    "TOKENIZE",
    "TOKENIZED",
    "CHALLENGE",
    "AUTH",
    "REFUSED",
    "SUBSCRIBE",
    "PART",
    "TOKENIZED_HEAD",
    "clip",
    "ROUTED_KEY",
    "ROUTED_MAX",
    "PARTS_KEY",
    "PARTS_TOPIC",
    "routed_topic",
    "MAX_FRAME",
    "PACKED_IDS",
    "PACK_MIN",
    "pack_ids",
    "hello_info",
    "ERROR_PARAM_KEY",
    "error",
    "ENGINE_STATS",
    "ITERATION_TOKEN_BUCKETS",
    "ProtocolError",
    "Oversized",
    "FrameDecoder",
    "peek_kind",
    "peek_head",
    "unpack_ext",
    "encode",
    "pack_sliced",
    "decode_sliced",
    "release_sliced",
    "is_tokenized",
    "BIG_FRAME",
    "Packed",
    "SLICE",
    "FINISHES",
    "REQUESTS",
    "REPLIES",
    "check",
    "check_request",
    "check_listener_request",
    "check_reply",
]


class AcceptRow(NamedTuple):
    """The engine took request ``rid``; its prompt is ``prompt_tokens`` tokens long."""

    rid: int
    prompt_tokens: int


class OutputRow(NamedTuple):
    """What one request produced since the previous STEP of its worker."""

    rid: int
    #: New text (detokenized, stop strings applied).
    text: str
    #: New tokens.
    ntok: int
    #: None while it runs, else "stop", "length", "abort" or "error".
    finish: str | None
    #: ``[kind, message]`` when ``finish == "error"`` (kinds: server.errors.WIRE_KINDS).
    error: list | None

HELLO = 0
SUBMIT = 1
ABORT = 2
PING = 3
PONG = 4
SHUTDOWN = 5
STEP = 6
TOKENIZE = 7
TOKENIZED = 8
# The handshake of a connection to a listening worker (server.worker_protocol.handshake).
CHALLENGE = 9
AUTH = 10
REFUSED = 11
#: Frontend -> listening worker: the notices it wants (see ROUTED_KEY).
SUBSCRIBE = 12
#: Pipe worker -> frontend that asked for parts: a piece of a big TOKENIZED frame's body
#: (server.worker_protocol.parts).
PART = 13

#: The key of a listening worker's HELLO info saying that it takes a SUBMIT's block names
#: and passes them on, as the worker note ``{"routed": [name, ...]}``, to every other
#: frontend that subscribed to the same naming (``[SUBSCRIBE, [routed_topic(N)]]``, N the
#: version of the frontend's block naming): a *routed notice*, so that each frontend's
#: routing prediction knows what the others sent it (docs/routing.md).
ROUTED_KEY = "routed_notices"
#: The most block names a SUBMIT carries (a prompt's first ones; the prediction index's
#: capacity, server.manager.routing.DEFAULT_CAPACITY: 128 KiB of names).
ROUTED_MAX = 16384
#: What a frontend may subscribe to: the routed notices of one block naming (a version,
#: 1 to 999999; a SUBSCRIBE names one at most).
_ROUTED_TOPIC = re.compile(r"routed/[1-9][0-9]{0,5}")
#: The most topics one SUBSCRIBE names.
_MAX_TOPICS = 8
#: The key of a listening worker's HELLO info saying that a frontend may subscribe to
#: :data:`PARTS_TOPIC`: its big answers then come as PART frames between the STEPs of its
#: other streams (server.worker_protocol.parts), not whole, ahead of them.
PARTS_KEY = "answer_parts"
PARTS_TOPIC = "parts"


def routed_topic(naming: int) -> str:
    """The topic of the routed notices whose block names are of version ``naming``: a
    worker passes a SUBMIT's names only to the frontends subscribed to its sender's topic,
    so that frontends naming blocks differently never mix their predictions."""
    return f"routed/{naming}"


def _subscribe(m: list) -> bool:
    """A SUBSCRIBE: 1 to _MAX_TOPICS known topics (:data:`PARTS_TOPIC`, routed ones), one
    naming's routed notices at most (a connection's names are of one naming)."""
    topics = m[1] if len(m) == 2 else None
    if type(topics) is not list or not 0 < len(topics) <= _MAX_TOPICS:
        return False
    routed = sum(type(t) is str and _ROUTED_TOPIC.fullmatch(t) is not None for t in topics)
    return routed <= 1 and routed + topics.count(PARTS_TOPIC) == len(topics)

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
#: The key of a HELLO's info (and of a TOKENIZE request) saying the sender reads PACKED_IDS.
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


#: The key of a SUBMIT's params and of a TOKENIZE request saying the frontend reads an
#: ``err`` of three items, ``[kind, message, param]`` (:func:`error`). A worker sends the
#: third item only to a request that asks, so that an older frontend (which ends the
#: connection on a three-item ``err``) keeps working; an older worker ignores the key.
ERROR_PARAM_KEY = "error_param"


def error(kind: str, message: str, param: str | None, request: object) -> list:
    """The ``err`` of a refusal answering ``request`` (a SUBMIT's params, a TOKENIZE
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


def _ids_array(data: bytes) -> array.array:
    if len(data) % 4:
        raise ValueError(f"packed ids of {len(data)} bytes (not a multiple of 4)")
    ids = array.array(_U32)
    ids.frombytes(data)
    if _SWAP:
        ids.byteswap()
    return ids


def unpack_ext(code: int, data: bytes):
    """msgpack's ``ext_hook``: this protocol's extension values (BIG_INT, PACKED_IDS)."""
    return _unpack_ext(code, data)


def _unpack_ext(code: int, data: bytes):
    if code == PACKED_IDS:
        return _ids_array(data).tolist()
    if code != BIG_INT or len(data) > _MAX_BIG_INT_DIGITS or not _DIGITS.fullmatch(data):
        raise ValueError(f"bad extension value (type {code})")
    return int(data)


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

    messages: list[list] = []  # (replaced, never appended to)
    #: From :meth:`FrameDecoder.frames`: the complete frames before an oversized one.
    frames: list[bytes] = []


class Oversized(Exception):
    """A SUBMIT or TOKENIZE (``kind``) that its reader's limits would not decode
    (:mod:`server.worker_protocol.limits`): refused as request ``ident``'s own error
    (``message``, for the client), the connection kept. Collected in
    :attr:`FrameDecoder.refused`, in the order they came."""

    def __init__(self, kind: int, ident: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.ident = ident
        self.message = message


def encode(message: list) -> bytes:
    """One message as one frame. A TOKENIZED whose result is :class:`Packed` (packed
    beforehand by :func:`pack_sliced`) has it spliced in as it is: the same bytes. Any
    other list, malformed ones included (a test's), is packed as it is.

    >>> FrameDecoder().feed(encode([PING, 7]))
    [[3, 7]]
    """
    if message[0] == TOKENIZED and len(message) == 4 and type(message[2]) is Packed:
        body = b"".join((TOKENIZED_HEAD, _packb(message[1]), message[2].data,
                         _packb(message[3])))
    else:
        body = _packb(message)
    return _HEADER.pack(len(body)) + body


#: The items of a long list that :func:`pack_sliced` packs per call: about 2 ms of msgpack.
SLICE = 16384

#: A TOKENIZED message's first bytes: an array of four items, the first TOKENIZED.
TOKENIZED_HEAD = b"\x94" + msgpack.packb(TOKENIZED)

_headers = msgpack.Packer(autoreset=True)


class Packed:
    """One value's msgpack bytes (from :func:`pack_sliced`), for :func:`encode`."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def pack_sliced(value) -> Packed:
    """``value`` (a TOKENIZED's result) packed as :func:`encode` would pack it, the same
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
#: frontend: in a thread). msgpack holds the GIL for a whole call: 0.3 s for a TOKENIZED of
#: 1.9M token ids, during which a thread beside the event loop stops it as surely as the
#: loop's own call; decoded an item (of a long list) per call, the loop gets its turn
#: every few milliseconds. Smaller frames take under a few milliseconds in one call.
BIG_FRAME = 1 << 20

def is_tokenized(body: bytes) -> bool:
    """Whether a frame body starts as a TOKENIZED message does (an array of four items, the
    first TOKENIZED): an answer to one round trip, which the frontend may decode beside the
    frames after it (:mod:`server.manager.worker`); whether the rest is one is for the
    decoding to find."""
    return body.startswith(TOKENIZED_HEAD)


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
    (a SUBMIT's rid, a TOKENIZE's seq), read from its first bytes without decoding the
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

    ``feed`` returns the messages completed by the new bytes (often none, sometimes many).
    With ``check`` (such as :func:`check_request`), each message must pass it too. With
    ``limits`` (a :class:`server.worker_protocol.limits.Limits`: a reader whose peer may
    be hostile), a frame longer than its type allows is refused from its first bytes, a
    big one is decoded within the limits' budget, and a request over it is not returned
    but put in :attr:`refused` (:class:`Oversized`) for its reader to answer.
    """

    __slots__ = ("_buf", "_check", "limits", "refused")

    def __init__(self, check: Callable[[list], object] | None = None, limits=None) -> None:
        self._buf = bytearray()
        #: Applied to each message (raising ProtocolError), e.g. :func:`check_request`.
        self._check = check
        #: The bounds of what a frame may cost (None: MAX_FRAME only); may be replaced
        #: between feeds (a handshake's, then a connection's).
        self.limits = limits
        #: The requests refused by the limits, for the reader to answer and clear.
        self.refused: list[Oversized] = []

    def feed(self, data: bytes | bytearray) -> list[list]:
        error: ProtocolError | None = None
        try:
            bodies = self.frames(data)
        except ProtocolError as exc:
            bodies, error = exc.frames, exc
        messages: list[list] = []
        try:
            for body in bodies:
                try:
                    messages.append(self.decode(body))
                except Oversized as refusal:
                    self.refused.append(refusal)
        except ProtocolError as exc:
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
                    what = _NAMES.get(kind, f"type {kind}") if kind is not None else (
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

    def decode(self, body: bytes) -> list:
        """One frame's message (checked); ProtocolError if it is not one (with limits:
        :class:`Oversized` for a request over them)."""
        if self.limits is not None:
            return self._checked(self.limits.decode(body))
        try:
            message = msgpack.unpackb(body, use_list=True, raw=False, ext_hook=_unpack_ext)
        except Exception as exc:
            raise ProtocolError(f"undecodable frame: {exc}") from None
        return self._checked(message)

    def decode_sliced(self, body: bytes) -> list:
        """:meth:`decode`, the same message, but a list of more than :data:`SLICE` items
        an item per call (:func:`decode_sliced`): for a frame of :data:`BIG_FRAME` or more,
        in a thread beside an event loop."""
        return self._checked(decode_sliced(body))

    def _checked(self, message: object) -> list:
        if type(message) is not list or not message or type(message[0]) is not int:
            raise ProtocolError(f"malformed message: {clip(message)}")
        if self._check is not None:
            self._check(message)
        return message

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


# -- shapes ------------------------------------------------------------------------------------

#: The ``finish`` of a terminal output row (None while the request runs).
FINISHES = frozenset({"stop", "length", "abort", "error"})
#: What a worker accepts from a frontend (after the handshake).
REQUESTS = frozenset({SUBMIT, ABORT, PING, TOKENIZE, SHUTDOWN})
#: What a frontend accepts from a worker after its HELLO.
REPLIES = frozenset({STEP, PONG, TOKENIZED})

_NAMES = {
    HELLO: "HELLO", SUBMIT: "SUBMIT", ABORT: "ABORT", PING: "PING", PONG: "PONG",
    SHUTDOWN: "SHUTDOWN", STEP: "STEP", TOKENIZE: "TOKENIZE", TOKENIZED: "TOKENIZED",
    CHALLENGE: "CHALLENGE", AUTH: "AUTH", REFUSED: "REFUSED", SUBSCRIBE: "SUBSCRIBE",
    PART: "PART",
}

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxlist = _repr.maxdict = 6
_repr.maxstring = _repr.maxother = 40
_repr.maxlong = 24


def clip(message: object) -> str:
    """A bounded repr of a peer's message, for a log line (a 64 MiB frame stays short)."""
    text = _repr.repr(message)
    return text if len(text) <= 200 else text[:197] + "..."


def _count(x: object) -> bool:
    return type(x) is int and x >= 0  # type(): a bool is not a count (nor a rid)


def _error(x: object) -> bool:
    """``[kind, message]``, or ``[kind, message, param]`` (a string or nil: see
    :func:`error`)"""
    return (type(x) is list and (len(x) == 2 or (len(x) == 3 and (x[2] is None
                                                                   or type(x[2]) is str)))
            and type(x[0]) is str and type(x[1]) is str)


def _all(rows: object, row_ok: Callable[[object], bool]) -> bool:
    return type(rows) is list and all(map(row_ok, rows))


def _accept_row(r: object) -> bool:
    return type(r) is list and len(r) == 2 and type(r[0]) is int and _count(r[1])


def final_ok(finish: object, err: object) -> bool:
    """A terminal output row's ``finish`` and ``err`` (``finish`` is not None)."""
    if finish == "error":
        return _error(err)
    return err is None and type(finish) is str and finish in FINISHES


def _output_rows(rows: object) -> bool:
    """Every row ``[rid, text, ntok, finish, err]``. The frontend's router does not call
    this: it checks each row as it routes it, with the same tests (see
    ``server.manager.worker``), and :func:`check_reply` with ``rows=False``."""
    if type(rows) is not list:
        return False
    for r in rows:
        if type(r) is not list or len(r) != 5:
            return False
        rid, text, ntok, finish, err = r
        if type(rid) is not int or type(text) is not str or type(ntok) is not int or ntok < 0:
            return False
        if err is not None if finish is None else not final_ok(finish, err):
            return False
    return True


def _number(x: object) -> bool:
    return x is None or type(x) is float or type(x) is int


def _logprob_entry(e: object) -> bool:
    """``[text, logprob or nil, [[alt_text, alt_logprob], ...]]``, or with the ids (and the
    chosen token's rank): ``[text, logprob, [[alt_text, alt_logprob, alt_id], ...], id,
    rank]`` (alternatives best first: their ranks are 1, 2, ...)."""
    if type(e) is not list:
        return False
    if len(e) == 3:
        return type(e[0]) is str and _number(e[1]) and _all(
            e[2], lambda a: type(a) is list and len(a) == 2 and type(a[0]) is str
            and _number(a[1]))
    return (
        len(e) == 5 and type(e[0]) is str and _number(e[1]) and _count(e[3])
        and (e[4] is None or _count(e[4]))
        and _all(e[2], lambda a: type(a) is list and len(a) == 3 and type(a[0]) is str
                 and _number(a[1]) and _count(a[2]))
    )


_is_int_type = functools.partial(operator.is_, int)


def _ids(v: object) -> bool:
    """A list of ints (no bools). All in C: this runs for every token when ids are asked."""
    return type(v) is list and all(map(_is_int_type, map(type, v)))


def _nonnegative(x: object) -> bool:
    return (type(x) is float or type(x) is int) and x >= 0


def _map_of(items: dict[str, Callable[[object], bool]], x: object, every: bool = False) -> bool:
    """A map whose keys are all ``items``'s (all of them, with ``every``), each value as
    its check says."""
    if type(x) is not dict or (every and len(x) != len(items)):
        return False
    for key, value in x.items():
        ok = items.get(key) if type(key) is str else None
        if ok is None or not ok(value):
            return False
    return True


#: A note's ``times``: the engine's own times of a finished request, in seconds.
_TIMES: dict[str, Callable[[object], bool]] = dict.fromkeys(
    ("queue", "prefill", "decode", "inference"), _nonnegative
)

_NOTE_ITEMS: dict[str, Callable[[object], bool]] = {
    "token_ids": _ids,
    "prompt_token_ids": _ids,
    "cached_tokens": _count,
    "logprobs": lambda v: _all(v, _logprob_entry),
    "prompt_logprobs": lambda v: _all(v, _logprob_entry),
    "times": lambda v: _map_of(_TIMES, v, every=True),
}

#: Upper bounds of the tokens-per-engine-step histogram of a PONG's ``iteration_tokens``
#: (vLLM's ``iteration_tokens`` buckets).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

#: The keys of a PONG's engine statistics (the engine's own, vllm only; every key optional):
#: ``kv_cache_usage`` (0..1, after the latest step), ``deferred`` (of the waiting requests,
#: those waiting for something other than a batch slot), ``preemptions`` (since the
#: engine started), ``iteration_tokens`` (since the engine started: how many steps
#: processed up to each bound of ITERATION_TOKEN_BUCKETS, one more slot for those above,
#: then the sum of all their tokens).
ENGINE_STATS: dict[str, Callable[[object], bool]] = {
    "kv_cache_usage": lambda v: _nonnegative(v) and v <= 1,  # type: ignore[operator]
    "deferred": _count,
    "preemptions": _count,
    "iteration_tokens": lambda v: type(v) is list
    and len(v) == len(ITERATION_TOKEN_BUCKETS) + 2 and all(map(_count, v)),
}


def _digests(v: object) -> bool:
    return type(v) is list and all(type(d) is bytes and len(d) == DIGEST_BYTES for d in v)


def _kv_event(e: object) -> bool:
    """``[STORED, [digest, ...]]``, ``[REMOVED, [digest, ...]]`` or ``[CLEARED]``
    (server.worker_protocol.kv_blocks)."""
    if type(e) is not list or not e:
        return False
    if e[0] == CLEARED:
        return len(e) == 1
    return len(e) == 2 and (e[0] == STORED or e[0] == REMOVED) and _digests(e[1])


#: The items of a note not tied to a request (its rid is nil): the worker's own news.
_WORKER_NOTE_ITEMS: dict[str, Callable[[object], bool]] = {
    "kv_events": lambda v: _all(v, _kv_event),
    "routed": lambda v: _digests(v) and len(v) <= ROUTED_MAX,  # type: ignore[arg-type]
}


def _note_rows(rows: object) -> bool:
    """Every row ``[rid, {...}]`` with known items (one loop: with token ids asked for,
    there is a note per token), or ``[nil, {...}]``, the worker's own."""
    if type(rows) is not list:
        return False
    for r in rows:
        if type(r) is not list or len(r) != 2:
            return False
        if type(r[0]) is not int:
            if r[0] is not None or not _map_of(_WORKER_NOTE_ITEMS, r[1]):
                return False
            continue
        note = r[1]
        if type(note) is not dict:
            return False
        if len(note) == 1:  # the common note: a token's id
            ids = note.get("token_ids")
            if ids is not None:
                if type(ids) is not list or not all(map(_is_int_type, map(type, ids))):
                    return False
                continue
        for key, value in note.items():
            item_ok = _NOTE_ITEMS.get(key) if type(key) is str else None
            if item_ok is None or not item_ok(value):
                return False
    return True


def _pong(m: list) -> bool:
    """``[PONG, seq, running, waiting]``, then ``mine`` from a listening worker, then the
    engine's statistics (a map) from an engine that reports them."""
    rest = m[4:]
    if rest and type(rest[-1]) is dict:
        if not _map_of(ENGINE_STATS, rest.pop()):
            return False
    return 4 <= len(m) <= 6 and len(rest) <= 1 and type(m[1]) is int and all(
        map(_count, [*m[2:4], *rest]))


def _step(m: list) -> bool:
    n = len(m)
    return (
        (n == 3 or n == 4) and _all(m[1], _accept_row) and _output_rows(m[2])
        and (n == 3 or _note_rows(m[3]))
    )


def _step_but_outputs(m: list) -> bool:
    """A STEP's shape, its output rows aside (a list): see :func:`check_reply`."""
    n = len(m)
    return (
        (n == 3 or n == 4) and _all(m[1], _accept_row) and type(m[2]) is list
        and (n == 3 or _note_rows(m[3]))
    )


def _bytes_or_nil(x: object) -> bool:
    return x is None or type(x) is bytes


def _bytes32(x: object) -> bool:
    return type(x) is bytes and len(x) == 32


_SHAPES: dict[int, Callable[[list], bool]] = {
    # HELLO: [HELLO, info] from a pipe worker, [HELLO, info, proof] from a listening one
    HELLO: lambda m: (len(m) == 2 or (len(m) == 3 and _bytes_or_nil(m[2])))
    and type(m[1]) is dict,
    # SUBMIT: [SUBMIT, rid, prompt, params] (+ adapter: a LoRA adapter's name)
    SUBMIT: lambda m: (len(m) == 4 or (len(m) == 5 and type(m[4]) is str))
    and type(m[1]) is int and type(m[2]) in (str, list, dict) and type(m[3]) is dict,
    ABORT: lambda m: len(m) == 2 and type(m[1]) is int,
    PING: lambda m: len(m) == 2 and type(m[1]) is int,
    PONG: _pong,
    SHUTDOWN: lambda m: len(m) == 1,
    STEP: _step,
    TOKENIZE: lambda m: len(m) == 3 and type(m[1]) is int and type(m[2]) is dict,
    # TOKENIZED: a result or an error, not both
    TOKENIZED: lambda m: len(m) == 4 and type(m[1]) is int and (
        (type(m[2]) is dict and m[3] is None) or (m[2] is None and _error(m[3]))),
    # (nonces and proofs: 32 bytes, server.worker_protocol.handshake; a short nonce would
    # make the other side's proof replayable)
    CHALLENGE: lambda m: len(m) == 4 and type(m[1]) is int and _bytes32(m[2])
    and type(m[3]) is bool,
    AUTH: lambda m: len(m) == 3 and _bytes32(m[1]) and (m[2] is None or _bytes32(m[2])),
    REFUSED: lambda m: len(m) == 2 and type(m[1]) is str,
}


def check(message: list, allowed: Iterable[int],
          shapes: dict[int, Callable[[list], bool]] | None = None) -> list:
    """``message`` (a decoded message: a list starting with an int) if it is of one of the
    ``allowed`` types and has that type's shape; else :class:`ProtocolError` saying which.

    >>> check([PING, 7], REQUESTS)
    [3, 7]
    >>> check([PONG, 7], REPLIES)
    Traceback (most recent call last):
    ...
    server.worker_protocol.wire.ProtocolError: malformed PONG: [4, 7]
    """
    kind = message[0]
    if kind not in allowed:
        name = _NAMES.get(kind)
        raise ProtocolError(
            f"unexpected message type {kind!r}" if name is None else f"unexpected {name}"
        )
    if not (shapes or _SHAPES)[kind](message):
        raise malformed(message)
    return message


def malformed(message: list) -> ProtocolError:
    """The error for a ``message`` of a known type with a wrong shape."""
    return ProtocolError(f"malformed {_NAMES[message[0]]}: {clip(message)}")


def check_request(message: list) -> list:
    """A message from a frontend, once connected: one of :data:`REQUESTS`, well formed."""
    return check(message, REQUESTS)


def _named_submit(m: list) -> bool:
    """A SUBMIT, or one with the prompt's block names (adapter or nil, then names)."""
    if len(m) != 6:
        return _SHAPES[SUBMIT](m)
    return (_SHAPES[SUBMIT](m[:4]) and (m[4] is None or type(m[4]) is str)
            and _digests(m[5]) and len(m[5]) <= ROUTED_MAX)


#: What a listening worker that says ROUTED_KEY takes besides :data:`REQUESTS`.
_LISTENER_REQUESTS = REQUESTS | {SUBSCRIBE}
_LISTENER_SHAPES = {
    **_SHAPES, SUBMIT: _named_submit,
    SUBSCRIBE: _subscribe,
}


def check_listener_request(message: list) -> list:
    """A message from a frontend to a listening worker: as :func:`check_request`, and
    SUBSCRIBE, and a SUBMIT with block names (see :data:`ROUTED_KEY`)."""
    return check(message, _LISTENER_REQUESTS, _LISTENER_SHAPES)


#: As _SHAPES, a STEP's output rows unchecked (the router checks each as it routes it).
_SHAPES_BUT_OUTPUTS = {**_SHAPES, STEP: _step_but_outputs}


def check_reply(message: list, *, rows: bool = True) -> list:
    """A message from a worker after its HELLO: one of :data:`REPLIES`, well formed.

    With ``rows=False`` a STEP's output rows are only checked to be a list: the caller
    checks each row (``[rid, text, ntok, finish, err]``: types, ``ntok >= 0``, ``err`` None
    unless ``finish`` is, then :func:`final_ok`) while it reads them, raising
    :func:`malformed` for a bad one, so that a hot path walks the rows once, not twice."""
    return check(message, REPLIES, None if rows else _SHAPES_BUT_OUTPUTS)
