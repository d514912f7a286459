"""What one frame may cost a listening worker (issue 42, item 2), sans-IO: the frame size by
message type judged from a frame's first bytes, the decoding budgets, and the AUTH nonce's
length. The same bounds against a real worker process: tests/test_hostile_worker_frames.py.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings

from server.worker_protocol import limits, wire
from tests import frames


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def _empties(n: int) -> bytes:
    """The body of an array of ``n`` empty arrays, as bytes (building the list would cost
    what the test is about)."""
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


def _nest(depth: int) -> object:
    value: object = "x" * 20000  # (a big frame: walked)
    for _ in range(depth):
        value = [value]
    return value


def _submit_of_empties(n: int, rid: int = 7) -> bytes:
    """``[SUBMIT, rid, [[], [], ... n], {}]`` as frame bytes."""
    return _frame(b"\x94" + msgpack.packb(wire.SUBMIT) + msgpack.packb(rid)
                  + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\x80")


def test_the_type_is_read_from_the_first_bytes():
    for message in ([wire.PING, 1], [wire.SUBMIT, 2**40, "x" * 70000, {}],
                    [wire.CALL, -1, {"op": "info"}]):
        body = wire.encode(message)[4:]
        assert wire.peek_kind(body, 0, len(body)) == message[0]
        assert wire.peek_head(body) == (message[0], message[1])
        assert wire.peek_kind(body, 0, 1 if body[0] < 0xA0 else 3) == wire.MORE
    long = b"\xdc\x00\x10" + bytes([wire.PING]) + b"\xc0" * 15  # an array16 header
    assert wire.peek_kind(long, 0, len(long)) == wire.PING
    for body in (b"\x90", b"\xdc\x00\x00\x01", b"\x91\xa1x", b"\x81\xa1a\x01", b"\x01"):
        assert wire.peek_kind(body, 0, len(body)) is None
        assert wire.peek_head(body) == (None, None)
    assert wire.peek_head(b"\x91\x01") == (wire.SUBMIT, None)  # no second item
    assert wire.peek_head(b"\x92\x01\xa1x") == (wire.SUBMIT, None)  # not an integer


@pytest.mark.parametrize("kind", [wire.PING, wire.ABORT, wire.SHUTDOWN, wire.SUBSCRIBE,
                                  wire.AUTH, 99])
def test_a_small_type_over_its_limit_is_refused_from_its_first_bytes(kind):
    decoder = wire.FrameDecoder(limits=limits.REQUESTS)
    frame = wire.encode([kind, "x" * limits.SMALL])
    # refused once its first bytes are in: the rest is never buffered
    with pytest.raises(wire.ProtocolError, match=f"frame of {len(frame) - 4} bytes exceeds "
                       f"its limit of {limits.SMALL}"):
        decoder.feed(frame[:10])
    assert decoder.buffered <= 10
    # a frame up to the limit is read, and one without limits is read whole
    assert wire.FrameDecoder(limits=limits.REQUESTS).feed(wire.encode([kind, "x"])) == [
        [kind, "x"]]
    assert wire.FrameDecoder().feed(frame) == [[kind, "x" * limits.SMALL]]


def test_the_frame_of_the_issue_is_refused_from_its_first_bytes():
    n = 24_000_000
    frame = _frame(_empties(n))
    decoder = wire.FrameDecoder(limits=limits.REQUESTS)
    with pytest.raises(wire.ProtocolError, match=f"a non-message frame of {n + 5} bytes "
                       "exceeds its limit of 4096"):
        decoder.feed(frame[:1 << 16])
    # before authenticating, every type is small
    with pytest.raises(wire.ProtocolError, match="a SUBMIT frame of .* limit of 4096"):
        wire.FrameDecoder(limits=limits.HANDSHAKE).feed(_submit_of_empties(5000)[:100])


@pytest.mark.parametrize("frame, over", [
    (_submit_of_empties(8_000_000), "more than 1,048,576 values"),
    (wire.encode([wire.SUBMIT, 7, [[[]] * 1000] * 100, {}]), "more than 65,536 arrays and maps"),
    (wire.encode([wire.SUBMIT, 7, wire.pack_ids([1] * (limits.IDS + 1)), {}]),
     "more than 4,194,304 token ids"),
    (wire.encode([wire.SUBMIT, 7, {"messages": [_nest(300)]}, {}]),
     "arrays and maps nested more than 256 deep"),
])
def test_a_request_over_a_budget_is_refused_as_its_own_error(frame, over):
    decoder = wire.FrameDecoder(wire.check_request, limits=limits.REQUESTS)
    after = wire.encode([wire.PING, 1])
    assert decoder.feed(frame + after) == [[wire.PING, 1]]  # the frames after it are read
    (refused,) = decoder.refused
    assert (refused.kind, refused.ident) == (wire.SUBMIT, 7)
    assert refused.message == f"the request is too large for the worker to decode: {over}"
    # as a CALL, the same; as another type (or without an integer id) it ends the
    # connection
    frame = bytearray(frame)
    frame[5 if frame[4] != 0xDC else 7] = wire.CALL
    decoder.refused.clear()
    decoder.feed(bytes(frame))
    assert [(r.kind, r.ident) for r in decoder.refused] == [(wire.CALL, 7)]


def test_a_frame_without_a_request_id_over_a_budget_ends_the_connection():
    frame = wire.encode([wire.SUBMIT, "7", [[]] * (limits.VALUES + 1), {}])
    with pytest.raises(wire.ProtocolError, match="a frame over the decoding limits: more "
                       "than 1,048,576 values"):
        wire.FrameDecoder(limits=limits.REQUESTS).feed(frame)


def test_big_legitimate_requests_decode_as_without_limits():
    ids = list(range(1_500_000))  # (packed: more ids than the budget's values)
    messages = [
        [wire.CALL, 1, {"op": "tokenize", "prompt": "x" * 3_500_000}],
        [wire.SUBMIT, 2, wire.pack_ids(ids), {"max_tokens": 3, "stop": ["a"] * 100,
                                              "resume": {"token_ids": ids[:100_000]}}],
        [wire.SUBMIT, 3, {"messages": [{"role": "user", "content": "y" * 100}] * 5000},
         {"response_format": {"type": "json_schema", "schema": _nest(100)}},
         "adapter", [b"n" * 8] * wire.ROUTED_MAX],
        [wire.CALL, 4, {"op": "embed", "input": [[1, 2, 3] * 100] * 2048}],
    ]
    stream = b"".join(map(wire.encode, messages))
    plain = wire.FrameDecoder().feed(stream)
    decoder = wire.FrameDecoder(limits=limits.REQUESTS)
    assert decoder.feed(stream) == plain
    assert not decoder.refused
    assert plain[1][2] == ids


@settings(max_examples=frames.EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(frames.requests)
def test_the_walk_reads_what_msgpack_reads(message):
    """Any request, big enough to be walked (padded past PLAIN), decodes as unpackb does."""
    body = wire.encode([*message, "p" * limits.PLAIN])[4:]
    try:
        plain = msgpack.unpackb(body, use_list=True, raw=False, ext_hook=wire.unpack_ext)
    except ValueError:  # a malformed packed payload
        with pytest.raises(wire.ProtocolError, match="undecodable"):
            limits.REQUESTS.decode(body)
        return
    # (compared as bytes: a NaN is not equal to itself)
    assert wire.encode(limits.REQUESTS.decode(body)) == wire.encode(plain)


def test_bad_bytes_in_a_walked_frame_are_a_protocol_violation():
    good = wire.encode([wire.SUBMIT, 1, "x" * limits.PLAIN, {}])
    for bad, why in ((good[:-1], "undecodable"), (good + b"\xc0", "undecodable"),
                     (wire.encode([wire.SUBMIT, 1, "x" * limits.PLAIN, {1: 2}]), "map key"),
                     (wire.encode([wire.SUBMIT, 1, "x" * limits.PLAIN, {(1,): 2}]),
                      "map key")):
        body = bad[4:]
        with pytest.raises(wire.ProtocolError, match=why):
            limits.REQUESTS.decode(body)


def test_an_auth_nonce_and_proof_are_32_bytes():
    nonce = bytes(32)
    assert wire.check([wire.AUTH, nonce, None], [wire.AUTH])
    assert wire.check([wire.AUTH, nonce, nonce], [wire.AUTH])
    for bad in ([wire.AUTH, b"\x01", None], [wire.AUTH, bytes(33), None],
                [wire.AUTH, nonce, b"\x01"], [wire.CHALLENGE, 1, b"\x01", True]):
        with pytest.raises(wire.ProtocolError, match="malformed"):
            wire.check(bad, [bad[0]])
