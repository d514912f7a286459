"""The images a stored response keeps: the bytes its image URLs gave, so that a later turn
replays those bytes instead of fetching the URLs again.

Theory of operation
-------------------
A stored response keeps its items with their image URLs as the client sent them
(:mod:`server.openai.responses_items`). A URL is not its image: a presigned URL expires
in minutes, and another's content may change. So a later turn (``previous_response_id``)
that fetched the URLs again would fail on an image the earlier turn took, or see another
image than the one the earlier answer was made from.

So a stored response whose items hold ``http(s)`` image URLs has a second record: kind
:data:`IMAGES_KIND`, the response's id and owner. Its body is the fetched bytes as the
worker got them (size-checked, before decoding), each distinct image once. Its meta maps
each ``input_image`` part of the items, in order, to an image's SHA-256 (None for a
``data:`` URL, whose bytes are in the items already). A later turn reads it beside the
response, and each of the context's image parts with kept bytes skips its fetch
(:func:`with_kept`). A response made that way keeps those bytes again: each record is
whole without the earlier ones, as its items are. A chain of n turns so keeps its first
image n times, as it keeps that turn's text; one request's images are bounded (56 MiB).

The record counts against the store's bounds and the key's quota like any other. It is
written after the response, and a refusal of it removes the response (the request gets
the store's error). A server that died in between leaves a response without it: a later
turn then fetches, as before this record existed, and so does one continuing a response
stored by an older server. A background response's is written just before its first
record (the service writes that one and starts its job), and deleted when that fails; a
server that died in between leaves it until it expires. Deleting the response deletes it
too; retention expires it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from ..openai.images import ImageRef
from ..state import Record, StateStore

__all__ = ["IMAGES_KIND", "has_web_images", "images_record", "kept_of", "read_kept",
           "with_kept"]

#: The records' kind (their id: the response's).
IMAGES_KIND = "response_images"
#: The URLs whose bytes are kept (a ``data:`` URL is its bytes already).
_WEB = ("http://", "https://")


def _image_urls(items: list) -> Iterator[object]:
    """The ``image_url`` of each ``input_image`` part of ``items``, in order."""
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "input_image":
                    yield part.get("image_url")


def _wire_images(prompts: list) -> Iterator[dict]:
    """Each fetched image part (``{"type": "image", "data", "sha256"}``) of ``prompts``."""
    for prompt in prompts:
        messages = prompt.get("messages") if isinstance(prompt, dict) else None
        for message in messages or ():
            content = message.get("content")
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "image":
                        yield part


def _is_web(url: object) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(_WEB)


def has_web_images(items: list) -> bool:
    """Whether ``items`` hold an http(s) image URL (whose bytes their response kept)."""
    return any(_is_web(url) for url in _image_urls(items))


def images_record(items: list, prompts: list, owner: str, response_id: str,
                  created_at: int) -> Record | None:
    """The record of the bytes that ``items``' http(s) image URLs gave (``prompts``: the
    request's, fetched); None when there are none. Each of ``items``' image parts is one
    of ``prompts``' image parts, in the same order (server.openai.responses)."""
    urls = list(_image_urls(items))
    images = list(_wire_images(prompts))
    if len(urls) != len(images):  # (not expected: then keep nothing, a later turn fetches)
        return None
    parts: list[str | None] = []
    blobs: list[list] = []
    data: list[bytes] = []
    for url, image in zip(urls, images):
        if not _is_web(url):
            parts.append(None)
            continue
        digest = image["sha256"]
        if all(blob[0] != digest for blob in blobs):
            blobs.append([digest, len(image["data"])])
            data.append(image["data"])
        parts.append(digest)
    if not blobs:
        return None
    return Record(kind=IMAGES_KIND, id=response_id, owner=owner, created_at=created_at,
                  meta={"parts": parts, "blobs": blobs}, body=b"".join(data))


def kept_of(record: Record) -> list[tuple[bytes, str] | None]:
    """Per image part of the response's items, in order: its kept bytes and their SHA-256,
    or None (fetched again). [] for a record that does not add up (then all are fetched)."""
    images: dict[str, bytes] = {}
    offset = 0
    try:
        for digest, size in record.meta["blobs"]:
            images[digest] = record.body[offset:offset + size]
            offset += size
        parts = record.meta["parts"]
    except (KeyError, TypeError, ValueError):
        return []
    if offset != len(record.body) or not isinstance(parts, list) or any(
            digest is not None and digest not in images for digest in parts):
        return []
    return [None if digest is None else (images[digest], digest) for digest in parts]


async def read_kept(store: StateStore, owner: str,
                    response_id: str) -> list[tuple[bytes, str] | None]:
    """The kept images of the response ``response_id`` (:func:`kept_of`): [] when it has
    none (no http(s) image, or stored by a server that kept none)."""
    record = await store.get(IMAGES_KIND, owner, response_id)
    return [] if record is None else kept_of(record)


def with_kept(prompts: list, context: list, kept: list[tuple[bytes, str] | None]) -> None:
    """Give the image refs of ``context`` (the first of ``prompts``' refs, one per image
    part of ``context``, in order) their ``kept`` bytes, in place. Nothing when ``kept``
    does not match ``context``'s image parts one to one."""
    if not kept or len(kept) != sum(1 for _ in _image_urls(context)):
        return
    left = list(reversed(kept))
    for prompt in prompts:
        for message in prompt.get("messages") or ():
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                if not isinstance(part, ImageRef):
                    continue
                if not left:
                    return
                image = left.pop()
                if image is not None:
                    content[j] = dataclasses.replace(part, kept=image)
