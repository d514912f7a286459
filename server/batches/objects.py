"""The Batch API's shapes (``/v1/batches``): the create body, the list's query, the Batch
object of a stored record, and the output and error files' lines. Sans-IO: what a client
sent in, a value or a ClientError out.

A batch is one record of kind ``"batch"`` (:mod:`server.state`). Its meta holds what the
Batch object shows (``status``, ``endpoint``, ``input_file_id``, ``metadata``, the
timestamps, ``request_counts``, the output and error files' ids) and the runner's lease
(``holder``, ``lease_until_ms``). Each finished line is an event of the record: its output
line, exactly as the output or error file will hold it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..errors import ClientError, printable
from ..openai.batch_input import BATCH_URLS
from ..openai.encode import dumps

__all__ = ["ACTIVE", "BatchCreate", "BatchQuery", "COMPLETION_WINDOW_S", "KIND", "ENDED",
           "batch_object", "error_line", "is_error_line", "new_batch_id", "output_line",
           "parse_create", "parse_list_query"]

KIND = "batch"
#: The only completion window OpenAI offers, and its length.
COMPLETION_WINDOW_S = 24 * 3600
#: Statuses in which a runner has work to do (claim, resume, finish or cancel).
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
#: Statuses after which nothing changes.
ENDED = ("completed", "failed", "expired", "cancelled")

_CREATE_KEYS = ("input_file_id", "endpoint", "completion_window", "metadata")
_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")
#: OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512
_MAX_LIST = 100


def new_batch_id() -> str:
    """A batch id, in OpenAI's ``batch_...`` shape."""
    return "batch_" + os.urandom(12).hex()


@dataclass(frozen=True, slots=True)
class BatchCreate:
    """A checked ``POST /v1/batches`` body."""

    input_file_id: str
    endpoint: str
    metadata: dict[str, str] | None


def _metadata(value) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ClientError("'metadata' must be an object of strings.", param="metadata")
    if len(value) > _METADATA_PAIRS:
        raise ClientError(f"'metadata' has {len(value)} pairs; at most {_METADATA_PAIRS}.",
                          param="metadata")
    for key, item in value.items():
        if len(key) > _METADATA_KEY:
            raise ClientError(f"A 'metadata' key is longer than {_METADATA_KEY} characters.",
                              param="metadata")
        if not isinstance(item, str) or len(item) > _METADATA_VALUE:
            raise ClientError(f"'metadata' values must be strings of at most "
                              f"{_METADATA_VALUE} characters.", param="metadata")
    return dict(value)


def parse_create(body) -> BatchCreate:
    """The create request's body, or the 400 naming its first bad field. ``completion_window``
    must be ``24h`` (OpenAI's only one, honoured: a batch not done by then expires);
    ``output_expires_after`` is refused (output files are kept for ``--state-retention``)."""
    if not isinstance(body, dict):
        raise ClientError("The body must be a JSON object.")
    for key in body:
        if key == "output_expires_after":
            raise ClientError("'output_expires_after' is not supported: output files are kept "
                              "for the server's --state-retention.", param=key,
                              code="unsupported_parameter")
        if key not in _CREATE_KEYS:
            raise ClientError(f"Unknown parameter '{printable(key)}'.", param=key,
                              code="unsupported_parameter")
    for key in _CREATE_KEYS[:3]:
        if key not in body:
            raise ClientError(f"'{key}' is missing.", param=key,
                              code="missing_required_parameter")
    file_id, endpoint, window = body["input_file_id"], body["endpoint"], body["completion_window"]
    if not isinstance(file_id, str) or not file_id:
        raise ClientError("'input_file_id' must be a file id.", param="input_file_id")
    if endpoint not in BATCH_URLS:
        raise ClientError(f"'endpoint' must be one of {', '.join(BATCH_URLS)}.",
                          param="endpoint")
    if window != "24h":
        raise ClientError("'completion_window' must be '24h' (the only window offered).",
                          param="completion_window")
    return BatchCreate(file_id, endpoint, _metadata(body.get("metadata")))


@dataclass(frozen=True, slots=True)
class BatchQuery:
    """``GET /v1/batches``: ``after`` a batch id, ``limit`` 1 to 100 (default 20)."""

    after: str | None = None
    limit: int = 20


def parse_list_query(query: Mapping[str, list[str]]) -> BatchQuery:
    """The list's query string (``parse_qs``'s dict), or the 400 naming a bad parameter."""
    for key, values in query.items():
        if key not in ("after", "limit"):
            raise ClientError(f"Unknown parameter '{printable(key)}'.", param=key,
                              code="unsupported_parameter")
        if len(values) != 1:
            raise ClientError(f"'{key}' is given more than once.", param=key)
    after = query.get("after", [None])[0] or None
    raw = query.get("limit", ["20"])[0]
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw[:4]) <= _MAX_LIST \
            or len(raw) > 3:
        raise ClientError(f"'limit' must be an integer from 1 to {_MAX_LIST}.", param="limit")
    return BatchQuery(after, int(raw))


def batch_object(batch_id: str, created_at: int, meta: dict) -> dict:
    """The Batch object of a stored batch's record."""
    counts = meta.get("request_counts") or {"total": 0, "completed": 0, "failed": 0}
    body = {
        "id": batch_id, "object": "batch", "endpoint": meta["endpoint"],
        "errors": meta.get("errors"), "input_file_id": meta["input_file_id"],
        "completion_window": "24h", "status": meta["status"],
        "output_file_id": meta.get("output_file_id"),
        "error_file_id": meta.get("error_file_id"), "created_at": created_at,
        "expires_at": created_at + COMPLETION_WINDOW_S,
    }
    body.update((name, meta.get(name)) for name in _TIMESTAMPS)
    body["request_counts"] = dict(counts)
    body["metadata"] = meta.get("metadata")
    return body


def output_line(custom_id: str, status: int, request_id: str, body) -> bytes:
    """One line of the output (or error) file: a request that was answered."""
    return dumps({"id": "batch_req_" + os.urandom(12).hex(), "custom_id": custom_id,
                  "response": {"status_code": status, "request_id": request_id, "body": body},
                  "error": None})


def error_line(custom_id: str, code: str, message: str) -> bytes:
    """One line of the error file: a request that was never answered (``batch_expired``,
    ``batch_cancelled``)."""
    return dumps({"id": "batch_req_" + os.urandom(12).hex(), "custom_id": custom_id,
                  "response": None, "error": {"code": code, "message": message}})


def is_error_line(line: dict) -> bool:
    """Whether a parsed output line belongs in the error file: no answer, or not a 2xx."""
    response = line.get("response")
    return line.get("error") is not None or response is None \
        or not 200 <= response.get("status_code", 500) < 300
