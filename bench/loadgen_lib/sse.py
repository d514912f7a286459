"""Sans-IO Server-Sent Events: ``text/event-stream`` bytes in, ``(event_type, data)`` out."""

from __future__ import annotations


class SSEParser:
    """Incremental ``text/event-stream`` parser (WHATWG rules). No I/O.

    :meth:`feed` takes body bytes in pieces of any size and returns the events completed by
    them, as ``(event_type, data)`` string pairs (``event_type`` is ``"message"`` unless an
    ``event:`` field said otherwise; multi-line data is joined with ``"\\n"``). Lines may end
    with LF, CRLF or CR; comments (``:...``) and ``id``/``retry`` fields are ignored; an
    incomplete event at the end of the stream is dropped.
    """

    __slots__ = ("_buf", "_data", "_event", "_first")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._event = ""
        self._first = True

    def feed(self, data: bytes) -> list:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            hold = b""
            if buf[-1:] == b"\r":  # could be the first half of a CRLF
                buf, hold = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            lines = buf.split(b"\n")
            self._buf = lines.pop() + hold
        else:
            lines = buf.split(b"\n")
            self._buf = lines.pop()
        if not lines:
            return []
        if self._first:
            self._first = False
            if lines[0].startswith(b"\xef\xbb\xbf"):
                lines[0] = lines[0][3:]
        events = []
        dl = self._data
        for line in lines:
            if not line:
                if dl:
                    events.append(
                        (self._event or "message", b"\n".join(dl).decode("utf-8", "replace"))
                    )
                    dl = self._data = []
                self._event = ""
                continue
            if line[0] == 58:  # ":" comment
                continue
            if line[:5] == b"data:":
                v = line[5:]
                if v[:1] == b" ":
                    v = v[1:]
                dl.append(v)
                continue
            colon = line.find(b":")
            if colon < 0:
                field, value = line, b""
            else:
                field, value = line[:colon], line[colon + 1 :]
                if value[:1] == b" ":
                    value = value[1:]
            if field == b"data":
                dl.append(value)
            elif field == b"event":
                self._event = value.decode("utf-8", "replace")
            # id, retry and unknown fields: ignored
        return events
