"""The worker wire protocol, sans-IO: frames in, messages out, and back. No trio here.

Theory of operation
-------------------
Each direction of the pipe carries *frames*: a 4-byte big-endian length, then that many bytes
of msgpack. Every frame holds one message, a list whose first item is the message type. The
frontend may write several frames in one ``write``; the worker writes at most one STEP frame
per loop iteration, however many requests advanced in it. See ``docs/protocol.md``.

Frontend -> worker::

    [SUBMIT, rid, prompt, params]   prompt: str, list[int], or {"messages": [...]} for chat
    [ABORT, rid]                    unknown or finished rid: a no-op
    [PING, seq]
    [TOKENIZE, seq, request]        {"op": "tokenize", "prompt": str | {"messages": [...]},
                                    "add_special_tokens": bool} or {"op": "detokenize",
                                    "tokens": [int, ...]} or {"op": "embed", "input":
                                    [str | [int, ...], ...], "dimensions": int | None}
    [SHUTDOWN]

Worker -> frontend::

    [HELLO, info]                   once, when the engine is loaded (info: dict)
    [STEP, accepts, outputs]        accepts: [[rid, prompt_tokens], ...]
                                    outputs: [[rid, text, ntok, finish, err], ...]
    [STEP, accepts, outputs, notes] notes: [[rid, {"cached_tokens": n}], ...], only when
                                    the engine has any (they precede the outputs)
    [PONG, seq, running, waiting]   a listening worker adds the requests this connection holds
    [TOKENIZED, seq, result, err]   result: {"tokens": [...], "max_model_len": n},
                                    {"prompt": str} or {"data": [float32 LE bytes, ...],
                                    "prompt_tokens": n}; or err: [kind, message]

A worker started with ``--listen`` opens each connection with a handshake first
(CHALLENGE, AUTH, then HELLO or REFUSED; see :mod:`server.protocol.handshake`).

The rows of a STEP are :class:`AcceptRow` and :class:`OutputRow` (sent as arrays in their
field order; the frontend unpacks them in that order). In an output, ``finish`` is None or
one of stop/length/abort/error and ``err`` is None or ``[kind, message]`` (kinds in
:data:`server.errors.WIRE_KINDS`). A request that is rejected
(client fault, such as a prompt over the context limit) gets a terminal output with
``finish="error"`` and no accept. An abort of a request the worker holds is answered by a
terminal ``abort`` output in the worker's next frame; of any other rid, by nothing.

A peer that sends a frame over :data:`MAX_FRAME`, or bytes that are not msgpack, is broken:
:class:`ProtocolError` is raised and the connection must be dropped.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgpack

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
    "MAX_FRAME",
    "ProtocolError",
    "FrameDecoder",
    "encode",
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
# The handshake of a connection to a listening worker (server.protocol.handshake).
CHALLENGE = 9
AUTH = 10
REFUSED = 11

#: Largest frame either side accepts (64 MiB): a bigger length prefix means garbage.
MAX_FRAME = 64 * 1024 * 1024

_HEADER = struct.Struct(">I")
_packb = msgpack.Packer(use_bin_type=True).pack


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame; the connection cannot be trusted."""


def encode(message: list) -> bytes:
    """One message as one frame.

    >>> FrameDecoder().feed(encode([PING, 7]))
    [[3, 7]]
    """
    body = _packb(message)
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Turns the bytes of a pipe, in pieces of any size, into messages.

    ``feed`` returns the messages completed by the new bytes (often none, sometimes many).
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray) -> list[list]:
        buf = self._buf
        buf += data
        messages = []
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            (length,) = _HEADER.unpack_from(buf, pos)
            if length > MAX_FRAME:
                raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME} limit")
            if end - pos - 4 < length:
                break
            start = pos + 4
            try:
                message = msgpack.unpackb(buf[start : start + length], use_list=True, raw=False)
            except Exception as exc:
                raise ProtocolError(f"undecodable frame: {exc}") from None
            if not isinstance(message, list) or not message or not isinstance(message[0], int):
                raise ProtocolError(f"malformed message: {message!r:.80}")
            messages.append(message)
            pos = start + length
        if pos:
            del buf[:pos]
        return messages

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)
