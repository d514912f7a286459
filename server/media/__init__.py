"""Images a request names by URL, fetched under the operator's policy (docs/media.md).

The one call a request's parsing makes::

    fetcher = MediaFetcher(policy_from_config(config))   # once, at start
    image = await fetcher.fetch_image(url, param="messages[0].content[1].image_url.url")

``image`` is a :class:`FetchedImage` (bytes, media type, SHA-256); a refusal or failure is
a :class:`MediaError` (a 400 naming ``param``), or :class:`MediaProxyFailed` (a 502: this
server's proxy failed). Nothing here decodes an image.
"""

from __future__ import annotations

from .errors import (
    MediaError,
    MediaFetchFailed,
    MediaProxyFailed,
    MediaRefused,
    MediaTimeout,
    MediaTooLarge,
)
from .fetch import MediaFetcher
from .image import FetchedImage
from .policy import MediaPolicy, policy_from_config

__all__ = [
    "FetchedImage",
    "MediaError",
    "MediaFetchFailed",
    "MediaFetcher",
    "MediaPolicy",
    "MediaProxyFailed",
    "MediaRefused",
    "MediaTimeout",
    "MediaTooLarge",
    "policy_from_config",
]
