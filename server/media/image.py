"""What counts as an image: the accepted types, magic-byte sniffing, and the fetched value.

An image's bytes reach the worker's decoder (PIL) later, so only formats worth decoding
pass, and only when the type the source declared and the bytes' own magic agree: a
server that says ``image/png`` and sends HTML, or a PNG sent as ``text/plain``, is
refused. SVG is refused outright: it is a document (scripts, external references), not
pixels. Nothing is decoded here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..errors import printable
from .errors import MediaRefused

__all__ = ["IMAGE_TYPES", "FetchedImage", "checked_image", "declared_type", "sniff"]

#: The accepted media types, each with the other names servers declare it by.
IMAGE_TYPES: dict[str, tuple[str, ...]] = {
    "image/png": (),
    "image/jpeg": ("image/jpg", "image/pjpeg"),
    "image/gif": (),
    "image/webp": (),
    "image/bmp": ("image/x-bmp", "image/x-ms-bmp"),
}
_ALIASES = {alias: name for name, aliases in IMAGE_TYPES.items() for alias in aliases}


@dataclass(frozen=True)
class FetchedImage:
    """An image's bytes, their media type (sniffed and declared alike), and their SHA-256
    (hex): the key a cache of decoded images uses."""

    data: bytes = field(repr=False)
    media_type: str
    sha256: str

    def __repr__(self) -> str:
        return f"FetchedImage({self.media_type}, {len(self.data)} bytes, {self.sha256[:12]})"


def sniff(data: bytes) -> str | None:
    """The media type the bytes' magic says, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith(b"BM") and len(data) >= 26:
        return "image/bmp"
    return None


def declared_type(content_type: str | None) -> str | None:
    """A ``Content-Type`` value's media type, lowercased, aliases made canonical."""
    if not content_type:
        return None
    media_type = content_type.split(";", 1)[0].strip().lower()
    return _ALIASES.get(media_type, media_type)


def checked_image(url: str, data: bytes, content_type: str | None) -> FetchedImage:
    """``data`` as a :class:`FetchedImage`, if its declared type is an accepted image type
    and its magic says the same; else refused naming both."""
    declared = declared_type(content_type)
    if declared is None:
        raise MediaRefused(url, "declares no content type (an image type is needed)")
    if declared == "image/svg+xml":
        raise MediaRefused(url, "is an SVG image, which is not accepted (png, jpeg, gif, "
                           "webp, bmp are)")
    if declared not in IMAGE_TYPES:
        raise MediaRefused(url, f"has content type '{printable(declared, 60)}', not an accepted image "
                           "type (png, jpeg, gif, webp, bmp)")
    sniffed = sniff(data)
    if sniffed != declared:
        raise MediaRefused(url, f"is declared '{declared}' but its bytes are "
                           f"{'not an accepted image' if sniffed is None else sniffed}")
    return FetchedImage(data, declared, hashlib.sha256(data).hexdigest())
