"""Sans-IO HTTP/1.1, client side: the request writer and the incremental response parser.

No I/O here: :class:`HTTPResponseParser` takes the bytes received, in pieces of any size, and
``tests/test_loadgen_parse.py`` feeds it byte strings split at every position.
"""

from __future__ import annotations

MAX_HEAD_BYTES = 64 * 1024


class ProtocolError(Exception):
    """The peer sent something that is not a valid HTTP/1.1 response (or stopped mid-way)."""


class ResponseHead:
    """Status line and headers of a response. Header names are lower-cased."""

    __slots__ = ("http_version", "status", "reason", "headers")

    def __init__(self, http_version: str, status: int, reason: str, headers: list) -> None:
        self.http_version = http_version
        self.status = status
        self.reason = reason
        self.headers = headers  # [(name_lower, value), ...]

    def get(self, name: str, default: str | None = None) -> str | None:
        """The value of the header ``name`` (the values joined by ", " when repeated)."""
        name = name.lower()
        values = [v for k, v in self.headers if k == name]
        if not values:
            return default
        return ", ".join(values)

    def __repr__(self) -> str:
        return (f"ResponseHead({self.http_version!r}, {self.status}, {self.reason!r}, "
                f"{self.headers!r})")


# parser states
_HEAD, _LENGTH, _CLOSE, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _DONE = range(8)
_HEX = frozenset(b"0123456789abcdefABCDEF")


def _parse_head(block: bytes) -> ResponseHead:
    lines = block.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ProtocolError(f"bad status line: {status_line[:100]!r}")
    code = parts[1]
    if len(code) != 3 or not code.isdigit():
        raise ProtocolError(f"bad status code: {status_line[:100]!r}")
    reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
    headers = []
    for raw in lines[1:]:
        line = raw.rstrip(b"\r")
        if not line:
            continue
        if line[:1] in (b" ", b"\t"):
            raise ProtocolError("obsolete header line folding is not supported")
        colon = line.find(b":")
        if colon <= 0:
            raise ProtocolError(f"bad header line: {line[:100]!r}")
        name = line[:colon]
        if name != name.strip():
            raise ProtocolError(f"whitespace in header name: {line[:100]!r}")
        headers.append(
            (name.decode("latin-1").lower(), line[colon + 1 :].strip(b" \t").decode("latin-1"))
        )
    return ResponseHead(parts[0].decode("ascii"), int(code), reason, headers)


class HTTPResponseParser:
    """Incremental parser of one HTTP/1.1 response. No I/O.

    Feed it the bytes received, in pieces of any size: :meth:`feed` returns the body bytes
    decoded from them (chunked framing removed). ``head`` is the :class:`ResponseHead` once the
    status line and headers are in (interim 1xx responses are skipped), ``done`` is true once
    the response is complete, ``trailing`` holds any bytes received after its end, and
    ``keep_alive`` says whether the connection may carry another request. Call
    :meth:`feed_eof` when the peer closes: that ends a body delimited by the close, and raises
    :class:`ProtocolError` if the response was cut short.
    """

    __slots__ = ("head", "done", "keep_alive", "trailing", "_state", "_buf", "_remaining",
                 "_no_body")

    def __init__(self, *, method: str = "GET") -> None:
        self.head: ResponseHead | None = None
        self.done = False
        self.keep_alive = True
        self.trailing = b""
        self._state = _HEAD
        self._buf = b""
        self._remaining = 0
        self._no_body = method.upper() == "HEAD"

    def feed(self, data: bytes) -> bytes:
        state = self._state
        if state == _DONE:
            self.trailing += data
            return b""
        if self._buf:
            buf = self._buf + data
            self._buf = b""
        else:
            buf = data
        n = len(buf)
        pos = 0
        out = []
        while pos < n:
            if state == _CHUNK_DATA:
                take = n - pos
                rem = self._remaining
                if take >= rem:
                    out.append(buf[pos : pos + rem])
                    pos += rem
                    self._remaining = 0
                    state = _CHUNK_CRLF
                else:
                    out.append(buf[pos:] if pos else buf)
                    self._remaining = rem - take
                    pos = n
            elif state == _CHUNK_CRLF:
                c = buf[pos]
                if c == 10:  # bare LF, tolerated
                    pos += 1
                elif c == 13:
                    if pos + 1 >= n:
                        self._buf = buf[pos:]
                        pos = n
                        break
                    if buf[pos + 1] != 10:
                        raise ProtocolError("missing CRLF after chunk data")
                    pos += 2
                else:
                    raise ProtocolError("missing CRLF after chunk data")
                state = _CHUNK_SIZE
            elif state == _CHUNK_SIZE:
                i = buf.find(b"\n", pos)
                if i < 0:
                    if n - pos > 1024:
                        raise ProtocolError("chunk size line too long")
                    self._buf = buf[pos:]
                    pos = n
                    break
                line = buf[pos:i]
                pos = i + 1
                size_field = line.split(b";", 1)[0].strip(b" \t\r")
                if not size_field or len(size_field) > 16 or not _HEX.issuperset(size_field):
                    raise ProtocolError(f"bad chunk size line: {line[:40]!r}")
                size = int(size_field, 16)
                if size:
                    self._remaining = size
                    state = _CHUNK_DATA
                else:
                    state = _TRAILERS
            elif state == _TRAILERS:
                i = buf.find(b"\n", pos)
                if i < 0:
                    if n - pos > MAX_HEAD_BYTES:
                        raise ProtocolError("trailer section too long")
                    self._buf = buf[pos:]
                    pos = n
                    break
                line = buf[pos:i]
                pos = i + 1
                if line in (b"", b"\r"):
                    state = _DONE
                    self.done = True
                    self.trailing = buf[pos:]
                    pos = n
            elif state == _LENGTH:
                take = n - pos
                rem = self._remaining
                if take >= rem:
                    if rem:
                        out.append(buf[pos : pos + rem])
                    pos += rem
                    self._remaining = 0
                    state = _DONE
                    self.done = True
                    self.trailing = buf[pos:]
                    pos = n
                else:
                    out.append(buf[pos:] if pos else buf)
                    self._remaining = rem - take
                    pos = n
            elif state == _CLOSE:
                out.append(buf[pos:] if pos else buf)
                pos = n
            elif state == _HEAD:
                end = _find_head_end(buf, pos)
                if end < 0:
                    if n - pos > MAX_HEAD_BYTES:
                        raise ProtocolError("response head too long")
                    self._buf = buf[pos:]
                    pos = n
                    break
                head = _parse_head(buf[pos:end])
                pos = end
                # skip the blank line
                if buf[pos] == 13:
                    pos += 2
                else:
                    pos += 1
                if 100 <= head.status < 200 and head.status != 101:
                    continue  # interim response: the real one follows
                state = self._start_body(head)
                if state == _DONE:
                    self.done = True
                    self.trailing = buf[pos:]
                    pos = n
            else:  # pragma: no cover - _DONE is handled above
                raise AssertionError(state)
        self._state = state
        if not out:
            return b""
        if len(out) == 1:
            return out[0]
        return b"".join(out)

    def _start_body(self, head: ResponseHead) -> int:
        self.head = head
        conn_tokens = {t.strip().lower() for t in (head.get("connection") or "").split(",")}
        if head.http_version == "HTTP/1.0":
            self.keep_alive = "keep-alive" in conn_tokens
        else:
            self.keep_alive = "close" not in conn_tokens
        status = head.status
        if self._no_body or status in (204, 304) or 100 <= status < 200:
            return _DONE
        te = head.get("transfer-encoding")
        if te is not None:
            codings = [c.strip().lower() for c in te.split(",") if c.strip()]
            if codings and codings[-1] == "chunked":
                return _CHUNK_SIZE
            self.keep_alive = False
            return _CLOSE
        cl = head.get("content-length")
        if cl is not None:
            values = {v.strip() for v in cl.split(",")}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise ProtocolError(f"bad Content-Length: {cl!r}")
            self._remaining = int(next(iter(values)))
            return _LENGTH if self._remaining else _DONE
        self.keep_alive = False
        return _CLOSE

    def feed_eof(self) -> bytes:
        """The peer closed the connection. Returns nothing; raises if the response is cut."""
        self.keep_alive = False
        if self._state == _CLOSE:
            self._state = _DONE
            self.done = True
            return b""
        if self._state == _DONE:
            return b""
        if self._state == _HEAD and not self._buf:
            raise ProtocolError("connection closed before any response")
        raise ProtocolError("connection closed in the middle of the response")


def _find_head_end(buf: bytes, pos: int) -> int:
    """Index of the blank line that ends the head (its CR or LF), or -1."""
    a = buf.find(b"\r\n\r\n", pos)
    b = buf.find(b"\n\n", pos)
    if a >= 0 and (b < 0 or a + 1 <= b):
        return a + 2
    if b >= 0:
        return b + 1
    return -1


def build_request(
    method: str, target: str, host: str, body: bytes = b"", headers: tuple = ()
) -> bytes:
    """An HTTP/1.1 request as bytes (keep-alive; Content-Length when there is a body)."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "User-Agent: trio-llm-loadgen/0.1"]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    for name, value in headers:
        if any(c in str(name) + str(value) for c in "\r\n\0"):
            raise ValueError(f"control character in header {name!r}")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
