"""The Files API's shapes (``/v1/files``): the file object, the upload's form fields, the
list's query. Sans-IO: what a client sent in, a value or a ClientError out.

Purposes: a client uploads ``batch`` files only (the Batch API's input); the server writes
``batch_output`` files (a batch's output and error files). OpenAI's other purposes
(``assistants``, ``user_data``, ``fine-tune``, ``vision``, ``evals``) are for features
this server does not have, and an upload naming one is refused by name rather than stored
for nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..errors import ClientError, printable

__all__ = ["FileQuery", "MAX_LIST", "UPLOAD_PURPOSES", "file_object", "new_file_id",
           "parse_list_query", "upload_purpose"]

#: What an upload's ``purpose`` may be.
UPLOAD_PURPOSES = ("batch",)
#: OpenAI's purposes for features this server lacks (refused by name).
_OTHER_PURPOSES = ("assistants", "user_data", "fine-tune", "vision", "evals", "batch_output")
#: The most files one list page holds (OpenAI's limit, and its default).
MAX_LIST = 10_000


def new_file_id() -> str:
    """A file id, in OpenAI's ``file-...`` shape."""
    return "file-" + os.urandom(12).hex()


def upload_purpose(fields: dict[str, str]) -> str:
    """The ``purpose`` of an upload's text fields (they must hold nothing else)."""
    for name in fields:
        if name.startswith("expires_after"):
            raise ClientError("'expires_after' is not supported: a file is kept for the "
                              "server's --state-retention, or until it is deleted.",
                              param="expires_after", code="unsupported_parameter")
        if name != "purpose":
            raise ClientError(f"Unknown form field '{printable(name)}' (an upload has 'file' "
                              "and 'purpose').", param=name, code="unsupported_parameter")
    purpose = fields.get("purpose")
    if purpose is None:
        raise ClientError("'purpose' is missing (the Files API here takes 'batch').",
                          param="purpose", code="missing_required_parameter")
    if purpose in UPLOAD_PURPOSES:
        return purpose
    if purpose in _OTHER_PURPOSES:
        raise ClientError(f"'purpose' '{purpose}' is not supported by this server: files are "
                          "for the Batch API ('batch').", param="purpose",
                          code="unsupported_parameter")
    raise ClientError(f"'purpose' '{printable(purpose)}' is not a purpose (this server takes "
                      "'batch').", param="purpose")


def file_object(file_id: str, created_at: int, meta: dict, retention_s: int) -> dict:
    """The file object of a stored file's record (``meta``: its ``bytes``, ``filename``,
    ``purpose``); ``expires_at`` is when the store's retention ends it (None: never)."""
    return {
        "id": file_id, "object": "file", "bytes": meta["bytes"], "created_at": created_at,
        "expires_at": created_at + retention_s if retention_s else None,
        "filename": meta["filename"], "purpose": meta["purpose"],
        "status": "processed", "status_details": None,
    }


@dataclass(frozen=True, slots=True)
class FileQuery:
    """``GET /v1/files``'s query: ``purpose`` (None: every purpose), ``limit``, ``after`` (a
    file id: the page starts past it), and the order."""

    purpose: str | None = None
    limit: int = MAX_LIST
    after: str | None = None
    newest_first: bool = True


def parse_list_query(args: Mapping[str, list[str]]) -> FileQuery:
    """The query of ``GET /v1/files`` (each name's values, as ``urllib.parse.parse_qs``
    gives them); a 400 naming any other parameter, or a repeated one."""
    values: dict[str, str] = {}
    for name, given in args.items():
        if name not in ("purpose", "limit", "after", "order"):
            raise ClientError(f"Unknown query parameter '{printable(name)}' (the list takes "
                              "'purpose', 'limit', 'after' and 'order').", param=name,
                              code="unsupported_parameter")
        if len(given) != 1:
            raise ClientError(f"'{name}' is given more than once.", param=name)
        values[name] = given[0]
    limit = values.get("limit", str(MAX_LIST))
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 6) \
            or not 1 <= int(limit) <= MAX_LIST:
        raise ClientError(f"'limit' must be an integer from 1 to {MAX_LIST}.", param="limit")
    order = values.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ClientError("'order' must be 'asc' or 'desc'.", param="order")
    return FileQuery(purpose=values.get("purpose") or None, limit=int(limit),
                     after=values.get("after") or None, newest_first=order == "desc")
