"""The image parts of a chat prompt on the wire (docs/protocol.md, "Images").

The frontend puts each fetched image in its message's content as ``{"type": "image",
"data": bytes, "sha256": hex}``. Both sides ask whether a prompt holds one: the frontend
to route it to a worker that takes that many images (server.manager.engine), the vllm
worker to prepare it with vLLM's renderer (server.engines.vllm.images).
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["has_image_parts", "image_count", "image_parts", "takes_images"]


def image_parts(messages: object) -> Iterator[dict]:
    """The image parts of a chat prompt's ``messages``, in order (nothing if they are not a
    list of messages)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if type(content) is list:
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    yield part


def image_count(prompt: object) -> int:
    """How many image parts a chat prompt (``{"messages": [...]}``) holds."""
    if type(prompt) is not dict:
        return 0
    return sum(1 for _ in image_parts(prompt.get("messages")))


def has_image_parts(prompt: object) -> bool:
    """Whether a chat prompt (``{"messages": [...]}``) holds an image part."""
    return image_count(prompt) > 0


def takes_images(info: dict, count: int) -> bool:
    """Whether a worker whose HELLO info is ``info`` takes a prompt of ``count`` images
    (its ``images.per_prompt``; any worker takes a prompt of none)."""
    if count == 0:
        return True
    images = info.get("images")
    return isinstance(images, dict) and images.get("per_prompt", 0) >= count
