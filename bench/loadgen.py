#!/usr/bin/env python3
"""OpenAI-compatible streaming load generator for trio-llm-server (loopback only).

A closed-loop benchmark: ``--concurrency`` clients each send streaming requests back to back
(``POST /v1/completions`` or ``/v1/chat/completions`` with ``stream: true``) until
``--requests`` requests were sent in all or ``--duration`` seconds passed, and measure what a
client sees: time to first token, the gaps between content events, delivered tokens per second,
errors and streams that ended without ``data: [DONE]``. Given the server's process ids it also
reads the CPU time (utime + stime, ``/proc/PID/stat``) of the frontend and of each worker
before and after the run and reports CPU microseconds per delivered token.

It shares a small machine with the server, so it is built to cost little CPU: raw sockets
(``trio.open_tcp_stream``), keep-alive connections, a hand-written HTTP/1.1 request writer and
an incremental response parser (status line, headers, chunked / Content-Length / until-close
bodies) and SSE parser. The parsers do no I/O (sans-IO) and are tested on byte strings split at
every position by ``tests/test_loadgen_parse.py``. One client task per connection sends the
requests; one reader task (:class:`Reactor`) reads the responses of all connections: it waits,
through Trio, on a private epoll set holding every socket with a response in flight, then reads
and parses each ready socket with a single ``os.read`` (Trio's ``receive_some`` would cost a
failing ``recv``, an exception and a task switch per event). Linux only (epoll, ``/proc``).

Examples::

    # against a running server
    python bench/loadgen.py --url http://127.0.0.1:8000 --concurrency 64 --requests 512 \\
        --prompt-tokens 128 --max-tokens 256 --server-pids-from-port

    # one command: start the server on a free port, load it, stop it
    python bench/loadgen.py --spawn-server "--engine-workers 1 --sim-itl-ms 8" \\
        --concurrency 128 --requests 512 --prompt-tokens 128 --max-tokens 256

Output: a progress line on stderr while it runs, then a summary table and, as the last line
of stdout, one JSON object (see ``summarize``). Exit status: 0 when every request succeeded,
1 when some failed or ended without ``[DONE]``, 2 on a usage or setup error.

Definitions:

* TTFT: from just before the request is sent (including connecting, for a new connection) to
  the receipt of the first event with non-empty text.
* gap: time between the receipts of consecutive content events (events with non-empty text)
  of one stream. Events that arrive in the same ``recv`` share a timestamp (gap 0).
* delivered tokens: ``usage.completion_tokens`` of the usage chunk; without one, the number of
  content events.
* errors: requests with an HTTP status other than 200, an ``error`` event (``event: error`` or
  ``data: {"error": ...}``), a connection or protocol error, or a timeout.
* incomplete streams: 200 responses that ended (cleanly or not) without ``data: [DONE]``.
  A stream cut off by the server counts as an error and as incomplete.
* percentiles: nearest rank over all requests (TTFT) or all gaps.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import resource
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import trio

__all__ = [
    "ProtocolError",
    "ResponseHead",
    "HTTPResponseParser",
    "SSEParser",
    "StreamTracker",
    "build_request",
    "percentile",
    "check_loopback_url",
    "parse_args",
    "run_benchmark",
    "summarize",
    "main",
]

_perf = time.perf_counter
_json_loads = json.loads
_os_read = os.read
_wait_readable = trio.lowlevel.wait_readable

REPO_ROOT = Path(__file__).resolve().parent.parent
RECV_SIZE = 65536
MAX_HEAD_BYTES = 64 * 1024
MAX_ERROR_BODY = 64 * 1024
MAX_ERROR_SAMPLES = 5


# ============================================================================================
# Sans-IO: HTTP/1.1 response parsing
# ============================================================================================


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


# ============================================================================================
# Sans-IO: Server-Sent Events
# ============================================================================================


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


# ============================================================================================
# Sans-IO: interpretation of an OpenAI stream
# ============================================================================================


class StreamTracker:
    """Follows the SSE events of one OpenAI streaming response and keeps its timings.

    ``on_event(event_type, data, now)`` for each event, with ``now`` the receipt time in
    seconds (any clock). Afterwards: ``first`` (time of the first content event, or None),
    ``gaps`` (seconds between consecutive content events), ``content_events``, ``usage_tokens``
    (``usage.completion_tokens`` of the last chunk that had one), ``done`` (saw ``[DONE]``) and
    ``error`` (message of the first error event, or None).
    """

    __slots__ = ("chat", "first", "last", "gaps", "content_events", "usage_tokens", "done",
                 "error", "events")

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.content_events = 0
        self.usage_tokens: int | None = None
        self.done = False
        self.error: str | None = None
        self.events = 0

    @property
    def tokens(self) -> int:
        """Delivered tokens: from the usage chunk, else one per content event."""
        return self.usage_tokens if self.usage_tokens is not None else self.content_events

    def on_event(self, event_type: str, data: str, now: float) -> None:
        self.events += 1
        if data == "[DONE]" or (len(data) < 16 and data.strip() == "[DONE]"):
            self.done = True
            return
        if event_type == "error":
            self._set_error(_error_message(data))
            return
        try:
            obj = _json_loads(data)
        except ValueError:
            self._set_error(f"event data is not JSON: {data[:80]!r}")
            return
        if type(obj) is not dict:
            self._set_error(f"event data is not a JSON object: {data[:80]!r}")
            return
        err = obj.get("error")
        if err is not None:
            self._set_error(_error_message(obj))
            return
        usage = obj.get("usage")
        if usage and type(usage) is dict:
            ct = usage.get("completion_tokens")
            if type(ct) is int:
                self.usage_tokens = ct
        choices = obj.get("choices")
        if not choices:
            return
        has_text = False
        if self.chat:
            for c in choices:
                d = c.get("delta")
                if d and d.get("content"):
                    has_text = True
                    break
        else:
            for c in choices:
                if c.get("text"):
                    has_text = True
                    break
        if has_text:
            self.content_events += 1
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now

    def _set_error(self, message: str) -> None:
        if self.error is None:
            self.error = message


def _error_message(body) -> str:
    """The message of an OpenAI error body (dict, JSON text or bytes), else the text itself."""
    obj = body
    if isinstance(body, (bytes, str)):
        try:
            obj = json.loads(body)
        except ValueError:
            text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
            return text.strip()[:200] or "(empty)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("type") or json.dumps(err)[:200]
            return str(msg)[:200]
        return str(err)[:200]
    return json.dumps(obj)[:200]


# ============================================================================================
# Sans-IO: requests, URLs, statistics
# ============================================================================================


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


def check_loopback_url(url: str) -> tuple[str, int, str, str]:
    """Validate a base URL: ``http``, loopback host. Returns (host, port, path, host_header).

    Raises ValueError for anything else: this tool only loads servers on this machine.
    """
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, not {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    if host != "localhost":
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"refusing to target {host!r}: only loopback hosts (127.0.0.1, ::1, localhost)"
            ) from None
        if not ip.is_loopback:
            raise ValueError(
                f"refusing to target {host!r}: only loopback hosts (127.0.0.1, ::1, localhost)"
            )
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"bad port in {url!r}: {exc}") from None
    host_header = f"[{host}]" if ":" in host else host
    if port != 80:
        host_header += f":{port}"
    return host, port, parts.path.rstrip("/"), host_header


def api_path(base_path: str, endpoint: str) -> str:
    """``/v1/<endpoint>`` under the base URL's path (which may already end in ``/v1``)."""
    base = base_path.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return f"{base}/{endpoint}"


def percentile(sorted_values, p: float):
    """Nearest-rank percentile of an ascending sequence (None when empty)."""
    n = len(sorted_values)
    if n == 0:
        return None
    k = math.ceil(p / 100.0 * n)
    k = min(max(k, 1), n)
    return sorted_values[k - 1]


_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def prompt_tail(n_words: int) -> str:
    """All but the first word of a prompt of ``n_words`` whitespace-separated words (the
    first word is unique per request, so no two prompts are identical)."""
    rest = [_WORDS[i % len(_WORDS)] for i in range(max(n_words - 1, 0))]
    return " " + " ".join(rest) if rest else ""


class BodyMaker:
    """Request bodies: the same JSON for every request except a unique first prompt word."""

    _MARK = "QQLOADGENMARKQQ"

    def __init__(self, *, chat: bool, model: str, prompt_tokens: int, max_tokens: int,
                 include_usage: bool, extra: dict | None = None) -> None:
        prompt = self._MARK + prompt_tail(prompt_tokens)
        body: dict = {"model": model}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body["max_tokens"] = max_tokens
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        if extra:
            body.update(extra)
        encoded = json.dumps(body, separators=(",", ":")).encode()
        self._pre, self._post = encoded.split(self._MARK.encode(), 1)

    def body(self, ticket: int) -> bytes:
        return self._pre + b"r%d" % ticket + self._post


# ============================================================================================
# CPU time from /proc
# ============================================================================================

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read_stat(pid: int):
    """(ppid, utime+stime ticks, comm) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rp = data.rfind(b")")
    comm = data[data.find(b"(") + 1 : rp].decode("utf-8", "replace")
    rest = data[rp + 2 :].split()
    # rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15
    return int(rest[1]), int(rest[11]) + int(rest[12]), comm


def _all_pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []


def descendants(root: int) -> list[int]:
    """All descendants of ``root`` (via the ppid field of /proc/*/stat), sorted."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = _read_stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return sorted(out)


def pids_listening_on(port: int) -> list[int]:
    """Processes holding a TCP socket that listens on ``port`` (/proc/net/tcp{,6} + fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A = LISTEN
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return []
    found = []
    for pid in _all_pids():
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in inodes:
                    found.append(pid)
                    break
            except OSError:
                continue
    return sorted(found)


def server_pid_from_port(port: int) -> int | None:
    """The topmost process listening on ``port`` (one whose parent does not listen too)."""
    pids = pids_listening_on(port)
    if not pids:
        return None
    pidset = set(pids)
    for pid in pids:
        st = _read_stat(pid)
        if st is None or st[0] not in pidset:
            return pid
    return pids[0]


class CpuMeter:
    """Reads the CPU time of the frontend and of its workers, before and after a run.

    Workers are the given pids, or (``auto_workers``) all descendants of the frontend at each
    snapshot; a worker that appeared during the run is counted from zero, one that vanished
    is reported as lost (its CPU after the first snapshot is unknown).
    """

    def __init__(self, frontend: int | None, workers: list[int] | None, auto_workers: bool):
        self.frontend = frontend
        self.workers = list(workers or [])
        self.auto = auto_workers
        self.before: dict | None = None

    def _snapshot(self) -> dict:
        pids = {}
        if self.frontend is not None:
            st = _read_stat(self.frontend)
            if st is not None:
                pids["frontend"] = (self.frontend, st[1], st[2])
        workers = descendants(self.frontend) if self.auto and self.frontend else self.workers
        w = {}
        for pid in workers:
            st = _read_stat(pid)
            if st is not None:
                w[pid] = (st[1], st[2])
        return {"frontend": pids.get("frontend"), "workers": w, "t": _perf()}

    def start(self) -> None:
        self.before = self._snapshot()

    def stop(self) -> dict:
        """CPU seconds used since :meth:`start`: frontend, workers (per pid), total."""
        after = self._snapshot()
        before = self.before or {"frontend": None, "workers": {}}
        res: dict = {"frontend_pid": self.frontend, "frontend_cpu_s": None, "workers": []}
        if after["frontend"] and before["frontend"]:
            res["frontend_cpu_s"] = (after["frontend"][1] - before["frontend"][1]) / CLK_TCK
        total = 0.0
        for pid, (ticks, comm) in sorted(after["workers"].items()):
            b = before["workers"].get(pid, (0, comm))[0]
            cpu = (ticks - b) / CLK_TCK
            total += cpu
            res["workers"].append({"pid": pid, "comm": comm, "cpu_s": round(cpu, 3),
                                   "new": pid not in before["workers"]})
        res["lost_workers"] = sorted(set(before["workers"]) - set(after["workers"]))
        res["workers_cpu_s"] = total if (after["workers"] or before["workers"]) else None
        return res


# ============================================================================================
# I/O: the load
# ============================================================================================


class Target:
    """Where to connect (a numeric loopback address) and what to send."""

    def __init__(self, url: str) -> None:
        self.host, self.port, self.base_path, self.host_header = check_loopback_url(url)
        self.connect_host = self.host  # replaced by a numeric address by resolve()

    async def resolve(self) -> None:
        """Pick the first loopback address of the host that accepts a connection."""
        infos = await trio.socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        addrs = []
        for *_, sockaddr in infos:
            ip = ipaddress.ip_address(sockaddr[0])
            if not ip.is_loopback:
                raise ValueError(f"{self.host!r} resolves to non-loopback address {ip}")
            if sockaddr[0] not in addrs:
                addrs.append(sockaddr[0])
        last: Exception | None = None
        for addr in addrs:
            try:
                stream = await trio.open_tcp_stream(addr, self.port)
            except OSError as exc:
                last = exc
                continue
            await stream.aclose()
            self.connect_host = addr
            return
        raise ConnectionError(f"cannot connect to {self.host}:{self.port}: {last}")

    async def connect(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(self.connect_host, self.port)


def _close(stream) -> None:
    try:
        stream.socket.close()
    except Exception:  # pragma: no cover
        pass


async def simple_get(target: Target, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``path`` on a fresh connection; returns (status, body). Raises on I/O errors."""
    with trio.fail_after(timeout):
        stream = await target.connect()
        try:
            await stream.send_all(build_request("GET", path, target.host_header,
                                                headers=(("Connection", "close"),)))
            parser = HTTPResponseParser()
            body = []
            while not parser.done:
                data = await stream.receive_some(RECV_SIZE)
                if not data:
                    parser.feed_eof()
                    break
                body.append(parser.feed(data))
            return parser.head.status, b"".join(body)
        finally:
            _close(stream)


class Result:
    __slots__ = ("start", "end", "status", "tracker", "error", "error_kind", "incomplete")

    def __init__(self, start: float) -> None:
        self.start = start
        self.end = start
        self.status = 0
        self.tracker: StreamTracker | None = None
        self.error: str | None = None
        self.error_kind: str | None = None
        self.incomplete = False


class Stats:
    """What a phase of the run collected."""

    def __init__(self, record_timeline: bool) -> None:
        self.requests = 0
        self.errors = 0
        self.incomplete = 0
        self.tokens = 0
        self.content_events = 0
        self.ttfts: list[float] = []
        self.gaps = array("d")
        self.error_kinds: Counter = Counter()
        self.error_samples: list[str] = []
        self.statuses: Counter = Counter()
        self.usage_missing = 0
        self.timeline: list | None = [] if record_timeline else None
        self.t_start = 0.0
        self.t_end = 0.0

    def record(self, r: Result) -> None:
        self.requests += 1
        self.statuses[r.status] += 1
        t = r.tracker
        if r.error is not None or (t is not None and t.error is not None):
            self.errors += 1
            kind = r.error_kind or "error_event"
            self.error_kinds[kind] += 1
            if len(self.error_samples) < MAX_ERROR_SAMPLES:
                self.error_samples.append(f"{kind}: {r.error or t.error}")
        if r.incomplete:
            self.incomplete += 1
        if t is not None:
            self.tokens += t.tokens
            self.content_events += t.content_events
            if t.usage_tokens is None and t.content_events:
                self.usage_missing += 1
            if t.first is not None:
                self.ttfts.append(t.first - r.start)
            if t.gaps:
                self.gaps.extend(t.gaps)
        if self.timeline is not None:
            ttft = (t.first - r.start) if (t is not None and t.first is not None) else None
            mean_gap = (sum(t.gaps) / len(t.gaps)) if (t is not None and t.gaps) else None
            self.timeline.append((r.start, r.end, ttft, mean_gap,
                                  t.tokens if t is not None else 0, r.error is not None))


class Phase:
    """Hands out request tickets until the phase's count or deadline is reached."""

    def __init__(self, ctx: "Context", *, max_requests: int | None, duration: float | None,
                 stats: Stats) -> None:
        self.ctx = ctx
        self.max_requests = max_requests
        self.deadline = None if duration is None else trio.current_time() + duration
        self.stats = stats
        self.issued = 0
        self.stopped: str | None = None

    def take(self) -> int | None:
        if self.stopped:
            return None
        if self.max_requests is not None and self.issued >= self.max_requests:
            return None
        if self.deadline is not None and trio.current_time() >= self.deadline:
            return None
        if self.stats.errors >= self.ctx.max_errors:
            self.stopped = f"stopped after {self.stats.errors} errors (--max-errors)"
            return None
        self.issued += 1
        self.ctx.ticket += 1
        return self.ctx.ticket


class Client:
    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream = None


class Context:
    def __init__(self, args, target: Target, model: str) -> None:
        self.args = args
        self.target = target
        self.chat = args.endpoint == "chat"
        path = api_path(target.base_path, "chat/completions" if self.chat else "completions")
        headers = [("Content-Type", "application/json"), ("Accept", "text/event-stream")]
        if args.api_key:
            headers.append(("Authorization", f"Bearer {args.api_key}"))
        self.head = build_request("POST", path, target.host_header, b"", tuple(headers))
        # build_request put "Content-Length: 0" last before the extra headers: split it out
        self.head_pre, self.head_post = self.head.split(b"Content-Length: 0\r\n", 1)
        self.bodies = BodyMaker(chat=self.chat, model=model, prompt_tokens=args.prompt_tokens,
                                max_tokens=args.max_tokens, include_usage=args.include_usage,
                                extra=args.extra_body)
        self.clients = [Client() for _ in range(args.concurrency)]
        self.ticket = 0
        self.max_errors = args.max_errors
        self.inflight = 0
        self.live_events = 0
        self.live_done = 0
        self.live_errors = 0
        self.connections_opened = 0
        self.reactor = Reactor()

    def request_bytes(self, ticket: int) -> bytes:
        body = self.bodies.body(ticket)
        return self.head_pre + b"Content-Length: %d\r\n" % len(body) + self.head_post + body


class _CloseConnection(Exception):
    """Internal: the response is fine but the connection must not be reused."""


class Reactor:
    """Reads the responses of all connections in one task.

    Each connection with a response in flight is registered (level-triggered) in a private
    epoll set; the reactor task waits until that set's fd is readable (through Trio, so it is
    an ordinary checkpoint), then reads and parses every ready socket. A trickling stream thus
    costs one ``os.read`` and the parsing per event, and the Trio scheduler runs once per batch
    of ready sockets instead of once per event; the client task is woken once per response.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._readers: dict[int, "ResponseReader"] = {}
        self._EPOLLIN = select.EPOLLIN
        self.wakeups = 0  # batches of ready sockets handled
        self.reads = 0  # os.read calls on sockets

    def add(self, reader: "ResponseReader") -> None:
        self._readers[reader.fd] = reader
        self._epoll.register(reader.fd, self._EPOLLIN)

    def remove(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except OSError:  # pragma: no cover - already closed
                pass

    async def run(self) -> None:
        epfd = self._epoll.fileno()
        poll = self._epoll.poll
        readers = self._readers
        try:
            while True:
                await _wait_readable(epfd)
                ready = poll(0)
                self.wakeups += 1
                self.reads += len(ready)
                for fd, _mask in ready:
                    reader = readers.get(fd)
                    if reader is not None:
                        reader.on_readable()
        finally:
            self._epoll.close()


class ResponseReader:
    """The state of one response being read; driven by :class:`Reactor`."""

    __slots__ = ("ctx", "fd", "res", "parser", "sse", "tracker", "errbody", "got_any", "exc",
                 "finished")

    def __init__(self, ctx: Context, fd: int, res: Result) -> None:
        self.ctx = ctx
        self.fd = fd
        self.res = res
        self.parser = HTTPResponseParser(method="POST")
        self.sse: SSEParser | None = None
        self.tracker: StreamTracker | None = None
        self.errbody: list[bytes] | None = None
        self.got_any = False
        self.exc: BaseException | None = None
        self.finished = trio.Event()

    def _finish(self, exc: BaseException | None = None) -> None:
        self.exc = exc
        self.ctx.reactor.remove(self.fd)
        self.finished.set()

    def on_readable(self) -> None:
        try:
            data = _os_read(self.fd, RECV_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(exc)
            return
        now = _perf()
        parser = self.parser
        try:
            if not data:
                parser.feed_eof()
                self._finish()
                return
            self.got_any = True
            body = parser.feed(data)
            sse = self.sse
            if sse is not None:
                if body:
                    events = sse.feed(body)
                    if events:
                        tracker = self.tracker
                        before = tracker.content_events
                        on_event = tracker.on_event
                        for ev, d in events:
                            on_event(ev, d, now)
                        self.ctx.live_events += tracker.content_events - before
            elif parser.head is not None:
                self._start(body, now)
            if parser.done:
                self._finish()
        except ProtocolError as exc:
            self._finish(exc)
        except Exception as exc:  # a bug here must not kill the other streams silently
            self._finish(exc)

    def _start(self, body: bytes, now: float) -> None:
        status = self.parser.head.status
        self.res.status = status
        if status == 200:
            self.sse = SSEParser()
            tracker = self.tracker = self.res.tracker = StreamTracker(chat=self.ctx.chat)
            if body:
                for ev, d in self.sse.feed(body):
                    tracker.on_event(ev, d, now)
                self.ctx.live_events += tracker.content_events
        else:
            self.errbody = self.errbody if self.errbody is not None else []
            self.errbody.append(body)
            self.sse = _ErrorBodySink(self.errbody)


class _ErrorBodySink:
    """Collects (a bounded amount of) a non-200 response body in place of the SSE parser."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.size = sum(map(len, parts))

    def feed(self, data: bytes) -> list:
        if self.size < MAX_ERROR_BODY:
            self.parts.append(data)
            self.size += len(data)
        return []


async def _exchange(ctx: Context, stream, req: bytes, res: Result) -> bool:
    """Send one request on ``stream`` and read its response into ``res``.

    Returns whether any response byte came back (a reused connection that yields nothing was
    probably closed by the server while idle, and the request may be retried). Raises
    :class:`_CloseConnection` when the response is complete but the connection is not
    reusable, and the I/O or protocol error that ended the response otherwise.
    """
    await stream.send_all(req)
    reader = ResponseReader(ctx, stream.socket.fileno(), res)
    ctx.reactor.add(reader)
    try:
        await reader.finished.wait()
    finally:
        ctx.reactor.remove(reader.fd)
    res.end = _perf()
    parser = reader.parser
    if reader.exc is not None:
        if isinstance(reader.exc, (ProtocolError, OSError)) and not reader.got_any:
            return False
        raise reader.exc
    if res.status != 200:
        res.error_kind = f"http_{res.status}"
        res.error = f"HTTP {res.status}: {_error_message(b''.join(reader.errbody or []))}"
    else:
        tracker = reader.tracker
        if not tracker.done:
            res.incomplete = True
            ctype = (parser.head.get("content-type") or "").split(";")[0].strip().lower()
            if ctype and ctype != "text/event-stream" and tracker.events == 0:
                res.error_kind = "not_sse"
                res.error = f"200 response with content-type {ctype!r}, not an event stream"
    if not parser.keep_alive or parser.trailing:
        raise _CloseConnection
    return True


_CLOSE_KINDS = frozenset({"timeout", "protocol", "connection", "connection_closed"})


async def one_request(ctx: Context, client: Client, ticket: int) -> Result:
    req = ctx.request_bytes(ticket)
    timeout = ctx.args.request_timeout
    for attempt in (0, 1):
        res = Result(_perf())
        reused = client.stream is not None
        with trio.move_on_after(timeout) as cs:
            try:
                if client.stream is None:
                    ctx.connections_opened += 1
                    client.stream = await ctx.target.connect()
                ok = await _exchange(ctx, client.stream, req, res)
                if not ok:
                    _close(client.stream)
                    client.stream = None
                    if reused and attempt == 0:
                        continue  # stale keep-alive connection: retry once on a fresh one
                    res.error_kind = "connection_closed"
                    res.error = "connection closed before any response"
            except _CloseConnection:
                _close(client.stream)
                client.stream = None
            except ProtocolError as exc:
                res.error_kind = "protocol"
                res.error = str(exc)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if reused and attempt == 0 and res.status == 0:
                    if client.stream is not None:
                        _close(client.stream)
                    client.stream = None
                    continue
                res.error_kind = "connection"
                res.error = f"{type(exc).__name__}: {exc}"
        if cs.cancelled_caught:
            res.error_kind = "timeout"
            res.error = f"no complete response within {timeout} s (--request-timeout)"
        if res.error is not None and res.error_kind in _CLOSE_KINDS:
            # the connection is in an unknown state: do not reuse it
            res.end = _perf()
            if client.stream is not None:
                _close(client.stream)
                client.stream = None
            if res.status == 200:
                res.incomplete = not (res.tracker and res.tracker.done)
        return res
    raise AssertionError("unreachable")  # pragma: no cover


async def client_loop(ctx: Context, client: Client, phase: Phase) -> None:
    stats = phase.stats
    while True:
        ticket = phase.take()
        if ticket is None:
            return
        ctx.inflight += 1
        try:
            res = await one_request(ctx, client, ticket)
        finally:
            ctx.inflight -= 1
        stats.record(res)
        ctx.live_done += 1
        if res.error is not None:
            ctx.live_errors += 1
            if res.status == 0:
                await trio.sleep(0.05)  # connection trouble: do not spin


async def run_phase(ctx: Context, phase: Phase) -> None:
    phase.stats.t_start = _perf()
    async with trio.open_nursery() as nursery:
        for client in ctx.clients:
            nursery.start_soon(client_loop, ctx, client, phase)
    phase.stats.t_end = _perf()


async def progress_task(ctx: Context, state: dict, *, stream=sys.stderr) -> None:
    tty = stream.isatty()
    interval = 0.5 if tty else 5.0
    t0 = _perf()
    last_t, last_ev = t0, 0
    width = 0
    try:
        while True:
            await trio.sleep(interval)
            now = _perf()
            ev = ctx.live_events
            rate = (ev - last_ev) / (now - last_t) if now > last_t else 0.0
            last_t, last_ev = now, ev
            total = state.get("total")
            done = f"{ctx.live_done}/{total}" if total else f"{ctx.live_done}"
            line = (f"[{now - t0:7.1f}s] {state.get('phase', '')} done {done}  in-flight "
                    f"{ctx.inflight}  errors {ctx.live_errors}  content events/s {rate:,.0f}")
            if tty:
                stream.write("\r" + line.ljust(width))
                width = len(line)
            else:
                stream.write(line + "\n")
            stream.flush()
    finally:
        if tty and width:
            stream.write("\r" + " " * width + "\r")
            stream.flush()


async def discover_model(target: Target) -> tuple[str, str | None]:
    """The first model id of GET /v1/models, else "sim" (with the reason)."""
    try:
        status, body = await simple_get(target, api_path(target.base_path, "models"))
    except (OSError, ProtocolError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        return "sim", f"GET /v1/models failed ({type(exc).__name__}: {exc})"
    if status != 200:
        return "sim", f"GET /v1/models returned {status}"
    try:
        return str(json.loads(body)["data"][0]["id"]), None
    except (ValueError, KeyError, IndexError, TypeError):
        return "sim", "GET /v1/models: no model id in the response"


async def run_benchmark(args, *, progress: bool | None = None) -> dict:
    """Run the whole benchmark described by ``args`` (from :func:`parse_args`); returns the
    summary dict (see :func:`summarize`)."""
    target = Target(args.url)
    await target.resolve()
    note = None
    model = args.model
    if model is None:
        model, note = await discover_model(target)
        if note:
            _log(f"{note}; using model {model!r}")
    ctx = Context(args, target, model)
    meter = None
    frontend = args.pid[0] if args.pid else None
    if frontend is None and args.server_pids_from_port:
        frontend = server_pid_from_port(target.port)
        if frontend is None:
            _log(f"no process found listening on port {target.port}; CPU time not measured")
    if frontend is not None:
        for pid in args.pid or [frontend]:
            if _read_stat(pid) is None:
                _log(f"no process {pid} (or /proc/{pid}/stat is unreadable); its CPU time "
                     "will be missing")
        explicit = args.pid[1:] if args.pid and len(args.pid) > 1 else None
        meter = CpuMeter(frontend, explicit, auto_workers=explicit is None)
    if progress is None:
        progress = not args.quiet
    state: dict = {}
    aborted = None
    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(ctx.reactor.run)
            if progress:
                outer.start_soon(progress_task, ctx, state)
            if args.warmup > 0:
                state.update(phase="warmup", total=None)
                warm = Phase(ctx, max_requests=args.max_requests, duration=args.warmup,
                             stats=Stats(False))
                await run_phase(ctx, warm)
                ctx.live_done = ctx.live_errors = 0
                _log(f"warmup: {warm.stats.requests} requests, {warm.stats.errors} errors")
            stats = Stats(record_timeline=bool(args.plot))
            if args.duration is not None:
                phase = Phase(ctx, max_requests=args.max_requests, duration=args.duration,
                              stats=stats)
                state.update(phase="run", total=None)
            else:
                phase = Phase(ctx, max_requests=args.requests, duration=None, stats=stats)
                state.update(phase="run", total=args.requests)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            wakeups0, reads0 = ctx.reactor.wakeups, ctx.reactor.reads
            if meter is not None:
                meter.start()
            with trio.move_on_after(args.time_limit) as cs:
                await run_phase(ctx, phase)
            if cs.cancelled_caught:
                stats.t_end = _perf()
                aborted = f"time limit of {args.time_limit} s reached (--time-limit)"
            cpu = meter.stop() if meter is not None else None
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            outer.cancel_scope.cancel()
    finally:
        for client in ctx.clients:
            if client.stream is not None:
                _close(client.stream)
                client.stream = None
    loadgen_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    summary = summarize(args, stats, cpu=cpu, loadgen_cpu_s=loadgen_cpu, model=model)
    summary["connections_opened"] = ctx.connections_opened
    summary["loadgen_wakeups"] = ctx.reactor.wakeups - wakeups0
    summary["loadgen_reads"] = ctx.reactor.reads - reads0
    if phase.stopped or aborted:
        summary["aborted"] = aborted or phase.stopped
    if args.plot:
        summary["plot"] = make_plot(args.plot, stats, summary)
    return summary


def _ms(x):
    return None if x is None else round(x * 1000.0, 3)


def _r(x, nd=3):
    return None if x is None else round(x, nd)


def summarize(args, stats: Stats, *, cpu: dict | None, loadgen_cpu_s: float | None,
              model: str) -> dict:
    """The result as a flat, JSON-able dict."""
    duration = max(stats.t_end - stats.t_start, 1e-9)
    ttfts = sorted(stats.ttfts)
    gaps = sorted(stats.gaps)
    tokens = stats.tokens
    s: dict = {
        "endpoint": args.endpoint,
        "model": model,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests": stats.requests,
        "errors": stats.errors,
        "incomplete_streams": stats.incomplete,
        "duration_s": round(duration, 3),
        "delivered_tokens": tokens,
        "content_events": stats.content_events,
        "delivered_tokens_per_s": round(tokens / duration, 1),
        "offered_tokens_per_s": round(args.concurrency * 1000.0 / args.itl_ms, 1),
        "requests_per_s": round(stats.requests / duration, 2),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p90_ms": _ms(percentile(ttfts, 90)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "ttft_max_ms": _ms(ttfts[-1] if ttfts else None),
        "gap_p50_ms": _ms(percentile(gaps, 50)),
        "gap_p90_ms": _ms(percentile(gaps, 90)),
        "gap_p99_ms": _ms(percentile(gaps, 99)),
        "gap_max_ms": _ms(gaps[-1] if gaps else None),
        "gap_mean_ms": _ms(sum(gaps) / len(gaps) if gaps else None),
        "events_per_s": round(stats.content_events / duration, 1),
        "tokens_per_event": _r(tokens / stats.content_events if stats.content_events else None),
        "frontend_cpu_us_per_token": None,
        "worker_cpu_us_per_token": None,
        "frontend_cpu_percent": None,
        "worker_cpu_percent": None,
        "loadgen_cpu_percent": _r(None if loadgen_cpu_s is None
                                  else 100.0 * loadgen_cpu_s / duration, 1),
    }
    s["efficiency"] = _r(s["delivered_tokens_per_s"] / s["offered_tokens_per_s"]
                         if s["offered_tokens_per_s"] else None)
    if cpu is not None:
        fcpu = cpu["frontend_cpu_s"]
        wcpu = cpu["workers_cpu_s"]
        if fcpu is not None:
            s["frontend_cpu_percent"] = round(100.0 * fcpu / duration, 1)
            if tokens:
                s["frontend_cpu_us_per_token"] = round(1e6 * fcpu / tokens, 2)
        if wcpu is not None:
            s["worker_cpu_percent"] = round(100.0 * wcpu / duration, 1)
            if tokens:
                s["worker_cpu_us_per_token"] = round(1e6 * wcpu / tokens, 2)
        s["frontend_pid"] = cpu["frontend_pid"]
        s["frontend_cpu_s"] = _r(fcpu)
        s["workers"] = [
            dict(w, cpu_percent=round(100.0 * w["cpu_s"] / duration, 1)) for w in cpu["workers"]
        ]
        if cpu["lost_workers"]:
            s["lost_workers"] = cpu["lost_workers"]
    if stats.error_kinds:
        s["error_kinds"] = dict(stats.error_kinds)
        s["error_samples"] = stats.error_samples
    if stats.usage_missing and args.include_usage:
        s["usage_missing"] = stats.usage_missing
    s["http_statuses"] = {str(k): v for k, v in sorted(stats.statuses.items())}
    return s


def format_table(s: dict) -> str:
    def f(v, fmt="{:,.1f}"):
        return "-" if v is None else fmt.format(v)

    rows = [
        ("endpoint / model", f"{s['endpoint']} / {s['model']}"),
        ("concurrency", f"{s['concurrency']}  (prompt {s['prompt_tokens']} tokens, "
                        f"max_tokens {s['max_tokens']})"),
        ("requests", f"{s['requests']}  (errors {s['errors']}, incomplete streams "
                     f"{s['incomplete_streams']})"),
        ("duration", f"{f(s['duration_s'], '{:.2f}')} s  "
                     f"({f(s['requests_per_s'], '{:.1f}')} req/s)"),
        ("delivered tokens/s", f"{f(s['delivered_tokens_per_s'])}  (offered "
                               f"{f(s['offered_tokens_per_s'])}, efficiency "
                               f"{f(s['efficiency'], '{:.3f}')})"),
        ("content events/s", f"{f(s['events_per_s'])}  ({f(s['tokens_per_event'], '{:.3f}')} "
                             "tokens/event)"),
        ("TTFT ms  p50/p90/p99/max", " / ".join(f(s[k], "{:.1f}") for k in
                                                ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                                                 "ttft_max_ms"))),
        ("gap ms   p50/p90/p99/max", " / ".join(f(s[k], "{:.2f}") for k in
                                                ("gap_p50_ms", "gap_p90_ms", "gap_p99_ms",
                                                 "gap_max_ms"))),
        ("frontend CPU", f"{f(s['frontend_cpu_percent'])} %  "
                         f"({f(s['frontend_cpu_us_per_token'])} us/token)"),
        ("worker CPU (all)", f"{f(s['worker_cpu_percent'])} %  "
                             f"({f(s['worker_cpu_us_per_token'])} us/token)"),
    ]
    for w in s.get("workers", []):
        rows.append((f"  worker {w['pid']} ({w['comm']})",
                     f"{w['cpu_s']:.2f} s  ({w['cpu_percent']:.1f} %)"))
    rows.append(("loadgen CPU", f"{f(s['loadgen_cpu_percent'])} %"))
    if s.get("error_kinds"):
        rows.append(("error kinds", json.dumps(s["error_kinds"])))
        for sample in s.get("error_samples", []):
            rows.append(("  e.g.", sample[:160]))
    if s.get("aborted"):
        rows.append(("ABORTED", s["aborted"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def make_plot(path: str, stats: Stats, summary: dict) -> str | None:
    """Latency and throughput over time, as a PNG. Returns None (with a message) if
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("--plot: matplotlib is not installed; no plot written "
             "(pip install matplotlib to get one)")
        return None
    tl = stats.timeline or []
    t0 = stats.t_start
    span = max(stats.t_end - t0, 1e-9)
    nbins = max(1, min(200, int(span / 0.25) + 1))
    width = span / nbins
    tok_bins = [0.0] * nbins
    for start, end, _ttft, _gap, tokens, _err in tl:
        # spread a request's tokens uniformly over its lifetime
        a, b = start - t0, max(end - t0, start - t0 + 1e-9)
        ia, ib = int(a / width), min(int(b / width), nbins - 1)
        per_s = tokens / (b - a)
        for i in range(max(ia, 0), ib + 1):
            lo, hi = max(a, i * width), min(b, (i + 1) * width)
            if hi > lo:
                tok_bins[i] += per_s * (hi - lo) / width
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    xs = [r[0] - t0 for r in tl if r[2] is not None]
    axes[0].scatter(xs, [r[2] * 1000 for r in tl if r[2] is not None], s=4)
    axes[0].set_ylabel("TTFT (ms)")
    xs = [r[0] - t0 for r in tl if r[3] is not None]
    axes[1].scatter(xs, [r[3] * 1000 for r in tl if r[3] is not None], s=4, color="tab:orange")
    axes[1].set_ylabel("mean gap per request (ms)")
    axes[2].plot([(i + 0.5) * width for i in range(nbins)], tok_bins)
    axes[2].axhline(summary["offered_tokens_per_s"], ls="--", color="gray", label="offered")
    axes[2].set_ylabel("delivered tokens/s")
    axes[2].set_ylim(bottom=0)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[2].set_xlabel("time since start of run (s); points at request start")
    axes[2].legend()
    fig.suptitle(f"{summary['endpoint']} c={summary['concurrency']} "
                 f"prompt={summary['prompt_tokens']} max_tokens={summary['max_tokens']}: "
                 f"{summary['delivered_tokens_per_s']:,.0f} tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    _log(f"plot written to {path}")
    return path


# ============================================================================================
# Spawning the server
# ============================================================================================


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpawnedServer:
    """``python -m server --host 127.0.0.1 --port PORT ARGS``, output to a log file."""

    def __init__(self, extra_args: str, module: str, log_path: str | None) -> None:
        self.port = free_port()
        self.cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port",
                    str(self.port), *shlex.split(extra_args)]
        if log_path:
            self.log_path = log_path
            self._log_file = open(log_path, "wb")
        else:
            fd, self.log_path = tempfile.mkstemp(prefix="loadgen-server-", suffix=".log")
            self._log_file = os.fdopen(fd, "wb")
        _log(f"starting server: {shlex.join(self.cmd)}  (log: {self.log_path})")
        self.proc = subprocess.Popen(self.cmd, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_healthy(self, timeout: float) -> None:
        target = Target(self.url)
        deadline = trio.current_time() + timeout
        last = "no answer"
        while trio.current_time() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"server exited with status {code} before it was healthy")
            try:
                status, _ = await simple_get(target, "/health", timeout=2.0)
                if status == 200:
                    return
                last = f"GET /health returned {status}"
            except (OSError, ProtocolError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await trio.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout} s ({last})")

    def stop(self) -> int | None:
        """SIGINT, wait up to 10 s, then SIGKILL. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _log("server did not exit 10 s after SIGINT; sending SIGKILL")
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


# ============================================================================================
# Command line
# ============================================================================================


def _log(msg: str) -> None:
    print(f"loadgen: {msg}", file=sys.stderr, flush=True)


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return v


def _json_object(s: str) -> dict:
    try:
        v = json.loads(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one and the help text does not mention it."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen.py",
        description="Closed-loop streaming load generator for OpenAI-compatible servers on "
                    "this machine (loopback only). Prints a progress line (stderr), a summary "
                    "table and a final JSON line (stdout).",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument("--url", default="http://127.0.0.1:8000",
                   help="base URL of the server (loopback hosts only; '/v1' is added unless "
                        "the path already ends with it)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="POST /v1/completions or /v1/chat/completions")
    g.add_argument("--model", default=None,
                   help="model name (default: the first id of GET /v1/models, else 'sim')")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--spawn-server", metavar="ARGS", default=None,
                   help="start 'python -m server --host 127.0.0.1 --port FREE_PORT ARGS', wait "
                        "for GET /health to return 200, run the load against it (--url is "
                        "ignored), then stop it with SIGINT (SIGKILL after 10 s). Its CPU time "
                        "is measured (frontend = that process, workers = its descendants)")
    g.add_argument("--server-module", default="server",
                   help="module that --spawn-server runs with 'python -m'")
    g.add_argument("--server-log", default=None,
                   help="file for the spawned server's output (default: a temporary file)")
    g.add_argument("--health-timeout", type=_positive_float, default=60.0,
                   help="seconds to wait for the spawned server's GET /health to return 200")

    g = p.add_argument_group("load")
    g.add_argument("--concurrency", "-c", type=_positive_int, default=32,
                   help="number of clients, each sending requests back to back on its own "
                        "keep-alive connection")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--requests", "-n", type=_positive_int, default=None,
                   help="total measured requests (default 256 unless --duration is given)")
    m.add_argument("--duration", "-d", type=_positive_float, default=None,
                   help="seconds during which new requests are started; in-flight ones are "
                        "then allowed to finish")
    g.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of load before the measured run; they are discarded and "
                        "in-flight warmup requests finish before measuring starts")
    g.add_argument("--prompt-tokens", type=_positive_int, default=128,
                   help="prompt length in whitespace-separated words (the sim engine counts "
                        "one token per word; the first word is unique per request)")
    g.add_argument("--max-tokens", type=_positive_int, default=128,
                   help="max_tokens of each request (output length)")
    g.add_argument("--include-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="send stream_options.include_usage; delivered tokens come from the "
                        "usage chunk (else one token per content event)")
    g.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="JSON object merged into every request body, e.g. "
                        "'{\"temperature\": 0}'")
    g.add_argument("--itl-ms", type=_positive_float, default=8.0,
                   help="the engine's inter-token latency, only to compute "
                        "offered_tokens_per_s = concurrency * 1000 / itl_ms")

    g = p.add_argument_group("limits")
    g.add_argument("--request-timeout", type=_positive_float, default=120.0,
                   help="seconds a request may take in all before it counts as an error")
    g.add_argument("--time-limit", type=_positive_float, default=900.0,
                   help="hard limit on the measured run in seconds; in-flight requests are "
                        "cancelled and the result is marked aborted")
    g.add_argument("--max-requests", type=_positive_int, default=1_000_000,
                   help="upper bound on requests started by a --duration run or the warmup")
    g.add_argument("--max-errors", type=_positive_int, default=1000,
                   help="stop starting requests after this many errors")

    g = p.add_argument_group("CPU measurement")
    g.add_argument("--pid", type=int, action="append", default=None,
                   help="repeatable; the first is the frontend, the others its workers. With a "
                        "single --pid its descendant processes are taken as the workers")
    g.add_argument("--server-pids-from-port", action="store_true",
                   help="find the frontend as the process listening on the URL's port "
                        "(/proc/net/tcp + /proc/*/fd) and its workers as its descendants")

    g = p.add_argument_group("output")
    g.add_argument("--json-out", default=None, metavar="FILE",
                   help="also write the JSON summary (indented) to FILE")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot TTFT, per-request mean gap and throughput over time "
                        "(needs matplotlib; skipped with a message if missing)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests is None and args.duration is None:
        args.requests = 256
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    if args.spawn_server is None:
        try:
            check_loopback_url(args.url)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and args.concurrency + 64 > soft:
            want = args.concurrency + 64
            if hard == resource.RLIM_INFINITY or want <= hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            else:
                parser.error(f"--concurrency {args.concurrency} needs more open files than "
                             f"the limit of {hard}")
    except (ValueError, OSError):  # pragma: no cover
        pass
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    try:
        if args.spawn_server is not None:
            server = SpawnedServer(args.spawn_server, args.server_module, args.server_log)
            args.url = server.url
            args.pid = [server.proc.pid]
            try:
                trio.run(server.wait_healthy, args.health_timeout)
            except RuntimeError as exc:
                _log(f"spawned server failed: {exc}")
                tail = server.log_tail()
                if tail:
                    _log("last lines of its output:\n" + tail)
                return 2
        try:
            summary = trio.run(run_benchmark, args)
        except (ValueError, ConnectionError, OSError) as exc:
            _log(f"error: {exc}")
            return 2
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    finally:
        if server is not None:
            code = server.stop()
            _log(f"server stopped (exit status {code})")
    print(format_table(summary))
    line = json.dumps(summary, separators=(",", ":"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    print(line, flush=True)
    return 0 if summary["errors"] == 0 and summary["incomplete_streams"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
