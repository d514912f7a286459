"""A response in progress as its stored events tell it: what ``GET /v1/responses/{id}``
answers while a background response runs (the openai SDK's ``responses.retrieve``).
Sans-IO.

Why from the events: a running response's record holds its Response object as it was at
its last change of status (``output: []`` while it runs), and its events as they are made.
Folding the events into that object gives the output so far, as OpenAI's API shows an
in-progress response: each item as added, its text or arguments up to the last delta,
its status ``in_progress`` until its ``output_item.done``. Nothing more is stored for it,
and it is the same on every frontend, since the events are in the store.

The fold reads OpenAI's event types only (:mod:`server.openai.responses_events` writes
them): item added or done, content part added or done, the text and arguments deltas.
A terminal event (``response.completed``, ``incomplete``, ``failed``) holds the whole
final object, which is then the answer. Other events change nothing.
"""

from __future__ import annotations

import json

__all__ = ["response_so_far"]

_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_TEXT_DELTAS = ("response.output_text.delta", "response.reasoning_text.delta")
_TEXT_DONE = ("response.output_text.done", "response.reasoning_text.done")


def _data(event: bytes) -> dict:
    """The JSON of one stored event (``event: ...\\ndata: {...}\\n\\n``)."""
    _, _, data = event.partition(b"\ndata: ")
    return json.loads(data)


def _place(items: list, index: int, value) -> None:
    if index == len(items):
        items.append(value)
    else:
        items[index] = value


def response_so_far(response: dict, events: list[bytes]) -> dict:
    """``response`` (a stored Response object) with the output its ``events`` (all of
    them, in order) made so far; the final object when they hold its terminal event."""
    output = list(response.get("output") or [])
    for event in events:
        data = _data(event)
        kind = data.get("type")
        if kind in _TERMINAL:
            return data["response"]
        index = data.get("output_index", -1)
        if kind in ("response.output_item.added", "response.output_item.done"):
            _place(output, index, data["item"])
        elif kind in ("response.content_part.added", "response.content_part.done"):
            _place(output[index]["content"], data["content_index"], data["part"])
        elif kind in _TEXT_DELTAS:
            output[index]["content"][data["content_index"]]["text"] += data["delta"]
        elif kind in _TEXT_DONE:
            output[index]["content"][data["content_index"]]["text"] = data["text"]
        elif kind == "response.function_call_arguments.delta":
            output[index]["arguments"] += data["delta"]
        elif kind == "response.function_call_arguments.done":
            output[index]["arguments"] = data["arguments"]
    return {**response, "output": output}
