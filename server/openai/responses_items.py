"""What a stored response keeps besides its Response object: its input items, the context
a later turn's ``previous_response_id`` continues from, and the pages of
``GET /v1/responses/{id}/input_items``. Sans-IO.

Theory of operation
-------------------
A stored response keeps the items of its whole context, each with an id, in OpenAI's item
shapes (``message`` with content parts, ``function_call``, ``function_call_output``,
``reasoning``): the context it continued (:func:`context_of` the earlier response: its
items, then its output items), then its own ``input``. So a turn of a chain is one read of
one record, not a walk back through the chain, and deleting an earlier turn (or its expiry)
does not break the later ones; the price is that a chain of n turns stores its first turns
n times (the store's size budget bounds it). ``instructions`` are never items: each request
gives its own (OpenAI's rule).

Example::

    items = input_items("hi")   # [{"id": "msg_...", "type": "message", "role": "user", ...}]
    body = record_body(response, items)
    context_of(body)            # items + response["output"]: the next turn's context
"""

from __future__ import annotations

import json

from ..errors import ClientError, printable
from .encode import dumps
from .responses_events import new_item_id

__all__ = ["context_of", "input_items", "items_page", "record_body", "response_of"]

#: The id prefix of each input item type this server takes (see responses.py's _messages).
_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
           "reasoning": "rs_"}
#: The fields kept of each item type (besides id, type and status).
_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
           "function_call_output": ("call_id", "output"),
           "reasoning": ("summary", "content", "encrypted_content")}

#: ``limit``'s range on ``input_items`` (OpenAI's), and its default.
MAX_LIMIT = 100
_DEFAULT_LIMIT = 20


def _part(role: str, text: str) -> dict:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def input_items(value) -> list[dict]:
    """A validated ``input`` (a string, or items that :func:`parse_responses
    <server.openai.responses.parse_responses>` took) as items in OpenAI's shapes, each with
    an id (the client's, else a new one)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    out = []
    for item in value:
        kind = item.get("type", "message")
        kept = {"id": item.get("id") or new_item_id(_PREFIX[kind]), "type": kind}
        for name in _FIELDS[kind]:
            if item.get(name) is not None:
                kept[name] = item[name]
        if kind == "message" and isinstance(kept["content"], str):
            kept["content"] = [_part(kept["role"], kept["content"])]
        kept["status"] = item.get("status") or "completed"
        out.append(kept)
    return out


def record_body(response: dict, items: list[dict]) -> bytes:
    """What a stored response's record holds: the Response object and its items."""
    return dumps({"response": response, "input": items})


def response_of(body: bytes) -> tuple[dict, list[dict]]:
    """A record's Response object and its input items (:func:`record_body`'s)."""
    data = json.loads(body)
    return data["response"], data["input"]


def context_of(body: bytes) -> list[dict]:
    """The items a turn continuing the record's response starts from: its input items, then
    its output items (``previous_response_id``)."""
    response, items = response_of(body)
    return items + response["output"]


def _bounded_limit(limit: str | None) -> int:
    if limit is None:
        return _DEFAULT_LIMIT
    try:
        value = int(limit)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise ClientError(f"'limit' must be an integer from 1 to {MAX_LIMIT}.", param="limit")
    return value


def items_page(items: list[dict], *, after: str | None, limit: str | None,
               order: str | None) -> dict:
    """A page of ``items`` in OpenAI's list shape (``data``, ``first_id``, ``last_id``,
    ``has_more``): ``order`` ``desc`` (OpenAI's default: the last item first) or ``asc``,
    those past the item ``after`` (a 400 naming it when it names no item), at most
    ``limit`` (1 to 100, default 20). The arguments are the query's strings."""
    if order not in (None, "asc", "desc"):
        raise ClientError("'order' must be 'asc' or 'desc'.", param="order")
    count = _bounded_limit(limit)
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ClientError("'after' names no input item of this response: "
                              f"{printable(repr(after))}.",
                              param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + count]
    return {
        "object": "list", "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + count < len(ordered),
    }
