"""Image content parts of a chat request, read without IO (docs/protocol.md, "Images").

A chat ``image_url`` part is read here into an :class:`ImageRef`: its URL, its
``detail`` and the client's name for it. The ref stays in its message's content, in
order among the text parts, until the route fetches it (server.http.images). The fetch
then puts the wire part in its place: ``{"type": "image", "data": bytes, "sha256": hex}``.

Only an engine whose HELLO info says ``"images": {"per_prompt": N}`` (N > 0) takes image
parts. For any other engine an image part is a 400 naming the part and the model, before
anything is fetched. More than N images in one prompt is a 400 naming the first part
past the limit.

``detail`` is accepted as OpenAI spells it (``auto``, ``low``, ``high``) and has no effect:
the model's own processor sizes images, as in vLLM, which ignores it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ClientError, clip, printable

__all__ = ["DETAILS", "ImageRef", "image_limit", "read_image_url_part", "refuse_image",
           "wire_image"]

#: The ``detail`` values accepted (none changes what the engine sees).
DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class ImageRef:
    """An image part not yet fetched: its URL and how the client names it."""

    url: str
    detail: str
    #: The part (``messages[0].content[1]``): what a limit refuses.
    param: str
    #: The URL's field (``messages[0].content[1].image_url.url``): what a fetch refuses.
    url_param: str
    #: The bytes and SHA-256 a stored response kept for this URL: used, not fetched
    #: (server.http.responses_images).
    kept: tuple[bytes, str] | None = field(default=None, repr=False)


def image_limit(engine_info: dict | None) -> int:
    """The images one prompt may hold on this engine (its HELLO's ``images.per_prompt``);
    0: it takes text only."""
    images = (engine_info or {}).get("images")
    limit = images.get("per_prompt") if isinstance(images, dict) else None
    return limit if isinstance(limit, int) and limit > 0 else 0


def refuse_image(kind: str, param: str, model: object) -> ClientError:
    """The 400 for an image part on an engine that takes text only."""
    return ClientError(
        f"Content parts of type '{printable(kind)}' are not supported: model "
        f"'{clip(printable(str(model)))}' takes text only (no image input).",
        param=param, code="unsupported_parameter",
    )


def read_image_url_part(part: dict, param: str) -> ImageRef:
    """A chat ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` part
    (``param``: its name); a 400 naming the field that is wrong."""
    body = part.get("image_url")
    if isinstance(body, str):  # (vLLM takes the URL alone too)
        body = {"url": body}
    if not isinstance(body, dict):
        raise ClientError("An image_url part needs 'image_url': {\"url\": ...}.",
                          param=f"{param}.image_url")
    for name in body:
        if name not in ("url", "detail"):
            raise ClientError(f"Unknown field '{printable(str(name))}' of an image_url part.",
                              param=f"{param}.image_url.{printable(str(name))}",
                              code="unknown_parameter")
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise ClientError("An image_url part needs a non-empty string 'url'.",
                          param=f"{param}.image_url.url")
    detail = body.get("detail", "auto")
    if detail is None:
        detail = "auto"
    if not isinstance(detail, str) or detail not in DETAILS:
        raise ClientError(f"'detail' must be one of {', '.join(DETAILS)}.",
                          param=f"{param}.image_url.detail")
    return ImageRef(url, detail, param, f"{param}.image_url.url")


def wire_image(data: bytes, sha256: str) -> dict:
    """The part a worker gets in place of an :class:`ImageRef` once it is fetched."""
    return {"type": "image", "data": data, "sha256": sha256}
