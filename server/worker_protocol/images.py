"""The image parts of a chat prompt on the wire (docs/protocol.md, "Images").

The frontend puts each fetched image in its message's content as ``{"type": "image",
"data": bytes, "sha256": hex}``. Both sides ask whether a prompt holds one: the frontend
to route it to a worker that takes images (server.manager.engine), the vllm worker to
prepare it with vLLM's renderer (server.engines.vllm.images).
"""

from __future__ import annotations

__all__ = ["has_image_parts"]


def has_image_parts(prompt: object) -> bool:
    """Whether a chat prompt (``{"messages": [...]}``) holds an image part."""
    if type(prompt) is not dict:
        return False
    messages = prompt.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if type(content) is list and any(
                isinstance(p, dict) and p.get("type") == "image" for p in content):
            return True
    return False
