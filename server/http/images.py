"""The fetch step of a request with image parts: each image ref becomes the image's bytes.

A generation route parses without IO (server.openai.images leaves an
:class:`~server.openai.images.ImageRef` in each message's content). Before the engine is
asked anything, :func:`fetch_images` fetches every ref with the app's
:class:`~server.media.MediaFetcher`, four at a time, in a nursery of the request's task: a
client that goes away cancels the fetches, and a refused or failed fetch cancels the
others and is the request's 400 naming its URL's field. A request's images so cost the
slowest fetch, not the sum (each fetch still takes one of ``--max-media-fetches``). Each
ref is replaced, in place, by the wire part ``{"type": "image", "data": bytes, "sha256":
hex}`` (docs/protocol.md, "Images"). A ref of an earlier stored turn whose bytes that
response kept (``ref.kept``) is not fetched: its kept bytes take its place.

The images of one request travel in one SUBMIT frame, so their bytes together are
bounded below the frame's limit (a 400 naming the part that passes it). The bound is
checked as each fetch ends, and the rest are then cancelled: a request of many URLs (vLLM
allows 999 images a prompt) holds that much and its fetches under way, not all of them.
"""

from __future__ import annotations

import trio

from ..errors import ClientError, ServerError
from ..openai.images import ImageRef, wire_image
from ..worker_protocol.wire import MAX_FRAME

__all__ = ["fetch_images", "has_images"]

#: The most fetches of one request at a time: the rest wait, so that one request with
#: many slow URLs cannot hold every one of ``--max-media-fetches`` (the server's) while
#: other requests' fetches wait out their deadline.
FETCHES_PER_REQUEST = 4

#: The most image bytes one request may carry to its worker: the frame's limit less room
#: for the rest of the request (its text, params and tools).
MAX_IMAGE_BYTES = MAX_FRAME - 8 * 1024 * 1024


def _refs(prompts: list):
    """(content list, index, ref) of every image ref of ``prompts``, in order."""
    for prompt in prompts:
        if not isinstance(prompt, dict):
            continue
        for message in prompt.get("messages") or ():
            content = message.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if isinstance(part, ImageRef):
                        yield content, j, part


def has_images(prompts: list) -> bool:
    """Whether any of ``prompts`` holds an image ref (an image not yet fetched)."""
    return next(_refs(prompts), None) is not None


def _too_large(ref: ImageRef) -> ClientError:
    """The 400 for the image ``ref`` that takes the request's past :data:`MAX_IMAGE_BYTES`."""
    return ClientError(f"The request's images are more than {MAX_IMAGE_BYTES} bytes "
                       "together.", param=ref.param, code="media_too_large")


async def fetch_images(fetcher, prompts: list) -> int:
    """Fetch every image ref of ``prompts`` and put its wire part in its place; the
    number of images. Raises a :class:`~server.media.MediaError` (400) naming the URL's
    field, a ClientError when their bytes together pass :data:`MAX_IMAGE_BYTES`, or
    :class:`~server.media.MediaProxyFailed` (502) when this server's proxy failed."""
    refs = list(_refs(prompts))
    images: list = [None] * len(refs)
    limiter = trio.CapacityLimiter(FETCHES_PER_REQUEST)
    refused: dict[int, ServerError] = {}
    fetched = 0

    async def fetch(k: int, ref: ImageRef, scope: trio.CancelScope) -> None:
        nonlocal fetched
        try:
            async with limiter:
                image = await _image(fetcher, ref)
        except ServerError as exc:  # the request's 400 (or the proxy's 502): the other
            # fetches are for nothing
            refused[k] = exc
            scope.cancel()
            return
        images[k] = image
        fetched += len(image[0])
        if fetched > MAX_IMAGE_BYTES:  # (refused once known: not held until all are in)
            refused[k] = _too_large(ref)
            scope.cancel()

    if len(refs) == 1:
        images[0] = await _image(fetcher, refs[0][2])
    else:
        async with trio.open_nursery() as nursery:
            for k, (_, _, ref) in enumerate(refs):
                nursery.start_soon(fetch, k, ref, nursery.cancel_scope)
        if refused:
            raise refused[min(refused)]
    total = 0
    for (content, j, ref), (data, digest) in zip(refs, images):
        total += len(data)
        if total > MAX_IMAGE_BYTES:
            raise _too_large(ref)
        content[j] = wire_image(data, digest)
    return len(refs)


async def _image(fetcher, ref: ImageRef) -> tuple[bytes, str]:
    """The bytes of ``ref`` and their SHA-256: those a stored response kept for it
    (server.http.responses_images), else fetched."""
    if ref.kept is not None:
        return ref.kept
    image = await fetcher.fetch_image(ref.url, param=ref.url_param)
    return image.data, image.sha256
