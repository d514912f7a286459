"""The OpenAI completions, chat and Responses APIs as the load generator speaks them (sans-IO).

Request bodies (:class:`BodyMaker`), the reading of a streamed response's events
(:class:`StreamTracker`: timings, tokens, ``[DONE]``, errors) and error messages.
"""

from __future__ import annotations

import json

_json_loads = json.loads


_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def prompt_tail(n_words: int) -> str:
    """All but the first word of a prompt of ``n_words`` whitespace-separated words (the
    first word is unique per request, so no two prompts are identical)."""
    rest = [_WORDS[i % len(_WORDS)] for i in range(max(n_words - 1, 0))]
    return " " + " ".join(rest) if rest else ""


class BodyMaker:
    """Request bodies: the same JSON for every request except a unique first prompt word."""

    _MARK = "QQLOADGENMARKQQ"

    def __init__(self, *, chat: bool, model: str, prompt_tokens: int, max_tokens: int,
                 include_usage: bool, extra: dict | None = None,
                 responses: bool = False) -> None:
        prompt = self._MARK + prompt_tail(prompt_tokens)
        body: dict = {"model": model}
        if responses:  # /v1/responses: usage always comes in response.completed
            body["input"] = prompt
            body["max_output_tokens"] = max_tokens
        else:
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            body["max_tokens"] = max_tokens
        body["stream"] = True
        if include_usage and not responses:
            body["stream_options"] = {"include_usage": True}
        if extra:
            body.update(extra)
        encoded = json.dumps(body, separators=(",", ":")).encode()
        self._pre, self._post = encoded.split(self._MARK.encode(), 1)

    def body(self, ticket: int) -> bytes:
        return self._pre + b"r%d" % ticket + self._post


class StreamTracker:
    """Follows the SSE events of one OpenAI streaming response and keeps its timings.

    ``on_event(event_type, data, now)`` for each event, with ``now`` the receipt time in
    seconds (any clock). Afterwards: ``first`` (time of the first content event, or None),
    ``gaps`` (seconds between consecutive content events), ``content_events``, ``usage_tokens``
    (``usage.completion_tokens`` of the last chunk that had one), ``done`` (saw ``[DONE]``),
    ``error`` (message of the first error event, or None) and ``error_code`` (its
    ``error.code``, e.g. ``"worker_died"``, when it had one).

    With ``responses=True`` it reads the Responses API's typed events instead: content is
    ``response.output_text.delta``, the end is ``response.completed`` (that API sends no
    ``[DONE]``), usage is its ``response.usage.output_tokens``, and ``response.failed`` or
    ``error`` is an error.
    """

    __slots__ = ("chat", "responses", "first", "last", "gaps", "content_events", "usage_tokens", "done",
                 "error", "error_code", "events")

    def __init__(self, *, chat: bool, responses: bool = False) -> None:
        self.chat = chat
        self.responses = responses
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.content_events = 0
        self.usage_tokens: int | None = None
        self.done = False
        self.error: str | None = None
        self.error_code: str | None = None
        self.events = 0

    @property
    def tokens(self) -> int:
        """Delivered tokens: from the usage chunk, else one per content event."""
        return self.usage_tokens if self.usage_tokens is not None else self.content_events

    def on_event(self, event_type: str, data: str, now: float) -> None:
        self.events += 1
        if data == "[DONE]" or (len(data) < 16 and data.strip() == "[DONE]"):
            self.done = True
            return
        if event_type == "error":
            self._set_error(error_message(data))
            return
        if self.responses:
            self._on_responses_event(event_type, data, now)
            return
        obj = self._object(data)
        if obj is None:
            return
        err = obj.get("error")
        if err is not None:
            if self.error is None and type(err) is dict and type(err.get("code")) is str:
                self.error_code = err["code"]
            self._set_error(error_message(obj))
            return
        usage = obj.get("usage")
        if usage and type(usage) is dict:
            ct = usage.get("completion_tokens")
            if type(ct) is int:
                self.usage_tokens = ct
        choices = obj.get("choices")
        if not choices:
            return
        has_text = False
        if self.chat:
            for c in choices:
                d = c.get("delta")
                if d and d.get("content"):
                    has_text = True
                    break
        else:
            for c in choices:
                if c.get("text"):
                    has_text = True
                    break
        if has_text:
            self._content(now)

    def _content(self, now: float) -> None:
        self.content_events += 1
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def _on_responses_event(self, event_type: str, data: str, now: float) -> None:
        if event_type == "response.output_text.delta":
            self._content(now)
            return
        if event_type not in ("response.completed", "response.failed", "response.incomplete"):
            return
        obj = self._object(data)
        if obj is None:
            return
        response = obj.get("response")
        if type(response) is not dict:
            self._set_error(f"{event_type} without a response object")
            return
        if event_type == "response.failed":
            self._set_error(error_message({"error": response.get("error") or "failed"}))
        usage = response.get("usage")
        if type(usage) is dict and type(usage.get("output_tokens")) is int:
            self.usage_tokens = usage["output_tokens"]
        self.done = True

    def _object(self, data: str) -> dict | None:
        """The event's data as a JSON object, else None (and the error noted)."""
        try:
            obj = _json_loads(data)
        except ValueError:
            self._set_error(f"event data is not JSON: {data[:80]!r}")
            return None
        if type(obj) is not dict:
            self._set_error(f"event data is not a JSON object: {data[:80]!r}")
            return None
        return obj

    def _set_error(self, message: str) -> None:
        if self.error is None:
            self.error = message


def error_message(body) -> str:
    """The message of an OpenAI error body (dict, JSON text or bytes), else the text itself."""
    obj = body
    if isinstance(body, (bytes, str)):
        try:
            obj = json.loads(body)
        except ValueError:
            text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
            return text.strip()[:200] or "(empty)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("type") or json.dumps(err)[:200]
            return str(msg)[:200]
        return str(err)[:200]
    return json.dumps(obj)[:200]
