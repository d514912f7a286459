"""A page of a key's stored objects, in OpenAI's list shape: what the Files API's and the
Batch API's lists (``GET /v1/files``, ``GET /v1/batches``) answer.

Both page the same way: ``limit`` objects past the one named ``after``, newest first
(or oldest), and ``has_more`` when one more follows. One more record than the page is
read to know that, never a count of them all. A filter (the files' ``purpose``) may drop
records of a read, so reads continue until the page is full or the store has no more.
"""

from __future__ import annotations

from typing import Callable

from ..openai.encode import dumps
from ..state import Record, StateStore

__all__ = ["list_body", "read_page"]


async def read_page(store: StateStore, kind: str, owner: str, *, after: str | None,
                    limit: int, newest_first: bool = True,
                    keep: Callable[[Record], bool] | None = None) -> tuple[list[Record], bool]:
    """Up to ``limit`` of ``owner``'s records of ``kind`` past ``after`` that ``keep``
    keeps (all without it), in order, and whether more follow them."""
    found: list[Record] = []
    while len(found) <= limit:
        page = await store.list(kind, owner, after=after, limit=limit + 1,
                                newest_first=newest_first)
        found.extend(r for r in page if keep is None or keep(r))
        if len(page) <= limit:
            break
        after = page[-1].id
    return found[:limit], len(found) > limit


def list_body(data: list[dict], has_more: bool) -> bytes:
    """OpenAI's list object of one page's objects (``data``, ``has_more``, ``first_id``,
    ``last_id``), encoded."""
    return dumps({"object": "list", "data": data, "has_more": has_more,
                  "first_id": data[0]["id"] if data else None,
                  "last_id": data[-1]["id"] if data else None})
