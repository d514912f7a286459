"""dumps_sliced (a big answer's JSON, built in a worker thread a piece per call so that the
event loop gets the GIL between pieces) makes the very bytes dumps_document makes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from server.openai.encode import completion_body, dumps_document, dumps_sliced

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner,
                                                                  max_size=6),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(_values)
def test_the_same_bytes_as_one_call(value):
    assert dumps_sliced(value) == dumps_document(value)


def test_long_lists_in_pieces_and_a_lone_surrogate():
    entry = {"token": "é", "logprob": -0.5, "bytes": [195, 169],
             "top_logprobs": [{"token": "a", "logprob": -1.25, "bytes": [97]}] * 20}
    for value in (list(range(40_000)), [entry] * 1000, {"a": [[1, 2]] * 600, "b": {}},
                  [[], {}, [[]]], [1, [2] * 20_000, "x"]):
        assert dumps_sliced(value) == dumps_document(value)
    odd = {"text": "\ud800", "ids": list(range(20_000))}
    assert json.loads(dumps_sliced(odd)) == json.loads(dumps_document(odd))


def test_a_big_answer_is_the_document_it_was():
    lps = [{"content": [{"token": "t", "logprob": -0.1, "bytes": [116],
                         "top_logprobs": [{"token": "u", "logprob": -2.0, "bytes": [117]}]}]
            * 900} for _ in range(16)]
    kwargs = dict(chat=True, response_id="r", created=1, model="m", texts=["t" * 900] * 16,
                  finish_reasons=["length"] * 16, prompt_tokens=3, completion_tokens=14400,
                  cached_tokens=None, logprobs=lps)
    body = completion_body(**kwargs)
    assert body == dumps_document(json.loads(body))
    assert len(json.loads(body)["choices"][15]["logprobs"]["content"]) == 900


def test_a_list_of_documents_led_by_none_is_cut_as_documents(monkeypatch):
    """prompt_logprobs (and echo's top_logprobs) start with None: the list is still cut a
    few documents per call, not as a list of scalars (16,384 per call)."""
    from server.openai import encode

    calls: list[int] = []
    one_call = encode._encode_document

    def recording(value):
        out = one_call(value)
        calls.append(len(out))
        return out

    monkeypatch.setattr(encode, "_encode_document", recording)
    entry = {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "é"}}
    value = [None] + [entry] * 5000
    whole, one = dumps_document(value), len(dumps_document(entry))
    calls.clear()
    assert dumps_sliced(value) == whole
    assert max(calls) <= (encode._PIECE_CONTAINERS + 1) * (one + 1)  # (with commas)
