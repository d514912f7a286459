"""Hypothesis strategies for worker-protocol messages: well-formed ones of every type, the
same with one item dropped, added or replaced (nested rows included), arbitrary
msgpack-able lists of any type, and messages with packed token ids (``wire.PACKED_IDS``:
well placed, misplaced, or a payload whose length is not a multiple of 4). What each side
must do with them is the sans-IO check's verdict on the message as it arrives
(:func:`server.worker_protocol.wire.check_request` / ``check_reply``); the tests that feed
them to real processes compare what the process did with that verdict.
"""

from __future__ import annotations

import os

import msgpack
from hypothesis import strategies as st

from server.worker_protocol import wire

#: Examples per end-to-end property test (each is a round trip to a real process).
EXAMPLES = int(os.environ.get("TRIO_LLM_FRAME_EXAMPLES", "40"))

_ints = st.integers(-(2**63), 2**64 - 1)
_counts = st.integers(0, 2**32)
_small_text = st.text(max_size=8)

#: Any msgpack value, nested a little (map keys are strings: msgpack's default for maps).
values = st.recursive(
    st.none() | st.booleans() | _ints | st.floats() | _small_text | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(_small_text, inner, max_size=3),
    max_leaves=10,
)

_error = (st.tuples(_small_text, _small_text).map(list)
          | st.tuples(_small_text, _small_text, _small_text | st.none()).map(list))
_params = st.fixed_dictionaries(
    {}, optional={"max_tokens": st.integers(1, 8) | st.none() | values,
                  "temperature": st.floats(0, 2) | values, "seed": _ints | st.none(),
                  "stop": st.lists(_small_text, max_size=2) | values},
)
_prompt = (
    _small_text
    | st.lists(st.integers(0, 1000), max_size=4)
    | st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": _small_text}), max_size=2)})
    | st.dictionaries(_small_text, values, max_size=2)
)
_output = st.one_of(
    st.tuples(_ints, _small_text, _counts, st.sampled_from([None, "stop", "length", "abort"]),
              st.none()),
    st.tuples(_ints, _small_text, _counts, st.just("error"), _error),
).map(list)
_entry = st.tuples(_small_text, st.floats(-20, 0) | st.none(),
                   st.lists(st.tuples(_small_text, st.floats(-20, 0)).map(list), max_size=2)
                   ).map(list)
_seconds = st.floats(0, 1e6) | st.integers(0, 10**6)
_note = st.tuples(_ints, st.fixed_dictionaries({}, optional={
    "cached_tokens": _counts, "logprobs": st.lists(_entry, max_size=2),
    "prompt_logprobs": st.lists(_entry, max_size=2),
    "times": st.fixed_dictionaries(dict.fromkeys(("queue", "prefill", "decode", "inference"),
                                                 _seconds))})).map(list)
_engine_stats = st.fixed_dictionaries({}, optional={
    "kv_cache_usage": st.floats(0, 1), "deferred": _counts, "preemptions": _counts,
    "iteration_tokens": st.lists(_counts, min_size=len(wire.ITERATION_TOKEN_BUCKETS) + 2,
                                 max_size=len(wire.ITERATION_TOKEN_BUCKETS) + 2)})
_rows = st.lists(st.tuples(_ints, _counts).map(list), max_size=3)
_nonce = st.binary(min_size=32, max_size=32)

#: Well-formed messages of every type, by type.
WELL_FORMED = {
    wire.HELLO: st.tuples(st.just(wire.HELLO), st.dictionaries(_small_text, values, max_size=3)),
    wire.SUBMIT: st.tuples(st.just(wire.SUBMIT), _ints, _prompt, _params),
    wire.ABORT: st.tuples(st.just(wire.ABORT), _ints),
    wire.PING: st.tuples(st.just(wire.PING), _ints),
    wire.PONG: st.tuples(st.just(wire.PONG), _ints, _counts, _counts)
    | st.tuples(st.just(wire.PONG), _ints, _counts, _counts, _counts)
    | st.tuples(st.just(wire.PONG), _ints, _counts, _counts, _counts, _engine_stats)
    | st.tuples(st.just(wire.PONG), _ints, _counts, _counts, _engine_stats),
    wire.SHUTDOWN: st.tuples(st.just(wire.SHUTDOWN)),
    wire.STEP: st.tuples(st.just(wire.STEP), _rows, st.lists(_output, max_size=3))
    | st.tuples(st.just(wire.STEP), _rows, st.lists(_output, max_size=3),
                st.lists(_note, max_size=2)),
    wire.CALL: st.tuples(st.just(wire.CALL), _ints,
                             st.dictionaries(_small_text, values, max_size=3)),
    wire.RESULT: st.tuples(st.just(wire.RESULT), _ints, st.dictionaries(
        _small_text, values, max_size=2), st.none())
    | st.tuples(st.just(wire.RESULT), _ints, st.none(), _error),
    wire.CHALLENGE: st.tuples(st.just(wire.CHALLENGE), st.integers(0, 3), _nonce,
                              st.booleans()),
    wire.AUTH: st.tuples(st.just(wire.AUTH), _nonce, _nonce | st.none()),
    wire.REFUSED: st.tuples(st.just(wire.REFUSED), _small_text),
    wire.LEAVING: st.tuples(st.just(wire.LEAVING), st.floats(0, 1e6)),
}


def _mutate(args) -> list:
    """One change to a message: drop, add or replace an item (``where`` picks it; a list
    item may be changed one level down, as a row of a STEP)."""
    message, how, where, value = args
    message = list(message)
    if how == "add":
        message.append(value)
        return message
    if len(message) < 2:
        return [message[0], value]
    i = 1 + where % (len(message) - 1)
    item = message[i]
    if how == "deep" and isinstance(item, list) and item:
        item = list(item)
        j = where % len(item)
        row = item[j]
        if isinstance(row, list) and row:
            row = list(row)
            row[where % len(row)] = value
            item[j] = row
        else:
            item[j] = value
        message[i] = item
    elif how == "drop":
        del message[i]
    else:
        message[i] = value
    return message


#: Long token-id lists as a sender packs them (uint32 arrays, sent as wire.PACKED_IDS):
#: wire.PACK_MIN ids or a few more, from anywhere in 0..2**32-1.
long_ids = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 3)).map(
    lambda a: wire.pack_ids([(a[0] + 7919 * i) % 2**32 for i in range(wire.PACK_MIN + a[1])]))
#: A PACKED_IDS payload that is not whole uint32s: undecodable, a protocol violation.
bad_packed = st.binary(max_size=11).filter(lambda b: len(b) % 4 != 0).map(
    lambda b: msgpack.ExtType(wire.PACKED_IDS, b))

#: Well-formed messages that carry packed ids, by type: a SUBMIT's token-id prompt, a
#: detokenize's tokens, a /tokenize answer's tokens.
PACKED = {
    wire.SUBMIT: st.tuples(st.just(wire.SUBMIT), _ints, long_ids, _params),
    wire.CALL: st.tuples(st.just(wire.CALL), _ints, st.fixed_dictionaries(
        {"op": st.just("detokenize"), "tokens": long_ids})),
    wire.RESULT: st.tuples(st.just(wire.RESULT), _ints, st.fixed_dictionaries(
        {"tokens": long_ids, "max_model_len": _counts}), st.none()),
}


def messages(kinds) -> st.SearchStrategy[list]:
    """Messages mostly of ``kinds``: well formed, changed once, or of any shape at all;
    some carry packed ids (well placed, misplaced, or malformed)."""
    good = st.one_of([WELL_FORMED[k] for k in kinds]).map(list)
    changed = st.tuples(good, st.sampled_from(["add", "drop", "replace", "deep"]),
                        st.integers(0, 100), values).map(_mutate)
    anything = st.builds(lambda kind, rest: [kind, *rest],
                         st.sampled_from(sorted(WELL_FORMED)) | st.integers(-3, 20),
                         st.lists(values, max_size=5))
    packed = st.one_of([PACKED[k] for k in kinds if k in PACKED]).map(list)
    packed_changed = st.tuples(good | packed, st.sampled_from(["add", "replace", "deep"]),
                               st.integers(0, 100), long_ids | bad_packed).map(_mutate)
    return st.one_of(good, changed, anything, packed, packed_changed)


#: What a frontend could send a worker, and a worker a frontend (other types now and then).
requests = messages(sorted(wire.REQUESTS) + [wire.AUTH])
replies = messages(sorted(wire.REPLIES) + [wire.HELLO])


def arrived(message: list) -> list:
    """``message`` as its receiver decodes it (packed ids come as lists); ProtocolError
    when it cannot (a malformed packed payload)."""
    (got,) = wire.FrameDecoder().feed(wire.encode(message))
    return got


def verdict(check, message: list) -> bool:
    """Whether ``check`` accepts ``message`` as it arrives (a ProtocolError is a no)."""
    try:
        check(arrived(message))
    except wire.ProtocolError:
        return False
    return True
