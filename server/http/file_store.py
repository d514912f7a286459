"""Files in the state store (``app.state_store``, :mod:`server.state`): how the Files API
(:mod:`server.http.files`) and the Batch API keep, find and remove them.

A file is two records of the same id and owner:

* kind ``"file"``: the file object's fields in its meta (``filename``, ``purpose``,
  ``bytes``), and an empty body;
* kind ``"file_content"``: the content as its body.

Why two: the store's ``get`` and ``list`` read a record's body with it, and a file's is up
to ``--max-file-bytes`` (200 MB by default). A list of 10,000 files, or a retrieve, reads the
small records only. The content is written first and removed last, so that a file that can
be seen has its content; a crash between the two leaves content that nothing names, until
the store's retention removes it.
"""

from __future__ import annotations

import time

import trio

from ..openai.files import FileQuery, new_file_id
from ..state import Record, StateStore
from .listing import read_page

__all__ = ["CONTENT_KIND", "KIND", "delete_file", "file_content", "find_file", "list_files",
           "store_file"]

KIND = "file"
CONTENT_KIND = "file_content"


async def store_file(store: StateStore, owner: str, filename: str, purpose: str,
                     content: bytes) -> Record:
    """Store a new file of ``owner``'s; its record (kind ``"file"``). Raises the store's
    ``StoreFull``."""
    file_id = new_file_id()
    now = int(time.time())
    await store.put(Record(CONTENT_KIND, file_id, owner, now, {}, content))
    record = Record(KIND, file_id, owner, now,
                    {"filename": filename, "purpose": purpose, "bytes": len(content)}, b"")
    try:
        await store.put(record)
    except BaseException:
        with trio.CancelScope(shield=True):
            await store.delete(CONTENT_KIND, owner, file_id)
        raise
    return record


async def find_file(store: StateStore, owner: str, file_id: str) -> Record | None:
    """The file's record (kind ``"file"``), or None: missing, expired or another owner's."""
    return await store.get(KIND, owner, file_id)


async def file_content(store: StateStore, owner: str, file_id: str) -> bytes | None:
    """The file's content, or None as for :func:`find_file`."""
    if await store.get(KIND, owner, file_id) is None:
        return None
    record = await store.get(CONTENT_KIND, owner, file_id)
    return None if record is None else record.body


async def delete_file(store: StateStore, owner: str, file_id: str) -> bool:
    """Delete the file; False when there was none to delete."""
    found = await store.delete(KIND, owner, file_id)
    with trio.CancelScope(shield=True):  # (not left half-deleted by a client going away)
        await store.delete(CONTENT_KIND, owner, file_id)
    return found


async def list_files(store: StateStore, owner: str, query: FileQuery) -> tuple[list[Record], bool]:
    """A page of ``owner``'s files as ``query`` asks, and whether more follow it."""
    purpose = query.purpose
    return await read_page(store, KIND, owner, after=query.after, limit=query.limit,
                           newest_first=query.newest_first,
                           keep=None if purpose is None else
                           lambda record: record.meta["purpose"] == purpose)
