"""A migrated request's ``resume`` param, as every engine reads it. Sans-IO.

When a worker dies, the frontend moves each of its unfinished requests to another worker
(:mod:`server.manager.migration`) with ``"resume": {"token_ids": [...], "text_chars": k}``:
the ids of the tokens already generated and how many characters of their text the client
already has. Each engine that says ``"resume": true`` in its HELLO prefills the prompt and
those tokens, brings its per-request state (generator, grammar, stop matcher, detokenizer)
to where the first run stopped, and sends only text past the client's ``k`` characters
(docs/routing.md, "Migration").
"""

from __future__ import annotations

from .base import Rejected

__all__ = ["resume_of"]


def resume_of(resume: object) -> tuple[list[int], int] | None:
    """``(token_ids, text_chars)`` of a request's ``resume`` param (None: a new request)."""
    if resume is None:
        return None
    ids = resume.get("token_ids") if isinstance(resume, dict) else None
    chars = resume.get("text_chars") if isinstance(resume, dict) else None
    if (not isinstance(ids, list) or not all(type(t) is int for t in ids)
            or type(chars) is not int or chars < 0):
        raise Rejected("resume must be {\"token_ids\": [int, ...], \"text_chars\": int}",
                       "engine_error")
    return ids, chars
