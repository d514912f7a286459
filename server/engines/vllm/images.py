"""A chat prompt's images on the vllm engine: decoded in the preparation thread, bounded in
pixels, and handed to vLLM's own multimodal processor.

Theory of operation
-------------------
The frontend sends an image as ``{"type": "image", "data": bytes, "sha256": hex}`` in a
user message's content (docs/protocol.md, "Images"). :func:`split_images` turns each into
``{"type": "image"}``, the part Hugging Face chat templates render as the model's image
placeholder, and keeps the bytes in order. :func:`decode_images` opens each with PIL: the
header first, its pixels counted against ``max_pixels`` before anything is decompressed
(a decompression bomb is refused, naming its part), then loaded and converted to RGB.

vLLM then gets the rendered ids, one placeholder per image, and the images as
``multi_modal_data``; its renderer (``render_cmpl``, called in the same thread)
expands each placeholder as the model's processor says, so the prompt's length, and
``usage.prompt_tokens``, count the image tokens as vLLM counts them.

Caching (issue 46 item 3). Each image goes to vLLM with its SHA-256 as its
``multi_modal_uuids`` entry, checked against its bytes here (:func:`image_digests`). vLLM
then keys the image by it, without hashing its pixels: its processor cache (the processed
form, bounded by ``mm_processor_cache_gb``), the engine's encoder cache and the KV blocks
of the image's tokens. An image the processor cache already holds is header-checked
(the same bounds and refusals) but not decompressed: ``decode_images(skip=...)`` gives
None in its place, which vLLM fills from its cache. vLLM's cache is not thread-safe, so
the engine renders one prompt with images at a time (decoding stays in parallel).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Collection

from ...worker_protocol.images import has_image_parts as has_images
from ...workers.base import Rejected

__all__ = ["MAX_IMAGE_PIXELS", "MAX_PROMPT_PIXELS", "decode_images", "has_images",
           "image_digests", "split_images"]

#: The most pixels one image may have (a 8192 x 8192 image is 67M): past it, refused.
MAX_IMAGE_PIXELS = 8192 * 8192
#: The most pixels a prompt's images may have together (about 200 MB once decoded to RGB).
MAX_PROMPT_PIXELS = 8192 * 8192


def split_images(prompt: dict) -> tuple[dict, list[tuple[bytes, str]]]:
    """The prompt with each image part as ``{"type": "image"}``, and each image's bytes
    with its part's name (``messages[i].content[j]``), in order."""
    images: list[tuple[bytes, str]] = []
    messages = []
    for i, m in enumerate(prompt["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            messages.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image":
                data = part.get("data")
                if not isinstance(data, bytes):
                    raise Rejected("an image part needs its bytes",
                                   param=f"messages[{i}].content[{j}]")
                images.append((data, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({**m, "content": parts})
    return {**prompt, "messages": messages}, images


def image_digests(prompt: dict) -> list[str]:
    """Each image part's SHA-256 (hex), in order, checked against its bytes: vLLM keys the
    image by it in its caches, so a wrong one would give another image's processed form
    (to every frontend of a shared worker). A Rejected naming the part that does not
    match."""
    digests = []
    for i, m in enumerate(prompt["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image":
                digest = part.get("sha256")
                data = part.get("data")
                if (not isinstance(digest, str) or not isinstance(data, bytes)
                        or hashlib.sha256(data).hexdigest() != digest):
                    raise Rejected("an image's bytes do not match its sha256",
                                   param=f"messages[{i}].content[{j}]")
                digests.append(digest)
    return digests


def decode_images(images: list[tuple[bytes, str]], max_pixels: int = MAX_IMAGE_PIXELS,
                  max_total: int = MAX_PROMPT_PIXELS, skip: Collection[int] = ()):
    """PIL RGB images of ``images``; a Rejected (400) naming the part of one that cannot be
    decoded, has more than ``max_pixels`` pixels, or takes the prompt's images past
    ``max_total`` pixels together. Every header is read and checked before any image's
    pixels are decompressed: a bound per image alone let one 4 MiB body of tiny 1-bit
    8192 x 8192 PNGs (8 KB each, 201 MB each decoded) ask for tens of gigabytes.
    The images at the indexes in ``skip`` (vLLM holds them processed) are checked so, but
    not decompressed: None in their place."""
    from PIL import Image

    opened = []
    total = 0
    for data, param in images:
        try:
            image = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            # (PIL's own bounds, past ours, from the header: a warning when it is an error)
            raise Rejected(f"the image has more pixels than the {max_pixels} one image may "
                           "have", param=param) from None
        except Exception as exc:  # (PIL raises many kinds for a bad file)
            raise Rejected(f"the image cannot be decoded ({type(exc).__name__})",
                           param=param) from None
        width, height = image.size
        if width * height > max_pixels:
            raise Rejected(f"the image is {width} x {height} pixels, more than the "
                           f"{max_pixels} one image may have", param=param)
        total += width * height
        if total > max_total:
            raise Rejected(f"the prompt's images have more than {max_total} pixels together "
                           f"with this one ({width} x {height})", param=param)
        opened.append((image, param))
    out: list = []
    for k, (image, param) in enumerate(opened):
        if k in skip:
            out.append(None)
            continue
        try:
            image.load()
            out.append(image.convert("RGB"))
        except Exception as exc:
            raise Rejected(f"the image cannot be decoded ({type(exc).__name__})",
                           param=param) from None
    return out
