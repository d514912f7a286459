"""The worker protocol's messages as types: what each side may receive, checked as it is
decoded. Sans-IO; no trio here.

Why
---
Every frame holds one message, a msgpack array whose first item is its type
(docs/protocol.md). Each message type here is a msgspec ``Struct`` with ``array_like=True``
and that type number as its tag. So a message travels as the array it always was
(``[PING, 7]``), and a reader decodes a frame straight into the message. Its shape is
checked in C on the way: the number of items, each item's type (a rid is an ``int``, never
a ``bool``), counts not below zero, a ``finish`` among :data:`FINISHES`, no unknown note
key.
A rule across items (an ``err`` exactly when a row's ``finish`` is ``"error"``) is the
type's ``__post_init__``, which msgspec runs on decoding too. What fails is a
``msgspec.ValidationError``; :mod:`server.worker_protocol.wire` turns it into the
:class:`~server.worker_protocol.wire.ProtocolError` that ends the connection.

Optional items come last and default to ``UNSET`` (absent), which is not nil: a pipe
worker's SUBMIT may have a fifth item, an adapter's name, but not a nil one. When a message
is encoded its trailing ``UNSET`` items are left out (``wire.encode``), so the bytes are the
ones the positional lists made: peers of either age read each other.

The *content* of a SUBMIT or CALL (the prompt's items, the params' values) and of a
RESULT's result is the engine's, or the caller's, to judge: typed ``Any`` here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Optional, Union

from msgspec import UNSET, Meta, Struct, UnsetType

from .kv_blocks import CLEARED, DIGEST_BYTES

__all__ = [
    "HELLO", "SUBMIT", "ABORT", "PING", "PONG", "SHUTDOWN", "STEP", "CALL", "RESULT",
    "CHALLENGE", "AUTH", "REFUSED", "SUBSCRIBE", "PART", "LEAVING", "NAMES",
    "Message", "Hello", "Submit", "PipeSubmit", "Abort", "Ping", "Pong", "Shutdown", "Step",
    "Call", "Result", "Challenge", "Auth", "Refused", "Subscribe", "Part", "Leaving",
    "AcceptRow", "OutputRow", "NoteRow", "Note", "Times", "KvEvent", "EngineStats",
    "FINISHES", "ROUTED_MAX", "PARTS_TOPIC", "LEAVING_TOPIC",
    "IMAGE_STATS_TOPIC", "IMAGE_STATS", "LEAVING_KIND",
    "ITERATION_TOKEN_BUCKETS", "UNSET",
    "error_ok", "final_ok", "note_ok", "as_dict",
]

HELLO = 0
SUBMIT = 1
ABORT = 2
PING = 3
PONG = 4
SHUTDOWN = 5
STEP = 6
#: A round trip to the worker's engine besides generation: ``[CALL, seq, request]``, the
#: request's ``op`` its method (tokenize, detokenize, info, embed, load_lora, unload_lora).
CALL = 7
#: Its answer: ``[RESULT, seq, result, err]``.
RESULT = 8
# The handshake of a connection to a listening worker (server.worker_protocol.handshake).
CHALLENGE = 9
AUTH = 10
REFUSED = 11
#: Frontend -> listening worker: the notices it wants (wire.ROUTED_KEY, wire.PARTS_KEY).
SUBSCRIBE = 12
#: Worker -> frontend that asked for parts: a piece of a big RESULT frame's body
#: (server.worker_protocol.parts).
PART = 13
#: Listening worker -> frontend that subscribed to :data:`LEAVING_TOPIC`: the worker was
#: told to stop (SIGTERM). It takes no new request; what runs may finish within ``within``
#: seconds, and then the worker closes the connection.
LEAVING = 14

#: Each message type's name, for a log line.
NAMES = {
    HELLO: "HELLO", SUBMIT: "SUBMIT", ABORT: "ABORT", PING: "PING", PONG: "PONG",
    SHUTDOWN: "SHUTDOWN", STEP: "STEP", CALL: "CALL", RESULT: "RESULT",
    CHALLENGE: "CHALLENGE", AUTH: "AUTH", REFUSED: "REFUSED", SUBSCRIBE: "SUBSCRIBE",
    PART: "PART", LEAVING: "LEAVING",
}

#: The ``finish`` of a terminal output row (None while the request runs).
FINISHES = frozenset({"stop", "length", "abort", "error"})
#: The most block names a SUBMIT carries (a prompt's first ones; the prediction index's
#: capacity, server.manager.routing.DEFAULT_CAPACITY: 128 KiB of names).
ROUTED_MAX = 16384
PARTS_TOPIC = "parts"
#: The SUBSCRIBE topic of a frontend that reads LEAVING (and the refusals that follow it).
LEAVING_TOPIC = "leaving"
#: The SUBSCRIBE topic of a frontend whose PONG maps may hold the image counters
#: (:data:`IMAGE_STATS`); a pipe worker is told by its argument (``"image_stats": true``).
IMAGE_STATS_TOPIC = "image_stats"
#: A PONG map's image-cache counters: sent only to a frontend that reads them (an older
#: one refuses a map with keys it does not know), since the protocol's version stays 1.
IMAGE_STATS = ("mm_cache_queries", "mm_cache_hits")
#: The ``err`` kind of a SUBMIT a leaving worker refused: the frontend sends it elsewhere.
LEAVING_KIND = "leaving"
#: Upper bounds of the tokens-per-engine-step histogram of a PONG's ``iteration_tokens``
#: (vLLM's ``iteration_tokens`` buckets).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

Count = Annotated[int, Meta(ge=0)]  # (a bool is not an int to msgspec)
NonNegative = Annotated[float, Meta(ge=0)]
Digest = Annotated[bytes, Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]
Names = Annotated[list[Digest], Meta(max_length=ROUTED_MAX)]
#: Nonces and proofs (server.worker_protocol.handshake): a short nonce would make the
#: other side's proof replayable.
Bytes32 = Annotated[bytes, Meta(min_length=32, max_length=32)]
#: ``[kind, message]`` or ``[kind, message, param]`` (:func:`error_ok` checks the items).
Err = Annotated[list, Meta(min_length=2, max_length=3)]
#: One of :data:`FINISHES` (a ``str`` to the engines that make rows).
Finish = Annotated[str, Meta(pattern=r"\A(stop|length|abort|error)\Z")]  # re.search: $ passes "stop\n"


def error_ok(err: list) -> bool:
    """An ``err`` whose kind and message are strings, and its param, if any, a string or
    nil (its length is checked by its type, :data:`Err`)."""
    return type(err[0]) is str and type(err[1]) is str and (
        len(err) == 2 or err[2] is None or type(err[2]) is str)


def final_ok(finish: object, err: object) -> bool:
    """A row's ``finish`` and ``err`` agree: an ``err`` exactly with ``"error"``."""
    if finish == "error":
        return err is not None and error_ok(err)  # type: ignore[arg-type]
    return err is None


class Message(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A message: an array whose first item is its type, this class's tag."""

    #: The message's type (its tag; set below, once the classes exist).
    kind: ClassVar[int]


class AcceptRow(NamedTuple):
    """The engine took request ``rid``; its prompt is ``prompt_tokens`` tokens long."""

    rid: int
    prompt_tokens: Count


class OutputRow(NamedTuple):
    """What one request produced since the previous STEP of its worker."""

    rid: int
    #: New text (detokenized, stop strings applied).
    text: str
    #: New tokens.
    ntok: Count
    #: None while it runs, else "stop", "length", "abort" or "error".
    finish: Optional[Finish]
    #: ``[kind, message]`` (or ``[kind, message, param]``) when ``finish == "error"``
    #: (kinds: server.errors.WIRE_KINDS).
    error: Optional[Err]


class Times(Struct, forbid_unknown_fields=True, gc=False):
    """A note's ``times``: the engine's own times of a finished request, in seconds."""

    queue: NonNegative
    prefill: NonNegative
    decode: NonNegative
    inference: NonNegative


class KvEvent(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """``[STORED, [digest, ...]]``, ``[REMOVED, [digest, ...]]`` or ``[CLEARED]``
    (server.worker_protocol.kv_blocks)."""

    kind: Literal[0, 1, 2]
    digests: Union[list[Digest], UnsetType] = UNSET

    def __post_init__(self) -> None:
        if (self.kind == CLEARED) is not (self.digests is UNSET):
            raise ValueError("CLEARED has no digests, STORED and REMOVED have them")


#: A logprob entry: ``[text, logprob or nil, [[alt_text, alt_logprob], ...]]``, or with
#: the ids (and the chosen token's rank): ``[text, logprob, [[alt_text, alt_logprob,
#: alt_id], ...], id, rank]`` (alternatives best first). Kept as lists (they are handed
#: on as they are: ``RequestOutput.logprobs``); :func:`_logprobs_ok` checks their items.
LogprobEntry = Annotated[list[Any], Meta(min_length=3, max_length=5)]


def _number(x: object) -> bool:
    return x is None or type(x) is float or type(x) is int


def _count(x: object) -> bool:
    return type(x) is int and x >= 0


def _logprobs_ok(entries: list) -> bool:
    for e in entries:
        if type(e[0]) is not str or not _number(e[1]) or type(e[2]) is not list:
            return False
        if len(e) == 3:
            ok = all(type(a) is list and len(a) == 2 and type(a[0]) is str and _number(a[1])
                     for a in e[2])
        else:
            ok = len(e) == 5 and _count(e[3]) and (e[4] is None or _count(e[4])) and all(
                type(a) is list and len(a) == 3 and type(a[0]) is str and _number(a[1])
                and _count(a[2]) for a in e[2])
        if not ok:
            return False
    return True


class Note(Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """A STEP note's map: details of a request (before that frame's outputs), or the
    worker's own news (a note row whose rid is nil): see :class:`NoteRow`."""

    #: The ids of the row's new tokens (params ``token_ids: true``).
    token_ids: Union[list[int], UnsetType] = UNSET
    #: The prompt's ids, once (params ``prompt_token_ids: true``).
    prompt_token_ids: Union[list[int], UnsetType] = UNSET
    cached_tokens: Union[Count, UnsetType] = UNSET
    logprobs: Union[list[LogprobEntry], UnsetType] = UNSET
    prompt_logprobs: Union[list[LogprobEntry], UnsetType] = UNSET
    times: Union[Times, UnsetType] = UNSET
    #: The worker's own: the blocks its KV cache stored and removed in this step.
    kv_events: Union[list[KvEvent], UnsetType] = UNSET
    #: The worker's own: another frontend sent it a prompt of these blocks.
    routed: Union[Names, UnsetType] = UNSET


def note_ok(rid: int | None, note: Note) -> bool:
    """A request's note holds its details (its logprob entries well formed: they are
    typed as lists only), a worker's note (rid nil) its news only. (Not a
    ``__post_init__``: a call per note would cost a note per token as much again; the
    router calls this only for a note that holds more than ids and counts.)"""
    if rid is not None:
        return note.kv_events is UNSET and note.routed is UNSET and all(
            entries is UNSET or _logprobs_ok(entries)
            for entries in (note.logprobs, note.prompt_logprobs))
    return (note.token_ids is UNSET and note.prompt_token_ids is UNSET
            and note.cached_tokens is UNSET and note.logprobs is UNSET
            and note.prompt_logprobs is UNSET and note.times is UNSET)


class NoteRow(NamedTuple):
    """``[rid, note]``, or ``[nil, note]``: the worker's own (kv_events, routed only;
    checked by :class:`Step`)."""

    rid: Optional[int]
    note: Note


class Hello(Message, tag=HELLO):
    """The engine is loaded: its ``info`` (a listening worker adds its ``proof``)."""

    info: dict[str, Any]
    proof: Union[bytes, None, UnsetType] = UNSET


#: A string, token ids (a list; packed ids, wire.PACKED_IDS, come out as one) or
#: ``{"messages": [...]}``: typed ``Any`` so that packed ids reach the decoder's
#: ``ext_hook`` (msgspec hands an extension value only to an ``Any``), its type checked by
#: :class:`Submit`.
Prompt = Any


_PROMPT_TYPES = (str, list, dict)


class Submit(Message, tag=SUBMIT):
    """A request to a listening worker: as :class:`PipeSubmit`, and the prompt's block
    ``names`` after its adapter or nil (wire.ROUTED_KEY)."""

    rid: int
    prompt: Prompt
    params: dict[str, Any]
    adapter: Union[str, None, UnsetType] = UNSET
    names: Union[Names, UnsetType] = UNSET

    def __post_init__(self) -> None:
        if type(self.prompt) not in _PROMPT_TYPES:
            raise ValueError("a prompt is a string, a list or a map")
        if self.adapter is None and self.names is UNSET:
            raise ValueError("a nil adapter without names")


class PipeSubmit(Submit, tag=SUBMIT):
    """``[SUBMIT, rid, prompt, params]`` (+ ``adapter``: a LoRA adapter's name)."""

    def __post_init__(self) -> None:
        if type(self.prompt) not in _PROMPT_TYPES:
            raise ValueError("a prompt is a string, a list or a map")
        if self.adapter is None or self.names is not UNSET:
            raise ValueError("block names to a pipe worker")


class Abort(Message, tag=ABORT):
    rid: int


class Ping(Message, tag=PING):
    seq: int


class EngineStats(Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """A PONG's engine statistics (vllm only; every key optional):

    * ``kv_cache_usage``: 0..1, after the latest step;
    * ``deferred``: of the waiting requests, those waiting for something other than a batch
      slot;
    * ``preemptions``: since the engine started;
    * ``iteration_tokens``: since the engine started, how many steps processed up to each
      bound of ITERATION_TOKEN_BUCKETS, one more slot for those above, then the sum of all
      their tokens;
    * ``mm_cache_queries``, ``mm_cache_hits``: since the engine started, the images looked
      up in the engine's processed-image cache, and those found there (only to a frontend
      that reads them: :data:`IMAGE_STATS`)."""

    kv_cache_usage: Union[Annotated[float, Meta(ge=0, le=1)], UnsetType] = UNSET
    deferred: Union[Count, UnsetType] = UNSET
    preemptions: Union[Count, UnsetType] = UNSET
    iteration_tokens: Union[Annotated[list[Count], Meta(
        min_length=len(ITERATION_TOKEN_BUCKETS) + 2,
        max_length=len(ITERATION_TOKEN_BUCKETS) + 2)], UnsetType] = UNSET
    mm_cache_queries: Union[Count, UnsetType] = UNSET
    mm_cache_hits: Union[Count, UnsetType] = UNSET


class Pong(Message, tag=PONG):
    """``[PONG, seq, running, waiting]``, then ``mine`` from a listening worker (its
    connection's share), then the engine's statistics from an engine that reports them;
    seq 0: unasked (the worker's pulse). Decoded, ``stats`` holds the map wherever it was."""

    seq: int
    running: Count
    waiting: Count
    mine: Union[Count, EngineStats, UnsetType] = UNSET
    stats: Union[EngineStats, UnsetType] = UNSET

    def __post_init__(self) -> None:
        if type(self.mine) is EngineStats:
            if self.stats is not UNSET:
                raise ValueError("the engine's statistics come last")
            self.mine, self.stats = UNSET, self.mine


class Shutdown(Message, tag=SHUTDOWN):
    pass


class Step(Message, tag=STEP):
    """One engine step's news: ``accepts``, ``outputs``, and ``notes`` when the engine has
    any (they precede the outputs). Whether each output row's ``finish`` and ``err`` agree
    (:func:`final_ok`) is for the reader of the rows to check as it reads them: the
    frontend's router walks the rows once, not twice (a STEP is the hot path); as is
    whether each note holds a request's details or the worker's news (:func:`note_ok`)."""

    accepts: list[AcceptRow]
    outputs: list[OutputRow]
    notes: Union[list[NoteRow], UnsetType] = UNSET


class Call(Message, tag=CALL):
    """A round trip to the engine besides generation: ``request["op"]`` says which."""

    seq: int
    request: dict[str, Any]


class Result(Message, tag=RESULT):
    """A CALL's answer: a result or an ``err``, not both."""

    seq: int
    result: Optional[dict[str, Any]]
    error: Optional[Err]

    def __post_init__(self) -> None:
        if (self.result is None) is (self.error is None) or (
                self.error is not None and not error_ok(self.error)):
            raise ValueError("a result or an err")


class Challenge(Message, tag=CHALLENGE):
    version: int
    nonce: Bytes32
    secret_required: bool


class Auth(Message, tag=AUTH):
    cnonce: Bytes32
    proof: Optional[Bytes32]


class Refused(Message, tag=REFUSED):
    reason: str


#: A SUBSCRIBE's routed topic: a block naming's version, 1 to 999999.
_ROUTED_TOPIC = re.compile(r"routed/[1-9][0-9]{0,5}")
_TOPICS = (PARTS_TOPIC, LEAVING_TOPIC, IMAGE_STATS_TOPIC)


class Subscribe(Message, tag=SUBSCRIBE):
    """1 to 8 topics: :data:`PARTS_TOPIC`, :data:`LEAVING_TOPIC`, :data:`IMAGE_STATS_TOPIC`,
    and one naming's routed
    notices at most (a connection's names are of one naming)."""

    topics: Annotated[list[str], Meta(min_length=1, max_length=8)]

    def __post_init__(self) -> None:
        topics = self.topics
        routed = sum(_ROUTED_TOPIC.fullmatch(t) is not None for t in topics)
        known = routed + sum(topics.count(topic) for topic in _TOPICS)
        if routed > 1 or known != len(topics):
            raise ValueError("unknown topics")


class Part(Message, tag=PART):
    data: bytes
    more: bool


class Leaving(Message, tag=LEAVING):
    """The worker stops: no new request; it cuts what still runs after ``within`` s."""

    within: NonNegative


def as_dict(struct: Struct) -> dict[str, Any]:
    """A map-like struct's fields that are set (a note's times, a PONG's statistics)."""
    return {name: value for name in struct.__struct_fields__
            if (value := getattr(struct, name)) is not UNSET}


def _subclasses(cls: type) -> list[type]:
    subs: list[type] = cls.__subclasses__()
    return [c for sub in subs for c in (sub, *_subclasses(sub))]


for _cls in _subclasses(Message):
    _cls.kind = _cls.__struct_config__.tag  # type: ignore[attr-defined]
