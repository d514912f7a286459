"""``POST /v1/responses``, the answer side: a Response object's output items and its stream
of events, built from the engine's text. Sans-IO.

Theory of operation
-------------------
The text of the one choice is fed in as it comes (:meth:`ResponseEvents.feed`). It goes
through the reasoning splitter (``--reasoning-parser``), then the tool call parser (for a
request with tools, ``tool_choice`` auto, required or named), exactly as chat's
:class:`~server.openai.events.RichEvents`; each piece lands in an output item:

- thinking in a ``reasoning`` item (``content: [{"type": "reasoning_text"}]``);
- content in a ``message`` item (``content: [{"type": "output_text"}]``);
- each call in a ``function_call`` item (``call_id``, ``name``, ``arguments``).

One item is open at a time: a piece of another kind closes it and opens the next, so the
items come in the order the model wrote them. Each step returns the events it makes, in
OpenAI's sequence (``event: <type>`` lines, each with a rising ``sequence_number``)::

    response.created, response.in_progress
    response.output_item.added, response.content_part.added,
        response.output_text.delta ..., response.output_text.done,
        response.content_part.done, response.output_item.done      (a message)
    response.output_item.added, response.function_call_arguments.delta ...,
        response.function_call_arguments.done, response.output_item.done   (a call)
    response.completed (or response.incomplete, with max_output_tokens; response.failed)

A non-streaming answer is the same machine fed the whole text once; its body is the final
:attr:`ResponseEvents.response`, so both shapes agree by construction.
"""

from __future__ import annotations

import os

from ..errors import ServerError
from .encode import dumps
from .events import feed_through
from .reasoning import ReasoningSplitter
from .tool_parsers import CallsOrDocument, ToolCallParser, new_parser
from .tools import ToolChoice

__all__ = ["ResponseEvents", "new_item_id", "new_response", "response_usage", "split_events"]


def new_item_id(prefix: str) -> str:
    """A new id for an output or input item (``msg_``, ``fc_``, ``rs_`` ... then 24 hex
    digits)."""
    return prefix + os.urandom(12).hex()


def new_response(response_id: str, created_at: int, model: str, echo: dict) -> dict:
    """A Response object, in progress, with the request's fields echoed."""
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "status": "in_progress", "background": False, "error": None,
        "incomplete_details": None, "model": model, "output": [],
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "store": False, "truncation": "disabled", "usage": None,
        **echo,
    }


def split_events(stream: bytes) -> list[bytes]:
    """The events of a stream this module wrote, one ``event:``/``data:`` block each (the
    i-th is the event of ``sequence_number`` i): what a stored response keeps to replay.
    A block ends at its first blank line: the data is one line of JSON, which writes a
    newline inside a string as ``\\n``."""
    return [block + b"\n\n" for block in stream.split(b"\n\n") if block]


def response_usage(input_tokens: int, output_tokens: int, cached: int | None) -> dict:
    """OpenAI's Responses usage (reasoning tokens are not counted apart: 0)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


class ResponseEvents:
    """The output items and the events of one response (see the module docstring)."""

    __slots__ = ("response", "_seq", "_splitter", "_parser", "_item", "_pieces", "_delta")

    def __init__(
        self, response: dict, *, reasoning_parser: str | None, tools: ToolChoice | None,
        thinking: bool = True,
    ) -> None:
        self.response = response
        self._seq = 0
        self._splitter = None
        if reasoning_parser is not None:
            self._splitter = ReasoningSplitter.for_parser(reasoning_parser, thinking)
        self._parser: CallsOrDocument | ToolCallParser | None = None
        if tools is not None and tools.parse is not None:
            self._parser = new_parser(tools.parse, parallel=tools.parallel)
        self._item: dict | None = None  # the open item (the last of response["output"])
        self._pieces: list[str] = []  # its text (or arguments) so far
        self._delta = (b"", b"")  # its delta events' bytes before and after the text

    @property
    def open_item(self) -> dict | None:
        """The item text goes to now (None before the first, and once closed). A feed that
        leaves the same item open made only delta events of it, or nothing."""
        return self._item

    def _event(self, kind: str, fields: dict) -> bytes:
        fields["sequence_number"] = self._seq
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + b"\n\n"

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        return (self._event("response.created", {"response": self.response})
                + self._event("response.in_progress", {"response": self.response}))

    def feed(self, text: str, last: bool = False) -> bytes:
        """The events of new text (``last``: the text ended; what parsers held back is
        decided)."""
        thought, said = "", text
        if self._splitter is not None:
            thought, said = feed_through(self._splitter, said, last)
        calls: list = []
        if self._parser is not None:
            said, calls = feed_through(self._parser, said, last)
        out = []
        if thought:
            out.append(self._write("reasoning", thought))
        if said:
            out.append(self._write("message", said))
        for delta in calls:
            if "id" in delta:
                out.append(self._open_call(delta["id"], delta["function"]["name"]))
            fragment = delta["function"].get("arguments")
            if fragment:
                out.append(self._write("function_call", fragment))
        return b"".join(out)

    def end(self, finish_reason: str | None, usage: dict) -> bytes:
        """Close the open item; ``response.completed`` (``stop``) or
        ``response.incomplete`` (``length``: ``max_output_tokens``)."""
        complete = finish_reason != "length"
        out = []
        if not self.response["output"]:  # an empty answer is an empty message
            out.append(self._open("message"))
        out.append(self._close("completed" if complete else "incomplete"))
        response = self.response
        response["usage"] = usage
        if complete:
            response["status"] = "completed"
            out.append(self._event("response.completed", {"response": response}))
        else:
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
            out.append(self._event("response.incomplete", {"response": response}))
        return b"".join(out)

    def fail(self, exc: ServerError) -> bytes:
        """``response.failed``: the engine failed it, or the server gave up on it (the
        open item is left ``incomplete``, with what was written)."""
        self._flush("incomplete")
        response = self.response
        response["status"] = "failed"
        response["error"] = {"code": exc.code or exc.type, "message": exc.message}
        return self._event("response.failed", {"response": response})

    def error(self, exc: ServerError) -> bytes:
        """An ``error`` event (OpenAI's stream error): what went wrong after the response
        ended (its storing, for one with ``store``)."""
        return self._event("error", {"code": exc.code or exc.type, "message": exc.message,
                                     "param": exc.param})

    # -- items ---------------------------------------------------------------------------

    def _write(self, kind: str, text: str) -> bytes:
        """``text`` into an open item of ``kind`` (opening one if needed): a delta event,
        from the open item's pre-encoded head and tail (the hot path: one per event)."""
        head = b""
        item = self._item
        if item is None or item["type"] != kind:
            head = self._close("completed") + self._open(kind)
        self._pieces.append(text)
        seq = self._seq
        self._seq += 1
        return (head + self._delta[0] + dumps(text) + self._delta[1] + str(seq).encode()
                + b"}\n\n")

    def _delta_parts(self, item: dict) -> tuple[bytes, bytes]:
        """The bytes of the open item's delta events before and after the text."""
        kind = _DELTA[item["type"]]
        fields: dict = {"type": kind, "item_id": item["id"],
                        "output_index": len(self.response["output"]) - 1}
        tail = b',"sequence_number":'
        if item["type"] != "function_call":
            fields["content_index"] = 0
            if item["type"] == "message":
                tail = b',"logprobs":[],"sequence_number":'
        head = b"event: " + kind.encode() + b"\ndata: " + dumps(fields)[:-1] + b',"delta":'
        return head, tail

    def _open(self, kind: str) -> bytes:
        if kind == "message":
            item = {"id": new_item_id("msg_"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
        else:
            item = {"id": new_item_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
        return self._added(item) + self._event("response.content_part.added", {
            "item_id": item["id"], "output_index": len(self.response["output"]) - 1,
            "content_index": 0, "part": _part(kind, "")})

    def _open_call(self, call_id: str, name: str) -> bytes:
        head = self._close("completed")
        item = {"id": new_item_id("fc_"), "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": call_id, "name": name}
        return head + self._added(item)

    def _added(self, item: dict) -> bytes:
        self.response["output"].append(item)
        self._item = item
        self._pieces = []
        self._delta = self._delta_parts(item)
        return self._event("response.output_item.added", {
            "output_index": len(self.response["output"]) - 1, "item": item})

    def _flush(self, status: str) -> str | None:
        """The open item's final text and status, set on it; None when none is open."""
        item = self._item
        if item is None:
            return None
        text = "".join(self._pieces)
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = text
        else:
            item["content"] = [_part(item["type"], text)]
        return text

    def _close(self, status: str) -> bytes:
        """The done events of the open item, if any."""
        item = self._item
        text = self._flush(status)
        if item is None or text is None:
            return b""
        self._item = None
        where = {"item_id": item["id"], "output_index": len(self.response["output"]) - 1}
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done",
                                   {**where, "name": item["name"], "arguments": text}))
        else:
            kind = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            done = {**where, "content_index": 0, "text": text}
            if item["type"] == "message":
                done["logprobs"] = []
            out.append(self._event(kind, done))
            out.append(self._event("response.content_part.done",
                                   {**where, "content_index": 0, "part": item["content"][0]}))
        out.append(self._event("response.output_item.done", {
            "output_index": where["output_index"], "item": item}))
        return b"".join(out)


#: The delta event of each item type.
_DELTA = {"message": "response.output_text.delta",
          "reasoning": "response.reasoning_text.delta",
          "function_call": "response.function_call_arguments.delta"}


def _part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}
