"""Reading a ``multipart/form-data`` upload (``POST /v1/files``) as it arrives, within its
limits: python-multipart's streaming parser is fed each body message, so that a body over
the limit is refused (413) at the first byte past it, never buffered whole first.

What an upload holds (:class:`Form`): small text fields (at most :data:`MAX_FIELDS`, of
:data:`MAX_FIELD_BYTES` each), and one file part, kept in memory (it becomes a stored
record's body) up to ``file_limit`` bytes. The body may be a few KiB larger than that
(:data:`FORM_OVERHEAD`: the parts' heads and boundaries).

Time: the body has no overall deadline (200 MB takes a while on a slow link), but one
that stops arriving for ``timeout`` seconds is a 408 (a trickling client holds one
connection at most that long per byte it sends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from ..errors import BodyTimeout, ClientError, PayloadTooLarge, UnsupportedMediaType, printable
from .asgi import header, queued_first

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

__all__ = ["FORM_OVERHEAD", "Form", "MAX_FIELDS", "MAX_FIELD_BYTES", "read_form",
           "form_boundary"]

#: Text fields a form may have, and the bytes of each.
MAX_FIELDS = 8
MAX_FIELD_BYTES = 1024
#: Body bytes allowed beyond the file's: part heads and boundaries.
FORM_OVERHEAD = 64 * 1024


@dataclass(slots=True)
class Form:
    """The parts of an upload: ``fields`` (name -> text), and the file part's ``file_name``
    (the form field's, None when there was no file part), ``filename`` and ``content``."""

    fields: dict[str, str] = field(default_factory=dict)
    file_name: str | None = None
    filename: str = ""
    content: bytes = b""


def form_boundary(scope: dict) -> bytes:
    """The boundary of a ``multipart/form-data`` request; 415 for another content type or
    one without a boundary (refused before the body, which is then read away)."""
    media, options = parse_options_header(header(scope, b"content-type"))
    if media.lower() != b"multipart/form-data":
        raise UnsupportedMediaType(
            "An upload must be sent as 'Content-Type: multipart/form-data'.",
            param="content-type")
    boundary = options.get(b"boundary")
    if not boundary:
        raise UnsupportedMediaType("The multipart/form-data Content-Type has no boundary.",
                                   param="content-type")
    return boundary


class _Parts:
    """python-multipart's callbacks: collects the parts into a :class:`Form`, and raises
    at the first part or byte over a limit (the error leaves ``write`` at once)."""

    def __init__(self, file_field: str, file_limit: int) -> None:
        self.form = Form()
        self.ended = False
        self._file_field = file_field
        self._file_limit = file_limit
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._name = ""
        self._is_file = False
        self._chunks: list[bytes] = []
        self._size = 0

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value_data, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end, "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._disposition = b""
        self._chunks = []
        self._size = 0

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if bytes(self._header_name).strip().lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        kind, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if kind.lower() != b"form-data" or name is None:
            raise ClientError("Each part of the form needs 'Content-Disposition: form-data; "
                              "name=...'.")
        self._name = name.decode("utf-8", "replace")
        form = self.form
        if self._name in form.fields or self._name == form.file_name:
            raise ClientError(f"The form has '{printable(self._name)}' twice.",
                              param=self._name)
        filename = options.get(b"filename")
        self._is_file = self._name == self._file_field
        if self._is_file:
            if filename is None:
                raise ClientError(f"'{self._file_field}' must be a file (a part with a "
                                  "filename).", param=self._file_field)
            form.file_name = self._name
            form.filename = filename.decode("utf-8", "replace")
        elif len(form.fields) >= MAX_FIELDS:
            raise ClientError(f"The form has more than {MAX_FIELDS} fields.")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self._size += end - start
        if self._is_file:
            if self._size > self._file_limit:
                raise PayloadTooLarge(f"The file is larger than {self._file_limit} bytes.",
                                      param=self._file_field)
        elif self._size > MAX_FIELD_BYTES:
            raise ClientError(f"The form field '{printable(self._name)}' is longer than "
                              f"{MAX_FIELD_BYTES} bytes.", param=self._name)
        self._chunks.append(data[start:end])

    def _part_end(self) -> None:
        content = b"".join(self._chunks)
        self._chunks = []
        if self._is_file:
            self.form.content = content
            return
        try:
            self.form.fields[self._name] = content.decode("utf-8")
        except UnicodeDecodeError:
            raise ClientError(f"The form field '{printable(self._name)}' is not UTF-8.",
                              param=self._name) from None

    def _end(self) -> None:
        self.ended = True


async def read_form(scope: dict, receive, boundary: bytes, *, file_field: str,
                    file_limit: int, timeout: float | None) -> Form | None:
    """The upload's :class:`Form` (``boundary``: :func:`form_boundary`'s), read and parsed
    as it arrives; None if the client went away. Raises :class:`PayloadTooLarge` (for a
    declared ``Content-Length`` at once, else at the first byte over),
    :class:`BodyTimeout` (nothing arrived for ``timeout`` seconds), and a 400 for a body
    that is not a well-formed form."""
    limit = file_limit + FORM_OVERHEAD
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The file is larger than {file_limit} bytes.",
                              param=file_field)
    parts = _Parts(file_field, file_limit)
    parser = MultipartParser(boundary, parts.callbacks())
    receive = queued_first(receive)
    size = 0
    while True:
        message = None
        with trio.move_on_after(timeout or math.inf):
            message = await receive()
        if message is None:
            raise BodyTimeout(f"The upload stopped arriving for {timeout:g} s.")
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The file is larger than {file_limit} bytes.",
                                  param=file_field)
        try:
            parser.write(chunk)
        except FormParserError as exc:
            raise ClientError("The multipart/form-data body is malformed: "
                              f"{printable(str(exc))}") from None
        if not message.get("more_body", False):
            break
    if not parts.ended:
        raise ClientError("The multipart/form-data body ended before its closing boundary.")
    return parts.form
