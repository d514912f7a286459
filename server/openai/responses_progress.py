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

A long response has thousands of events, and clients poll it every second or so: each
frontend keeps the output it folded last for each running response
(:class:`ProgressCache`), so that a poll reads and folds only the events stored since.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["ProgressCache", "ProgressStatistics", "ended", "response_so_far"]

_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_TEXT_DELTAS = ("response.output_text.delta", "response.reasoning_text.delta")
_TEXT_DONE = ("response.output_text.done", "response.reasoning_text.done")


def _data(event: bytes) -> dict:
    """The JSON of one stored event (``event: ...\\ndata: {...}\\n\\n``)."""
    _, _, data = event.partition(b"\ndata: ")
    return json.loads(data)


def _copied(item: dict) -> dict:
    """An output item with what the fold writes into (the item, its content list and
    parts) copied; the text itself is shared (strings do not change)."""
    item = dict(item)
    content = item.get("content")
    if isinstance(content, list):
        item["content"] = [dict(part) for part in content]
    return item


def _place(items: list, index: int, value) -> None:
    if index == len(items):
        items.append(value)
    else:
        items[index] = value


def response_so_far(response: dict, events: list[bytes]) -> dict:
    """``response`` (a stored Response object) with the output its ``events`` made so far
    (all of them, in order; or those after the ones its output already holds); the final
    object when they hold its terminal event. ``response`` is not changed: the items the
    fold writes into are copies."""
    output = [_copied(item) for item in response.get("output") or ()]
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


@dataclass(frozen=True, slots=True)
class ProgressStatistics:
    """``entries``: responses whose fold is kept; ``ended``: ended ones remembered, whose
    folds are no longer kept (below)."""

    entries: int
    ended: int


class ProgressCache:
    """Each running response's output as last folded, by (owner, id), with the number of
    events it holds, so that a poll folds only the events since::

        ticket = cache.ticket()                             # before the record is read
        ...the record, if it runs...
        start, count = cache.start(owner, id, response)   # response: its record's object
        events = ...the record's events numbered count and after...
        response = response_so_far(start, events)           # (in a thread when big)
        cache.keep(owner, id, count + len(events), response, ended(events), ticket)

    Bounded (the least recently polled go first). Plain and sans-IO; several polls of one
    response may run at once (each keeps what it folded unless a later one was kept).

    A response that ended, was cancelled or deleted is :meth:`end`-ed: its fold is dropped,
    and a poll that read its record before then and keeps after is ignored. The cache
    remembers the last ``4 * size`` ends for that. Past them, a ticket older than the end
    last forgotten adds no new entry: that poll may have read an ended record."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._folded: OrderedDict[tuple[str, str], tuple[int, list]] = OrderedDict()
        #: The ends remembered, each with its number (the clock's value then).
        self._ended: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._ends = 0
        #: The number of the last end no longer remembered.
        self._forgotten = 0

    def statistics(self) -> ProgressStatistics:
        return ProgressStatistics(entries=len(self._folded), ended=len(self._ended))

    def ticket(self) -> int:
        """The ends so far: take it before reading the record that a poll folds."""
        return self._ends

    def start(self, owner: str, id: str, response: dict) -> tuple[dict, int]:
        """``response`` with the kept output, and how many events that output holds."""
        count, output = self._folded.get((owner, id), (0, None))
        return (response if output is None else {**response, "output": output}), count

    def keep(self, owner: str, id: str, count: int, folded: dict, ended: bool,
             ticket: int) -> None:
        """Keep ``folded`` (the response with its first ``count`` events folded in) for the
        next poll, which took ``ticket`` before reading the record. An ``ended`` one is
        :meth:`end`-ed (no poll folds it again)."""
        key = (owner, id)
        if ended:
            self.end(owner, id)
            return
        latest = self._folded.get(key)
        if key in self._ended or (latest is None and ticket < self._forgotten):
            return  # (ended since the poll read its record, or may have)
        if latest is None or count > latest[0]:
            self._folded[key] = (count, folded["output"])
            self._folded.move_to_end(key)
            while len(self._folded) > self.size:
                self._folded.popitem(last=False)

    def end(self, owner: str, id: str) -> None:
        """The response ended, or was cancelled or deleted: drop its fold, and refuse the
        keeps of polls that read its record before. Call it after the record changed."""
        key = (owner, id)
        self._folded.pop(key, None)
        self._ends += 1
        self._ended[key] = self._ends
        self._ended.move_to_end(key)
        while len(self._ended) > 4 * self.size:
            self._forgotten = self._ended.popitem(last=False)[1]


def ended(events: list[bytes]) -> bool:
    """Whether ``events`` (a response's, in order) end with its terminal event."""
    return bool(events) and _data(events[-1]).get("type") in _TERMINAL
