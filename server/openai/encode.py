"""OpenAI response bodies and SSE events, as bytes. Sans-IO.

Streaming chunks are the hot path (one per event sent), so :class:`ChunkEncoder` pre-encodes
everything that is the same for every chunk of a response (id, object, created, model) once,
and a chunk costs one ``json.dumps`` of the text delta plus a few byte concatenations.

Shapes, field for field as OpenAI sends them::

    data: {"id":"cmpl-..","object":"text_completion","created":1700000000,"model":"sim",
           "choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null}]}

    data: {"id":"chatcmpl-..","object":"chat.completion.chunk",...,
           "choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,"finish_reason":null}]}

    data: [DONE]
"""

from __future__ import annotations

from typing import Any

import json

import msgspec

from ..errors import ServerError, error_body

__all__ = ["ChunkEncoder", "DONE", "completion_body", "dumps", "dumps_document", "dumps_sliced",
           "error_event", "text_json"]

#: The last event of every stream.
DONE = b"data: [DONE]\n\n"

_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

#: Line breaks that JSON leaves unescaped but that a line splitter following Unicode cuts
#: an SSE ``data:`` line at: Python's ``str.splitlines``, so httpx's ``aiter_lines`` and the
#: SSE clients built on it (a random model's text broke a benchmark client's stream so).
#: Their ``\u`` escapes are the same string to every JSON parser.
_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(obj) -> str:
    """Compact JSON that stays on one line for every line splitter (:data:`_BREAKS`).
    ASCII-only text, the common case, costs one flag test more than ``json.dumps``."""
    text = _json(obj)
    if text.isascii() or not ("\x85" in text or "\u2028" in text or "\u2029" in text):
        return text
    return text.translate(_BREAKS)


#: What ``_json`` does with a ``str`` (ensure_ascii off), without its Python-level type tests.
_encode_str = json.encoder.encode_basestring


def text_json(text: str) -> bytes:
    """``_dumps(text).encode()`` for a ``str``: a streamed delta's text as a JSON string.
    One C call instead of the encoder's Python-level dispatch (once per streamed event).
    Strict like ``delta``: a lone surrogate raises UnicodeEncodeError."""
    quoted = _encode_str(text)
    if not quoted.isascii() and ("\x85" in quoted or "\u2028" in quoted or "\u2029" in quoted):
        quoted = quoted.translate(_BREAKS)
    return quoted.encode()


def dumps(obj) -> bytes:
    """Compact JSON as UTF-8 bytes (a lone surrogate, which only a client can send us inside
    a JSON escape, is replaced rather than failing the answer)."""
    return _dumps(obj).encode("utf-8", "replace")


_encode_document = msgspec.json.Encoder().encode


def dumps_document(obj) -> bytes:
    """:func:`dumps` of a whole non-streaming answer, with msgspec: 8 times as fast on the
    big ones (n=16 x 900 tokens x top 20 logprobs: 22 MB in 0.2 s, 1.7 s with the standard
    library), and the encode holds the GIL, so the event loop, all along. Floats are
    written in their shortest form either way (``1e-05`` here reads ``0.00001``)."""
    try:
        return _encode_document(obj)
    except UnicodeEncodeError:  # a lone surrogate
        return dumps(obj)


#: Items of a long list encoded per call by :func:`dumps_sliced`: containers (logprob
#: entries, about 1.5 KB each with 20 alternatives) and scalars (token ids).
_PIECE_CONTAINERS = 256
_PIECE_SCALARS = 16384


def dumps_sliced(obj) -> bytes:
    """:func:`dumps_document`'s bytes, in calls of a few milliseconds each: dicts a value
    at a time, a long list a piece at a time. For a big answer built in a worker thread
    (n=16 x 900 tokens x 20 logprobs, 22 MB; a /tokenize of 3.5M ids): one msgspec call
    holds the GIL for its whole 0.2 s, so the event loop beside the thread would wait that
    long; between these calls it gets its turn."""
    parts: list[bytes] = []
    try:
        _encode_into(obj, parts)
    except UnicodeEncodeError:  # a lone surrogate
        return dumps(obj)
    return b"".join(parts)


def _encode_into(obj, parts: list[bytes]) -> None:
    if type(obj) is dict and obj:
        sep = b"{"
        for key, value in obj.items():
            parts.append(sep + _encode_document(key) + b":")
            _encode_into(value, parts)
            sep = b","
        parts.append(b"}")
    elif type(obj) is list and obj:
        # (by the first few: prompt_logprobs and echo's top_logprobs start with None)
        containers = any(type(item) in (dict, list) for item in obj[:4])
        piece = _PIECE_CONTAINERS if containers else _PIECE_SCALARS
        if len(obj) <= piece and containers:  # (few: each may be big, a choice say)
            sep = b"["
            for item in obj:
                parts.append(sep)
                _encode_into(item, parts)
                sep = b","
        else:
            sep = b"["
            for start in range(0, len(obj), piece):
                parts.append(sep + _encode_document(obj[start:start + piece])[1:-1])
                sep = b","
        parts.append(b"]")
    else:
        parts.append(_encode_document(obj))


def error_event(exc: ServerError) -> bytes:
    """``data: {"error": {...}}``: makes the OpenAI SDK raise instead of ending quietly."""
    return b"data: " + dumps(error_body(exc)) + b"\n\n"


def _finish(reason: str | None) -> bytes:
    return b"null" if reason is None else b'"' + reason.encode() + b'"'


class ChunkEncoder:
    """The SSE events of one streaming response."""

    __slots__ = ("_head", "_mid", "_tail", "_chat", "_usage_head")

    def __init__(self, *, chat: bool, response_id: str, created: int, model: str) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = dumps({"id": response_id, "object": obj, "created": created, "model": model})
        self._chat = chat
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'
        self._usage_head = b"data: " + head[:-1] + b',"choices":[],"usage":'
        if chat:
            self._mid = b',"delta":{"content":'
            self._tail = b'},"logprobs":null,"finish_reason":'
        else:
            self._mid = b',"text":'
            self._tail = b',"logprobs":null,"finish_reason":'

    def delta(self, index: int, text: str, finish_reason: str | None = None) -> bytes:
        """A chunk with new text for one choice (and its finish reason, if it ended)."""
        if self._chat and not text and finish_reason is not None:
            return (
                self._head + str(index).encode() + b',"delta":{},"logprobs":null,"finish_reason":'
                + _finish(finish_reason) + b"}]}\n\n"
            )
        return (
            self._head + str(index).encode() + self._mid + text_json(text)
            + self._tail + _finish(finish_reason) + b"}]}\n\n"
        )

    def text_parts(self, index: int) -> tuple[bytes, bytes]:
        """The bytes before and after the text of choice ``index``'s deltas that do not
        finish: ``head + text_json(text) + tail == delta(index, text)``. For a writer of
        many such events (the router's sink), which builds the fixed parts once."""
        return self._head + str(index).encode() + self._mid, self._tail + b"null}]}\n\n"

    def delta_logprobs(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None
    ) -> bytes:
        """:meth:`delta` with a logprobs object (requests that asked for logprobs)."""
        lp = dumps(logprobs) if logprobs is not None else b"null"
        if self._chat:
            body = b',"delta":{}' if not text and finish_reason is not None else (
                self._mid + _dumps(text).encode() + b"}"
            )
        else:
            body = self._mid + _dumps(text).encode()
        return (
            self._head + str(index).encode() + body + b',"logprobs":' + lp
            + b',"finish_reason":' + _finish(finish_reason) + b"}]}\n\n"
        )

    def delta_reasoning(
        self,
        index: int,
        reasoning: str,
        content: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        tool_calls: list | None = None,
    ) -> bytes:
        """A chat chunk with ``reasoning`` (and ``reasoning_content``) and/or ``content``
        (--reasoning-parser), and/or ``tool_calls`` deltas (--tool-call-parser)."""
        delta: dict = {}
        if reasoning:  # vLLM 0.32's name, and the older one
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content or not (reasoning or finish_reason or tool_calls):
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        lp = dumps(logprobs) if logprobs is not None else b"null"
        return (
            self._head + str(index).encode() + b',"delta":' + dumps(delta) + b',"logprobs":'
            + lp + b',"finish_reason":' + _finish(finish_reason) + b"}]}\n\n"
        )

    @staticmethod
    def with_usage(chunk: bytes, usage_so_far: dict) -> bytes:
        """A chunk of :meth:`delta` (or its kin) with ``usage`` added
        (``stream_options.continuous_usage_stats``)."""
        return chunk[:-3] + b',"usage":' + dumps(usage_so_far) + b"}\n\n"

    def role(self, index: int) -> bytes:
        """A chat choice's opening chunk: ``delta: {"role": "assistant", "content": ""}``."""
        return (
            self._head + str(index).encode()
            + b',"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def usage(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> bytes:
        """The last chunk with ``include_usage``: no choices, just the usage."""
        body = usage(prompt_tokens, completion_tokens, cached_tokens)
        return self._usage_head + dumps(body) + b"}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details`` only from an engine that reports its
    prefix-cache hits."""
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_body(
    *,
    chat: bool,
    response_id: str,
    created: int,
    model: str,
    texts: list[str],
    finish_reasons: list[str | None],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    logprobs: list | None = None,
    reasoning: list | None = None,
    tool_calls: list | None = None,
    token_ids: list | None = None,
    prompt_token_ids: list | None = None,
    prompt_logprobs: list | None = None,
) -> bytes:
    """The body of a non-streaming completions or chat response.

    The optional lists hold one item per choice, and are None where the request did not
    ask:

    * ``logprobs``: each choice's logprobs object;
    * ``reasoning``: each chat choice's ``reasoning`` (and ``reasoning_content``), with
      --reasoning-parser;
    * ``tool_calls``: each chat choice's calls, for requests with tools;
    * ``token_ids`` and ``prompt_token_ids``: each choice's ids, with ``return_token_ids``.
      They are vLLM's fields, null when not asked, as vLLM's answer has them. A chat
      answer's prompt ids are its one prompt's, on the response;
    * ``prompt_logprobs``: each choice's, in vLLM's shape, null when not asked.
    """
    lps = logprobs or [None] * len(texts)
    prompt_lps = prompt_logprobs or [None] * len(texts)
    ids = token_ids or [None] * len(texts)
    prompt_ids = prompt_token_ids or [None] * len(texts)
    if chat:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": reason,
                "token_ids": tokens,
            }
            for i, (text, reason, lp, tokens) in enumerate(zip(texts, finish_reasons, lps, ids))
        ]
        if reasoning is not None:
            for choice, thought in zip(choices, reasoning):
                # vLLM 0.32's name, and the older one clients may still read
                choice["message"]["reasoning"] = thought or None
                choice["message"]["reasoning_content"] = thought or None
        if tool_calls is not None:
            for choice, calls in zip(choices, tool_calls):
                if calls:
                    choice["message"]["tool_calls"] = calls
    else:
        choices = [
            {"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
             "token_ids": tokens, "prompt_logprobs": prompt_lp,  # (vLLM's fields)
             "prompt_token_ids": prompt}
            for i, (text, reason, lp, tokens, prompt, prompt_lp) in enumerate(
                zip(texts, finish_reasons, lps, ids, prompt_ids, prompt_lps))
        ]
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }
    if chat:  # (vLLM's fields, on the response)
        body["prompt_logprobs"] = prompt_lps[0] if prompt_lps else None
        body["prompt_token_ids"] = prompt_ids[0] if prompt_ids else None
    if logprobs or prompt_logprobs or token_ids:  # (what can be big: dumps_sliced)
        return dumps_sliced(body)
    return dumps_document(body)
