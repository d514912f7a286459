"""The worker wire codec (sans-IO): frames in any pieces, and what counts as garbage."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.worker_protocol import wire
from tests import frames

MESSAGES = [
    [wire.HELLO, {"engine": "sim", "model": "m", "max_model_len": 8192, "chat_template": "x"}],
    [wire.SUBMIT, 1, "Once upon a time", {"max_tokens": 16, "stop": ["\n"], "seed": None}],
    [wire.SUBMIT, 2, [1, 2, 3, 50_000], {"temperature": 0.5}],
    [wire.SUBMIT, 3, {"messages": [{"role": "user", "content": "héllo 日本 🙂"}]}, {}],
    [wire.ABORT, 2**40],
    [wire.PING, 7],
    [wire.PONG, 7, 3, 1],
    [wire.SHUTDOWN],
    [wire.STEP, [[1, 4], [2, 4]], [[1, " café", 1, None, None], [2, "", 0, "error",
                                                                   ["engine_error", "boom"]]]],
]


def test_round_trip_each_message():
    for message in MESSAGES:
        assert wire.FrameDecoder().feed(wire.encode(message)) == [message]


def test_integers_beyond_64_bits_travel_exactly():
    """JSON allows them (a model may write one in a call's arguments): an extension type,
    back as the same int; those that fit stay plain msgpack ints."""
    values = [2**64, -(2**63) - 1, 10**39, -(10**40), 2**63 - 1, -(2**63), True]
    message = [wire.SUBMIT, 1, {"messages": []}, {"tools": [{"n": values}]}]
    assert wire.FrameDecoder().feed(wire.encode(message)) == [message]
    assert msgpack.unpackb(wire.encode([wire.PING, 2**63 - 1])[4:]) == [wire.PING, 2**63 - 1]
    with pytest.raises(TypeError, match="set"):
        wire.encode([wire.PING, {1}])


def test_many_frames_in_one_feed():
    decoder = wire.FrameDecoder()
    assert decoder.feed(b"".join(wire.encode(m) for m in MESSAGES)) == MESSAGES
    assert decoder.buffered == 0


def test_frame_layout_is_length_prefix_then_msgpack():
    frame = wire.encode([wire.PING, 7])
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert msgpack.unpackb(frame[4:]) == [wire.PING, 7]


def test_byte_by_byte():
    data = b"".join(wire.encode(m) for m in MESSAGES)
    ends = set()
    pos = 0
    for m in MESSAGES:
        pos += len(wire.encode(m))
        ends.add(pos)
    decoder = wire.FrameDecoder()
    got = []
    last_end = 0
    for i in range(len(data)):
        out = decoder.feed(data[i : i + 1])
        # a message comes out exactly when its last byte arrives, not before
        assert len(out) == (1 if i + 1 in ends else 0), i
        if out:
            last_end = i + 1
        assert decoder.buffered == i + 1 - last_end
        got.extend(out)
    assert got == MESSAGES
    assert decoder.buffered == 0


def test_partial_header_and_body_are_buffered():
    frame = wire.encode([wire.PING, 1])
    decoder = wire.FrameDecoder()
    assert decoder.feed(frame[:2]) == []
    assert decoder.buffered == 2
    assert decoder.feed(frame[2:-1]) == []
    assert decoder.buffered == len(frame) - 1
    assert decoder.feed(frame[-1:] + frame[:3]) == [[wire.PING, 1]]
    assert decoder.buffered == 3


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(
        st.lists(
            st.one_of(
                st.integers(-(2**63), 2**64 - 1),
                st.text(max_size=20),
                st.none(),
                st.booleans(),
                st.lists(st.integers(0, 10**6), max_size=5),
            ),
            max_size=5,
        ).map(lambda rest: [wire.STEP, *rest]),
        max_size=8,
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=20),
)
def test_round_trip_any_split(messages, cuts):
    data = b"".join(wire.encode(m) for m in messages)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    decoder = wire.FrameDecoder()
    got = []
    for a, b in zip(points, points[1:]):
        got.extend(decoder.feed(data[a:b]))
    assert got == messages
    assert decoder.buffered == 0


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x03",  # an array of 2 with 1 item: truncated inside the frame
        msgpack.packb([3, 1]) + b"\x00",  # trailing bytes after the message
        msgpack.packb(7),  # not a list
        msgpack.packb([]),  # empty list
        msgpack.packb(["PING", 1]),  # type is not an int
        msgpack.packb({"a": 1}),
        b"",  # empty frame
        msgpack.packb([1, msgpack.ExtType(2, b"1")]),  # an unknown extension type
        msgpack.packb([1, msgpack.ExtType(wire.BIG_INT, b"1_0")]),  # not just digits
        msgpack.packb([1, msgpack.ExtType(wire.BIG_INT, b"")]),
        msgpack.packb([1, msgpack.ExtType(wire.BIG_INT, b"9" * 4302)]),
    ],
    ids=["bad-byte", "truncated", "trailing", "not-list", "empty-list", "str-type", "map",
         "empty", "ext-type", "big-int-underscore", "big-int-empty", "big-int-long"],
)
def test_garbage_is_a_protocol_error(body):
    with pytest.raises(wire.ProtocolError):
        wire.FrameDecoder().feed(_frame(body))
    with pytest.raises(wire.ProtocolError):  # and where a big frame is decoded in slices
        wire.FrameDecoder().decode_sliced(body)


def test_the_longest_integer_the_frontend_parses_travels_intact():
    big = -(10**4299) - 7  # a sign and 4,300 digits: Python's default limit for int(str)
    assert wire.FrameDecoder().feed(wire.encode([wire.SUBMIT, 1, "p", {"x": big}])) == [
        [wire.SUBMIT, 1, "p", {"x": big}]]


def test_garbage_after_good_frames_is_still_an_error():
    decoder = wire.FrameDecoder()
    assert decoder.feed(wire.encode([wire.PING, 1])) == [[wire.PING, 1]]
    with pytest.raises(wire.ProtocolError):
        decoder.feed(_frame(b"\xc1"))


def test_good_frames_in_the_same_bytes_as_garbage_are_kept_on_the_error():
    good = [[wire.PING, 1], [wire.PONG, 1, 0, 0]]
    data = b"".join(map(wire.encode, good)) + _frame(b"\xc1") + wire.encode([wire.PING, 2])
    with pytest.raises(wire.ProtocolError) as caught:
        wire.FrameDecoder().feed(data)
    assert caught.value.messages == good


def test_oversize_length_is_an_error_as_soon_as_the_header_arrives():
    decoder = wire.FrameDecoder()
    header = struct.pack(">I", wire.MAX_FRAME + 1)
    assert decoder.feed(header[:3]) == []
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        decoder.feed(header[3:])  # no body needed: the length alone is garbage


def test_largest_allowed_length_is_not_an_error_by_itself():
    decoder = wire.FrameDecoder()
    assert decoder.feed(struct.pack(">I", wire.MAX_FRAME) + b"\x00" * 10) == []
    assert decoder.buffered == 14


def test_text_garbage_such_as_a_stray_print_is_an_error():
    # "hello\n" read as a length prefix is 0x68656c6c: over MAX_FRAME
    with pytest.raises(wire.ProtocolError):
        wire.FrameDecoder().feed(b"hello world\n")


# -- shapes: what each side accepts ----------------------------------------------------------

GOOD_REQUESTS = [m for m in MESSAGES if m[0] in wire.REQUESTS] + [
    [wire.CALL, 1, {"op": "detokenize", "tokens": [1, 2]}],
]
GOOD_REPLIES = [m for m in MESSAGES if m[0] in wire.REPLIES] + [
    [wire.PONG, 7, 3, 1, 2],  # a listening worker's: with this connection's count
    # an engine that reports its own statistics (vllm): a map last
    [wire.PONG, 7, 3, 1, {"kv_cache_usage": 0.25, "deferred": 1, "preemptions": 0,
                          "iteration_tokens": [0, 2] + [0] * 12 + [9]}],
    [wire.PONG, 7, 3, 1, 2, {"kv_cache_usage": 1}],
    [wire.PONG, 7, 3, 1, {"mm_cache_queries": 3, "mm_cache_hits": 1}],  # a vision model's
    [wire.STEP, [], [[1, "x", 1, "stop", None]], [[1, {"cached_tokens": 0, "times": {
        "queue": 0.5, "prefill": 0, "decode": 1.5, "inference": 1.5}}]]],
    [wire.STEP, [], [[1, "x", 1, "stop", None]], [[1, {"cached_tokens": 3}], [1, {
        "logprobs": [["x", -0.5, [["y", -1.0]]]], "prompt_logprobs": [["a", None, []]]}]]],
    [wire.RESULT, 1, {"tokens": [1], "max_model_len": 8}, None],
    [wire.RESULT, 1, None, ["invalid_request", "no"]],
]


def test_well_formed_messages_pass_their_side_only():
    for message in GOOD_REQUESTS:
        assert wire.check_request(message) is message
        with pytest.raises(wire.ProtocolError, match="unexpected"):
            wire.check_reply(message)
    for message in GOOD_REPLIES:
        assert wire.check_reply(message) is message
        with pytest.raises(wire.ProtocolError, match="unexpected"):
            wire.check_request(message)


@pytest.mark.parametrize("message", [
    # issue 23: each of these raised IndexError or TypeError in a listening worker
    [wire.PING], [wire.CALL], [wire.SUBMIT], [wire.ABORT], [wire.SUBMIT, [1], "hi", {}],
    [wire.ABORT, [1]],
    [wire.SUBMIT, 1, "hi"], [wire.SUBMIT, 1, "hi", {}, 5], [wire.SUBMIT, 1, 5, {}],
    [wire.SUBMIT, 1, "hi", []], [wire.SUBMIT, True, "hi", {}], [wire.PING, "7"],
    [wire.CALL, 1, "text"], [wire.SHUTDOWN, 1],
], ids=repr)
def test_malformed_requests_are_protocol_errors(message):
    with pytest.raises(wire.ProtocolError, match="malformed"):
        wire.check_request(message)


@pytest.mark.parametrize("message", [
    [wire.PONG], [wire.PONG, 1, 2], [wire.PONG, 1, -1, 0], [wire.PONG, 1, 0, 0, 0, 0],
    [wire.PONG, 1, 0, 0, {}, 0], [wire.PONG, 1, 0, 0, {"kv_cache_usage": 1.5}],
    [wire.PONG, 1, 0, 0, {"preemptions": -1}], [wire.PONG, 1, 0, 0, {"running": 1}],
    [wire.PONG, 1, 0, 0, {"iteration_tokens": [0, 1]}], [wire.PONG, 1, 0, 0, 1, 1, {}],
    [wire.PONG, 1, 0, 0, {"mm_cache_hits": -1}], [wire.PONG, 1, 0, 0, {"mm_cache_queries": 0.5}],
    [wire.STEP, [], [], [[1, {"times": {"queue": 1.0}}]]],
    [wire.STEP, [], [], [[1, {"times": {"queue": -1, "prefill": 0, "decode": 0,
                                        "inference": 0}}]]],
    [wire.STEP], [wire.STEP, [], None], [wire.STEP, [[1]], []], [wire.STEP, [], [[1, "x"]]],
    [wire.STEP, [], [[1, b"x", 1, None, None]]], [wire.STEP, [], [[1, "x", -1, None, None]]],
    [wire.STEP, [], [[1, "x", 1, "done", None]]], [wire.STEP, [], [[1, "x", 1, [], None]]],
    [wire.STEP, [], [[1, "x", 1, "stop\n", None]]], [wire.STEP, [], [[1, "", 0, "error\n", None]]],
    [wire.STEP, [], [[1, "", 0, "error", None]]], [wire.STEP, [], [[1, "", 0, "error", ["k"]]]],
    [wire.STEP, [], [[1, "", 0, "stop", ["k", "m"]]]], [wire.STEP, [], [], [[1, 2]]],
    [wire.STEP, [], [], [[1, {"cached_tokens": "3"}]]], [wire.STEP, [], [], [[1, {"x": 1}]]],
    [wire.STEP, [], [], [[1, {"logprobs": [["x", "-1", []]]}]]], [wire.STEP, [], [], [], 1],
    [wire.RESULT, 1, None, None], [wire.RESULT, 1, {}, ["k", "m"]],
    [wire.RESULT, 1, []],
], ids=repr)
def test_malformed_replies_are_protocol_errors(message):
    with pytest.raises(wire.ProtocolError, match="malformed"):
        wire.check_reply(message)
    rows_only = message[0] == wire.STEP and len(message) == 3 and message[1] == [] and (
        type(message[2]) is list)
    if rows_only:  # the router checks these rows itself, as it routes them
        assert wire.check_reply(message, rows=False) is message
    else:
        with pytest.raises(wire.ProtocolError, match="malformed"):
            wire.check_reply(message, rows=False)


def test_unexpected_types_and_the_handshake():
    for check in (wire.check_request, wire.check_reply):
        with pytest.raises(wire.ProtocolError, match="unexpected message type 99"):
            check([99])
        for kind in (wire.HELLO, wire.CHALLENGE, wire.AUTH, wire.REFUSED):
            with pytest.raises(wire.ProtocolError, match="unexpected"):
                check([kind])
    nonce = bytes(32)
    assert wire.check([wire.CHALLENGE, 1, nonce, True], [wire.CHALLENGE])
    assert wire.check([wire.AUTH, nonce, None], [wire.AUTH])
    assert wire.check([wire.HELLO, {}, nonce], [wire.HELLO])
    for bad in ([wire.CHALLENGE, 1, "n", True], [wire.AUTH, nonce], [wire.HELLO, {}, "p"],
                [wire.REFUSED], [wire.HELLO, []]):
        with pytest.raises(wire.ProtocolError, match="malformed"):
            wire.check(bad, [bad[0]])


def test_the_decoder_applies_its_check():
    decoder = wire.FrameDecoder(wire.check_request)
    assert decoder.feed(wire.encode([wire.PING, 1])) == [[wire.PING, 1]]
    with pytest.raises(wire.ProtocolError, match=r"malformed PING: \[3\]"):
        decoder.feed(wire.encode([wire.PING]))
    with pytest.raises(wire.ProtocolError, match="malformed message"):  # bool is no type
        wire.FrameDecoder().feed(wire.encode([True, 1]))


def test_a_huge_malformed_message_is_named_in_a_short_line():
    message = [wire.SUBMIT, "x" * 1_000_000, [list(range(1000))] * 1000, {}]
    with pytest.raises(wire.ProtocolError) as info:
        wire.check_request(message)
    assert len(str(info.value)) < 250


@settings(max_examples=300, deadline=None)
@given(message=frames.requests | frames.replies)
def test_property_a_check_passes_or_raises_a_protocol_error_and_nothing_else(message):
    for check in (wire.check_request, wire.check_reply):
        try:
            assert check(message) is message
        except wire.ProtocolError as exc:
            assert len(str(exc)) < 250


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_property_well_formed_messages_of_each_type_pass(data):
    for kind, strategy in frames.WELL_FORMED.items():
        message = list(data.draw(strategy))
        assert wire.check(message, [kind]) is message
        # ... and survive the wire (repr: NaN is not equal to itself)
        assert repr(wire.FrameDecoder().feed(wire.encode(message))) == repr([message])


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_property_a_typed_message_travels_as_the_same_bytes(data):
    """The types only name the items: a message made of its type (what a sender of this
    version sends) is the frame its positional list was, so peers of either version read
    each other (the handshake's version stays 1), and a reader gives back that type."""
    for kind, strategy in frames.WELL_FORMED.items():
        message = list(data.draw(strategy))
        read = wire.reader(kind)
        typed = read.convert(message)
        assert type(typed).kind == kind
        # (a STEP's notes and a PONG's statistics are typed for their reader: their
        # senders send maps, in their own key order)
        if not (kind == wire.STEP and len(message) == 4 or kind == wire.PONG
                and type(message[-1]) is dict):
            assert wire.encode(typed) == wire.encode(message)
        assert repr(read.decode(wire.encode(message)[4:])) == repr(typed)  # (NaN)


def test_a_packed_prompt_reaches_each_workers_reader():
    """A long token-id prompt travels packed (an extension value): every worker's reader
    gives it back as the list of ids, typed or as a list."""
    ids = [(7919 * i) % 50_000 for i in range(wire.PACK_MIN + 3)]
    frame = wire.encode([wire.SUBMIT, 1, wire.pack_ids(ids), {}])
    for read in (wire.REQUESTS, wire.LISTENER_REQUESTS):
        (message,) = wire.FrameDecoder(read).feed(frame)
        assert message.prompt == ids
        assert wire.FrameDecoder(read.as_lists()).feed(frame) == [[wire.SUBMIT, 1, ids, {}]]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([0, 1, 15, 16, wire.SLICE - 1, wire.SLICE, wire.SLICE + 1,
                        2 * wire.SLICE + 17, 5 * wire.SLICE]),
       st.integers(0, 2**40), st.integers(1, 2**31))
def test_a_reply_packed_in_slices_is_the_same_frame(n, seed, max_model_len):
    """pack_sliced (a huge /tokenize reply, packed a slice at a time off the worker's loop)
    makes the very bytes encode makes, and the frame passes the frontend's checks."""
    import random

    rng = random.Random(seed)
    ids = [rng.choice((0, 127, 128, 255, 256, 65535, 65536, 2**31)) for _ in range(n)]
    result = {"tokens": ids, "max_model_len": max_model_len}
    message = [wire.RESULT, seed, result, None]
    packed = wire.encode([wire.RESULT, seed, wire.pack_sliced(result), None])
    assert packed == wire.encode(message)
    assert wire.FrameDecoder(wire.check_reply).feed(packed) == [message]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_property_a_frame_decoded_in_slices_is_the_same_message(data):
    """decode_sliced (the frontend's decoding of a big frame, in a thread) gives what one
    unpackb gives, for every message type, and takes the frames feed takes."""
    decoder = wire.FrameDecoder(wire.check_reply)
    for kind in (wire.STEP, wire.PONG, wire.RESULT):
        message = list(data.draw(frames.WELL_FORMED[kind]))
        (body,) = decoder.frames(wire.encode(message))
        assert repr(decoder.decode_sliced(body)) == repr(decoder.decode(body))
    value = data.draw(frames.values)
    body = msgpack.packb([wire.STEP, [], [], [[1, {"v": value}]]])
    assert repr(wire.decode_sliced(body)) == repr(msgpack.unpackb(body, raw=False))


@pytest.mark.parametrize("n", [wire.SLICE + 1, 3 * wire.SLICE])
def test_a_long_list_decoded_in_slices(n):
    rows = [[i, "é" * (i % 3), i % 5, None, None] for i in range(n)]
    ids = list(range(n))
    for message in ([wire.STEP, [], rows], [wire.RESULT, 3, {"tokens": ids}, None]):
        (body,) = wire.FrameDecoder().frames(wire.encode(message))
        assert wire.FrameDecoder(wire.check_reply).decode_sliced(body) == message
    # a map key that is not a string (unpackb's strict keys), a long list cut short
    with pytest.raises(wire.ProtocolError):
        wire.decode_sliced(msgpack.packb([wire.RESULT, 3, {1: ids}, None]))
    with pytest.raises(wire.ProtocolError):
        wire.decode_sliced(msgpack.packb([wire.RESULT, 3, {"tokens": ids}, None])[:-100])


def test_frames_before_an_oversized_one_are_kept():
    good = wire.encode([wire.PING, 1])
    with pytest.raises(wire.ProtocolError) as caught:
        wire.FrameDecoder().frames(good + struct.pack(">I", wire.MAX_FRAME + 1))
    assert caught.value.frames == [good[4:]]


def test_a_malformed_message_of_any_type_encodes_as_it_is():
    """encode() packs what it is given (the generated-frame tests send malformed messages
    of every type; a short RESULT raised IndexError in the test's own frontend)."""
    for message in ([wire.RESULT], [wire.RESULT, 1], [wire.RESULT, 1, None, None, 5]):
        assert wire.FrameDecoder().feed(wire.encode(message)) == [message]


# -- packed token ids (wire.PACKED_IDS) --------------------------------------------------------


def _ids(n: int, seed: int = 0) -> list[int]:
    """``n`` ids over the whole uint32 range (the largest included)."""
    return [(seed + 2654435761 * i) % 2**32 for i in range(n - 1)] + [2**32 - 1]


@pytest.mark.parametrize("n", [wire.PACK_MIN, wire.SLICE + 1, 3 * wire.SLICE + 5])
def test_long_id_lists_travel_packed_and_arrive_as_the_same_lists(n):
    """A packed list is little-endian uint32s on the wire (4 bytes an id), and comes out of
    both decoders (one unpackb; the frontend's sliced one) as the list that was packed, in
    a /tokenize answer, a SUBMIT's prompt and a detokenize alike."""
    ids = _ids(n, seed=n)
    for plain in ([wire.RESULT, 5, {"tokens": ids, "max_model_len": 9}, None],
                  [wire.SUBMIT, 6, ids, {"max_tokens": 1}],
                  [wire.CALL, 7, {"op": "detokenize", "tokens": ids}]):
        packed = [*plain]
        if plain[0] == wire.SUBMIT:
            packed[2] = wire.pack_ids(ids)
        else:
            packed[2] = {**plain[2], "tokens": wire.pack_ids(ids)}
        frame = wire.encode(packed)
        body = frame[4:]
        raw = msgpack.unpackb(body, ext_hook=lambda code, data: (code, data))
        sent = raw[2] if plain[0] == wire.SUBMIT else raw[2]["tokens"]
        assert sent == (wire.PACKED_IDS, struct.pack(f"<{n}I", *ids))
        check = wire.check_reply if plain[0] == wire.RESULT else wire.check_request
        decoder = wire.FrameDecoder(check)
        assert decoder.feed(frame) == [plain]
        assert decoder.decode_sliced(body) == plain
    # a worker packs its /tokenize answer beforehand, a slice at a time: the same bytes
    result = {"tokens": wire.pack_ids(ids), "max_model_len": 9}
    assert (wire.encode([wire.RESULT, 1, wire.pack_sliced(result), None])
            == wire.encode([wire.RESULT, 1, result, None]))


def test_only_long_lists_of_uint32_are_packed():
    """Short lists stay msgpack arrays (cheap, readable); so does a list that does not fit
    in uint32s (the receiver judges its content: an out-of-vocabulary id is the engine's
    400), and anything that is not a list."""
    short = list(range(wire.PACK_MIN - 1))
    assert wire.pack_ids(short) is short
    for unfit in ([-1] * wire.PACK_MIN, [2**32] * wire.PACK_MIN, [0.5] * wire.PACK_MIN,
                  ["a"] * wire.PACK_MIN):
        assert wire.pack_ids(unfit) is unfit
        assert wire.FrameDecoder().feed(wire.encode([wire.SUBMIT, 1, unfit, {}])) == [
            [wire.SUBMIT, 1, unfit, {}]]
    for other in ("text", {"messages": []}, None):
        assert wire.pack_ids(other) is other
    assert wire.hello_info({"engine": "sim"}) == {"engine": "sim", "packed_ids": True}


@pytest.mark.parametrize("payload", [b"\x01", b"\x01\x02\x03\x04\x05", b"\x00" * 16387])
def test_packed_ids_that_are_not_whole_uint32s_are_a_protocol_error(payload):
    bad = msgpack.ExtType(wire.PACKED_IDS, payload)
    for message in ([wire.RESULT, 1, {"tokens": bad}, None], [wire.SUBMIT, 1, bad, {}]):
        body = msgpack.packb(message)
        with pytest.raises(wire.ProtocolError, match="not a multiple of 4"):
            wire.FrameDecoder().feed(struct.pack(">I", len(body)) + body)
        with pytest.raises(wire.ProtocolError, match="not a multiple of 4"):
            wire.decode_sliced(body)


def test_packed_ids_in_the_wrong_place_are_a_malformed_message():
    """They arrive as a list, which the shape check judges as any list."""
    ids = wire.pack_ids(_ids(wire.PACK_MIN))
    for message, check in (([wire.SUBMIT, ids, "x", {}], wire.check_request),
                           ([wire.PING, ids], wire.check_request),
                           ([wire.RESULT, 1, ids, None], wire.check_reply)):
        with pytest.raises(wire.ProtocolError, match="malformed"):
            wire.FrameDecoder(check).feed(wire.encode(message))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2 * wire.SLICE), st.integers(0, 2))
def test_property_packed_ids_at_any_depth_arrive_as_lists(seed, extra, depth):
    """Wherever a packed list sits (in a map, in a list of lists, in a long list: the
    sliced decoder's item-per-call path), both decoders give the plain message."""
    ids = _ids(wire.PACK_MIN + extra, seed)
    plain: object = ids
    packed: object = wire.pack_ids(ids)
    for _ in range(depth):
        plain, packed = [plain], [packed]
    long_plain = [1] * (wire.SLICE + 1) + [plain]
    long_packed = [1] * (wire.SLICE + 1) + [packed]
    message = [wire.RESULT, 1, {"tokens": plain, "more": long_plain}, None]
    body = wire.encode([wire.RESULT, 1, {"tokens": packed, "more": long_packed}, None])[4:]
    assert wire.FrameDecoder().decode(body) == message
    assert wire.decode_sliced(body) == message


def test_release_sliced_empties_only_the_long_lists_of_a_result():
    long, short = list(range(3 * wire.SLICE + 5)), list(range(wire.SLICE))
    result = {"tokens": long, "token_strs": short, "max_model_len": 9}
    wire.release_sliced(result)
    assert long == [] and len(short) == wire.SLICE and result["max_model_len"] == 9
    rows = [list(range(wire.SLICE + 1))]
    wire.release_sliced(rows)
    assert rows == [[]]
    wire.release_sliced(None)  # (nothing to do)


def test_a_worker_packs_a_reply_with_any_long_list_a_slice_at_a_time():
    """tokenize_reply (a worker answering on its own, no helper process): a result holding
    a list of more than SLICE items is packed beforehand (off the step loop, a slice per
    call), also when its ids travel as an array and only their strings are a long list
    (review: that one was left for the loop's encode, 0.1 s per 1M strings)."""
    from server.workers.prepare import tokenize_reply

    ids = list(range(wire.SLICE + 1))
    strs = [str(i) for i in ids]
    for result in ({"tokens": ids}, {"tokens": wire.pack_ids(ids), "token_strs": strs}):
        reply = tokenize_reply(7, lambda request, result=result: result, {})
        assert type(reply[2]) is wire.Packed
        assert wire.FrameDecoder().feed(wire.encode(reply)) == [
            [wire.RESULT, 7, {**result, "tokens": ids}, None]]
    short = {"tokens": wire.pack_ids(ids), "token_strs": None}
    assert type(tokenize_reply(7, lambda request: short, {})[2]) is dict


# -- refusals that name the field (issue 41 item 8) -------------------------------------------

def test_an_err_of_two_or_three_items_passes_and_no_other():
    """A frontend takes ``[kind, message]`` (an older worker's, or a refusal of no field)
    and ``[kind, message, param]`` in a STEP's error row and in a RESULT."""
    for err in (["invalid_request", "no"], ["invalid_request", "no", "max_tokens"],
                ["invalid_request", "no", None]):
        wire.check_reply([wire.STEP, [], [[1, "", 0, "error", err]]])
        wire.check_reply([wire.RESULT, 1, None, err])
        assert wire.final_ok("error", err)
    for err in (["k", "m", 3], ["k", "m", "p", "q"], ["k", "m", b"p"]):
        with pytest.raises(wire.ProtocolError, match="malformed"):
            wire.check_reply([wire.STEP, [], [[1, "", 0, "error", err]]])
        with pytest.raises(wire.ProtocolError, match="malformed"):
            wire.check_reply([wire.RESULT, 1, None, err])


def test_a_worker_names_the_field_only_to_a_request_that_asks():
    """The third item goes only to a request carrying ``error_param`` (a frontend of this
    version: every SUBMIT's params and CALL request); an older frontend, which ends
    the connection on a three-item err, gets two."""
    from server import SamplingParams
    from server.workers.main import handle_message
    from server.engines.sim.engine import SimEngine

    asks = {wire.ERROR_PARAM_KEY: True}
    assert SamplingParams().to_wire()[wire.ERROR_PARAM_KEY] is True
    assert wire.error("invalid_request", "no", "max_tokens", asks) == [
        "invalid_request", "no", "max_tokens"]
    assert wire.error("invalid_request", "no", "max_tokens", {}) == ["invalid_request", "no"]
    assert wire.error("invalid_request", "no", None, asks) == ["invalid_request", "no"]

    engine = SimEngine(max_model_len=64)
    too_far = {"max_tokens": 4, "truncate_prompt_tokens": 1000}
    for params, err in (
        ({**too_far, **asks}, ["invalid_request", "truncate_prompt_tokens"]),
        (too_far, ["invalid_request"]),
        ({"max_tokens": 100, **asks}, ["invalid_request", "prompt"]),
        ({"max_tokens": "many", **asks}, ["invalid_request", "max_tokens"]),
        ({"max_tokens": 4, "seed": "x", **asks}, ["invalid_request", "seed"]),
    ):
        outputs: list = []
        handle_message(engine, [wire.SUBMIT, 1, "a b c", params], [], outputs)
        ((rid, _, _, finish, got),) = outputs
        assert finish == "error" and [got[0], *got[2:]] == err, (params, got)
    chat = {"messages": [{"role": "user", "content": "x " * 80}]}
    outputs = []
    handle_message(engine, [wire.SUBMIT, 2, chat, {"max_tokens": 4, **asks}], [], outputs)
    assert outputs[0][4][2] == "messages"
    embed = {"op": "embed", "input": ["a"], "dimensions": 10**6}
    for request, n in (({**embed, **asks}, 3), (embed, 2)):
        reply = handle_message(engine, [wire.CALL, 1, request], [], [])
        assert reply is not None and reply[2] is None and len(reply[3]) == n
        wire.check_reply(reply)
        assert reply[3][2:] == (["dimensions"] if n == 3 else [])


@pytest.mark.parametrize("pong, older", [
    # a pipe worker's PONG, then a listening worker's (with its connection's count)
    ([wire.PONG, 7, 3, 1, {"preemptions": 2, "mm_cache_queries": 3, "mm_cache_hits": 1}],
     [wire.PONG, 7, 3, 1, {"preemptions": 2}]),
    ([wire.PONG, 7, 3, 1, 2, {"mm_cache_queries": 3, "mm_cache_hits": 1}],
     [wire.PONG, 7, 3, 1, 2]),  # (no map left: none sent)
    ([wire.PONG, 7, 3, 1, 2, {"kv_cache_usage": 0.5}], [wire.PONG, 7, 3, 1, 2, {"kv_cache_usage": 0.5}]),
    ([wire.PONG, 7, 3, 1], [wire.PONG, 7, 3, 1]),
])
def test_a_pong_keeps_its_image_counters_for_a_frontend_that_reads_them_only(pong, older):
    """An older frontend reads a PONG map of the keys it knew (one more is malformed to
    it): a worker sends the image counters only to a frontend that said it reads them."""
    assert wire.pong_for(pong, True) == pong
    assert wire.pong_for(pong, False) == older
    assert not any(k in older[-1] for k in wire.IMAGE_STATS if isinstance(older[-1], dict))
    assert wire.check_reply(wire.pong_for(pong, False)) is not None


def test_a_frontend_subscribes_to_image_counters_by_name():
    assert wire.check_listener_request([wire.SUBSCRIBE, [wire.IMAGE_STATS_TOPIC, "parts"]])
    with pytest.raises(wire.ProtocolError, match="malformed"):
        wire.check_listener_request([wire.SUBSCRIBE, ["image_statistics"]])
