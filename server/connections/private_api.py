"""Every private name of hypercorn and h11 that this server relies on, in one module.

Theory of operation
-------------------
The HTTP layer's direct path (:mod:`server.connections.accept`, :mod:`server.connections.connection`,
:mod:`server.connections.http11`, :mod:`server.connections.sink`) subclasses hypercorn's connection,
HTTP/1.1 protocol and request stream, and hooks into h11's reader and chunked writer. That
saves about 40 % of the frontend's CPU per streamed token (docs/benchmarks.md, "The HTTP
path: direct and fallback") and gives the server its connection limit, per-connection
error boundary, progress-bounded writes and request-head refusals. It also depends on
names the libraries may change in any release. So:

* **Only this module names them.** The classes of the other modules subclass the adapters
  below (:class:`ConnectionHooks`, :class:`H11Hooks`, :class:`HTTPStreamHooks`), which give
  the private hooks public names of ours, and import hypercorn's internal modules from here.
* **The exact versions are checked.** :data:`WRITTEN_FOR` names the versions this was
  written and tested against, and pyproject.toml pins them exactly. At
  :func:`use_direct_path`, a different installed version, or a name below that is missing,
  is an error at start (:class:`HTTPPathError`) unless the operator opted into serving
  through hypercorn's public :func:`hypercorn.trio.serve` instead
  (``server.connections.accept.serve_public``; ``--allow-http-fallback``), logged at every
  start with the reason and shown in ``/metrics`` (``trio_llm:http_fallback``). That path
  is slower and lacks what the direct path adds (see ``docs/operations.md``, "The HTTP
  path"), but it is hypercorn's own, correct code.
* **The fallback can be forced**, to test it: ``TRIO_LLM_HTTP_FALLBACK=1`` in the
  environment, or ``serve(..., direct_http=False)``. ``.ci/run`` runs the HTTP test files
  a second time with the variable set (docs/testing.md).

What is relied on, and why (every entry is checked by :func:`missing_names`, except the
behaviour in the last column, which the version check covers):

=============================================  ================================================
name                                           relied on for
=============================================  ================================================
hypercorn ``trio.run.worker_serve``            not used, replaced: ``accept.serve_app`` is its
(internals: ``Lifespan``, ``WorkerContext``,   loop with a per-connection boundary, a
``Config.create_sockets``, ``wrap_app``)       connection limit and a backlog; it builds the
                                               lifespan, the worker context and the sockets
                                               as ``worker_serve`` does
``trio.tcp_server.TCPServer`` (its             ``connection.ServingConnection``: direct writes
constructor, ``stream``, ``send_lock``,        under ``send_lock``, bounded writes;
``protocol``, ``idle_task``, ``context``)      ``protocol_send`` is the public hook it
                                               overrides
``TCPServer._read_data``                       the read loop, without a cancel scope per read
``TCPServer._close``                           closing, shielded
``TCPServer._idle_timeout``,                   the keep-alive timer: ``protocol_send``
``TCPServer._initiate_server_close``,          calls ``idle_task.restart(_task_group,
``TCPServer._task_group``                      _idle_timeout)`` and ``idle_task.stop()``;
                                               ours moves the read's deadline instead
                                               (``connection.KeepAliveTask``), and closes
                                               with ``_initiate_server_close``
``protocol.h11.H11Protocol`` (constructor,     ``protocol.ServingH11Protocol``: HTTP/1.1
``connection``, ``stream``, ``stream_send``,   only, strict heads, its own chunk framing;
``keep_alive_requests``)                       the response head built once, as
                                               ``stream_send`` builds it (``Connection:
                                               close`` at ``keep_alive_max_requests``)
``H11Protocol._create_stream``                 our request stream class, no WebSocket upgrade
``H11Protocol._check_protocol``                the request-head refusals (``framing``)
``H11Protocol._handle_events`` (not called:    a refusal from the head goes out before any
its order)                                     ``100 Continue``: it checks the head of a
                                               request as soon as h11 parses it, and sends
                                               ``100 Continue`` only at its next turn
``H11Protocol._send_error_response``,          answers to unparseable requests, with an
``H11Protocol._send_h11_event``                OpenAI-style body; every status line with
                                               its reason phrase (hypercorn sends none)
``protocol.http_stream.HTTPStream``            ``protocol.ServingHTTPStream``: body messages
(``app_send``, ``state``, ``response``,        straight to the protocol; ``app_put`` is set
``closed``, ``scope``, ``app_put``)            once the app task is spawned (the extension
                                               :data:`~server.connections.http11.DIRECT_BODY` is
                                               put in its scope then); its ``handle`` of
                                               ``StreamClosed`` (the client gone, or the
                                               response over) calls the route's
                                               ``DirectBody.on_disconnect``
hypercorn's ASGI ``receive`` is a Trio         ``asgi.read_body`` takes queued body messages
``MemoryReceiveChannel.receive``               without a scheduler trip (``receive.__self__``)
h11 ``_writers.ChunkedWriter``,                whether h11 chose chunked framing for the
``Connection._writer``                         response: only then are chunks framed here
``Connection._get_io_object``,                 the request-head reader, wrapped to refuse
``Connection._cstate``                         obs-fold before h11 unfolds it
``Connection._receive_buffer``                 dropping what a client sends after a request
                                               that closes the connection
``Connection`` (its                            a response head's framing headers set on the
``_clean_up_response_headers_for_sending``,    headers h11 validated when the event was made
``_request_method``, ``_cstate``); h11         (h11 validates every header again at each of
``_connection._body_framing``,                 its two or three edits there): h11's logic,
``_headers.get_comma_header``,                 the same bytes
``_headers.Headers._full_items``
=============================================  ================================================

quart-trio: nothing private (the engine runs in a nursery the app opens around Quart's
ASGI lifespan, not in ``QuartTrio.nursery``), so its version is not checked here.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os

import h11
import trio

from .framing import find_obs_fold, head_end, obs_fold

try:  # hypercorn's internal modules (names without an underscore, in undocumented modules)
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.events import Body, EndBody, Request, Response, StreamClosed
    from hypercorn.protocol.h11 import STREAM_ID, H11Protocol
    from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
    from hypercorn.trio.lifespan import Lifespan
    from hypercorn.trio.task_group import TaskGroup
    from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import parse_socket_addr, repr_socket_addr, suppress_body, wrap_app
except ImportError as exc:  # pragma: no cover - a hypercorn this was not written for
    _IMPORT_ERROR: str | None = f"hypercorn: {exc}"
    # Placeholders, so that the modules that subclass them still import; nothing of the
    # direct path runs (use_direct_path() is False).
    TCPServer = H11Protocol = HTTPStream = object  # type: ignore[misc,assignment]
    MAX_RECV = 2**16
    STREAM_ID = 1
    Closed = RawData = Body = EndBody = Request = Response = StreamClosed = None  # type: ignore[misc,assignment]
    Lifespan = TaskGroup = None  # type: ignore[misc,assignment]
    WorkerContext = ConnectionState = ASGIHTTPState = None  # type: ignore[misc,assignment]
    parse_socket_addr = repr_socket_addr = suppress_body = wrap_app = None  # type: ignore[assignment]
else:
    _IMPORT_ERROR = None

ChunkedWriter: type | None
try:
    from h11._writers import ChunkedWriter
except ImportError:  # pragma: no cover
    ChunkedWriter = None

try:  # h11's framing rules and header list, for StrictH11Connection's response heads
    from h11._connection import _body_framing
    from h11._headers import Headers, get_comma_header
except ImportError:  # pragma: no cover
    _body_framing = Headers = get_comma_header = None  # type: ignore[assignment,misc]

__all__ = [
    "FALLBACK_ENV",
    "WRITTEN_FOR",
    "ConnectionHooks",
    "H11Hooks",
    "HTTPPathError",
    "HTTPStreamHooks",
    "StrictH11Connection",
    "direct_path_problem",
    "missing_names",
    "queued_receive",
    "use_direct_path",
    "version_mismatch",
]

log = logging.getLogger("server.http")

#: The versions this module's names were written and tested against (pyproject.toml pins
#: the same ranges; the check here is exact).
WRITTEN_FOR = {"hypercorn": "0.18.0", "h11": "0.16.0"}

#: Set to ``1`` to serve through hypercorn's public ``serve()`` (tests of the fallback).
FALLBACK_ENV = "TRIO_LLM_HTTP_FALLBACK"


def version_mismatch(installed: dict[str, str | None], written_for=WRITTEN_FOR) -> str | None:
    """Why ``installed`` (package name to version, None: not installed) is not what the
    direct path was written for, or None. Sans-IO."""
    wrong = [
        f"{name} {installed.get(name) or 'not installed'} (written for {version})"
        for name, version in written_for.items()
        if installed.get(name) != version
    ]
    return ", ".join(wrong) or None


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_names() -> list[str]:
    """The private names of the table above that the installed libraries lack."""
    if _IMPORT_ERROR is not None:
        return [_IMPORT_ERROR]
    wanted = [
        (TCPServer, ("_read_data", "_close", "_idle_timeout", "_initiate_server_close",
                     "protocol_send")),
        (H11Protocol, ("_create_stream", "_check_protocol", "_send_error_response",
                       "_send_h11_event", "_handle_events", "stream_send", "handle")),
        (HTTPStream, ("app_send", "handle")),
        (h11.Connection, ("_get_io_object",)),
    ]
    missing = [
        f"{cls.__module__}.{cls.__qualname__}.{name}"
        for cls, names in wanted for name in names if not hasattr(cls, name)
    ]
    if ChunkedWriter is None:
        missing.append("h11._writers.ChunkedWriter")
    if _body_framing is None:
        missing.append("h11._connection._body_framing, h11._headers.Headers, get_comma_header")
    elif not hasattr(h11.Response(status_code=200, headers=[]).headers, "_full_items"):
        missing.append("h11._headers.Headers._full_items")
    if not hasattr(h11.Connection, "_clean_up_response_headers_for_sending"):
        missing.append("h11.Connection._clean_up_response_headers_for_sending")
    probe = h11.Connection(h11.SERVER)
    missing.extend(
        f"h11.Connection.{name}"
        for name in ("_cstate", "_writer", "_receive_buffer", "_request_method")
        if not hasattr(probe, name)
    )
    return missing


@functools.cache
def direct_path_problem() -> str | None:
    """Why the direct path cannot be used with the installed libraries, or None (checked
    once per process)."""
    problem = version_mismatch({name: _installed(name) for name in WRITTEN_FOR})
    missing = missing_names()
    if missing:
        problem = ", ".join(filter(None, [problem, "missing: " + ", ".join(missing)]))
    return problem


class HTTPPathError(Exception):
    """The direct HTTP path cannot be used with the installed libraries and the operator
    did not opt into the fallback: a deployment error, said in one line at start."""


def use_direct_path(direct: bool | None = None, *, allow_fallback: bool = False) -> bool:
    """Whether to serve through the direct path. ``direct``: None (the default) when the
    installed libraries allow it and :data:`FALLBACK_ENV` is not set; False forces the
    fallback; True requires the direct path (ValueError when it cannot be used).

    With ``direct`` None and libraries the direct path was not written for, the fallback is
    taken only when the operator opted in (``allow_fallback``: ``--allow-http-fallback``, or
    :data:`FALLBACK_ENV`); otherwise :class:`HTTPPathError`. A security property (the
    connection limit, bounded writes, the head checks) must not depend on which patch
    release pip picked. Every start that serves through the fallback says so in the log."""
    problem = direct_path_problem()
    if direct and problem is not None:
        raise ValueError(f"the direct HTTP path cannot be used: {problem}")
    if direct is None:
        forced = os.environ.get(FALLBACK_ENV, "") not in ("", "0")
        if problem is not None and not (forced or allow_fallback):
            raise HTTPPathError(
                f"the direct HTTP path cannot be used: {problem}; install the versions "
                f"pyproject.toml pins ({', '.join(f'{n}=={v}' for n, v in WRITTEN_FOR.items())}) "
                "or start with --allow-http-fallback (slower, and without the connection limit, "
                "bounded writes and request-head checks: docs/operations.md, 'The HTTP path')")
        direct = problem is None and not forced
        reason = f"{FALLBACK_ENV} is set" if forced else problem
    else:
        reason = "asked for (direct_http=False)"
    if not direct:
        log.warning(
            "serving HTTP through hypercorn's public serve() (%s): slower, and without the "
            "connection limit, bounded writes and request-head checks (docs/operations.md, "
            "'The HTTP path')", reason,
        )
    return direct


# -- the adapters: private hooks under public names ----------------------------------------


class ConnectionHooks(TCPServer):
    """Hypercorn's ``TCPServer``, whose private hooks call the public ones of a subclass:
    :meth:`read_requests`, :meth:`close_connection` (each upstream's own by default), and
    :attr:`task_group`, :meth:`initiate_server_close`. (Upstream's ``_idle_timeout`` is only
    handed to ``idle_task.restart``: ServingConnection's timer never runs it.)"""

    async def _read_data(self) -> None:
        await self.read_requests()

    async def _close(self) -> None:
        await self.close_connection()

    async def read_requests(self) -> None:
        await TCPServer._read_data(self)  # type: ignore[attr-defined]

    async def close_connection(self) -> None:
        await TCPServer._close(self)  # type: ignore[attr-defined]

    async def initiate_server_close(self) -> None:
        await self._initiate_server_close()  # type: ignore[attr-defined]

    @property
    def task_group(self):
        """The connection's task group (hypercorn hands it to the keep-alive timer, which
        upstream spawns there; ServingConnection's timer spawns nothing)."""
        return self._task_group  # type: ignore[attr-defined]

    @task_group.setter
    def task_group(self, value) -> None:
        self._task_group = value


class H11Hooks(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, whose private hooks call the public ones of a
    subclass: :meth:`create_stream`, :meth:`check_protocol`, :meth:`send_error_response`,
    :meth:`write_h11_event` (upstream's by default); :meth:`send_h11_event` and
    :meth:`chunked_body` for it to use."""

    async def _create_stream(self, request: h11.Request) -> None:
        await self.create_stream(request)

    async def _check_protocol(self, event: h11.Request) -> None:
        await self.check_protocol(event)

    async def _send_error_response(self, status_code: int) -> None:
        await self.send_error_response(status_code)

    async def create_stream(self, request: h11.Request) -> None:
        await H11Protocol._create_stream(self, request)  # type: ignore[attr-defined]

    async def check_protocol(self, event: h11.Request) -> None:
        await H11Protocol._check_protocol(self, event)  # type: ignore[attr-defined]

    async def send_error_response(self, status_code: int) -> None:
        await H11Protocol._send_error_response(self, status_code)  # type: ignore[attr-defined]

    async def _send_h11_event(self, event) -> None:
        await self.write_h11_event(event)

    async def send_h11_event(self, event) -> None:
        await self._send_h11_event(event)

    async def write_h11_event(self, event) -> None:
        """Every h11 event hypercorn's protocol sends passes here (upstream's by default)."""
        await H11Protocol._send_h11_event(self, event)  # type: ignore[attr-defined]

    def chunked_body(self) -> bool:
        """Whether h11 sends the response body in progress with chunked framing (its
        writer), so that chunks framed alike may bypass it."""
        connection = self.connection  # type: ignore[has-type]
        return ChunkedWriter is not None and (
            type(getattr(connection, "_writer", None)) is ChunkedWriter
            and connection.our_state is h11.SEND_BODY
        )


class HTTPStreamHooks(HTTPStream):
    """Hypercorn's ASGI request stream, with :meth:`app_spawned`."""

    def app_spawned(self) -> bool:
        """Whether the request's app task was spawned (hypercorn sets ``app_put`` then)."""
        return getattr(self, "app_put", None) is not None


def _read_head_strictly(reader, buf):
    """h11's reader of a request head, refusing obs-fold (see :mod:`server.connections.framing`).
    ``bytes(buf)`` is what h11 itself exposes as trailing data."""
    data = bytes(buf)
    end = head_end(data)
    if end != -1 and find_obs_fold(data[:end]):
        raise obs_fold()
    return reader(buf)


class StrictH11Connection(h11.Connection):
    """An h11 server connection whose request-head reader refuses folded header lines.

    It ignores what a client sends after a request that closes the connection
    (``Connection: close``, HTTP/1.0): that request is answered, then the connection
    closes, as nginx does. h11 would call the extra bytes an error, and the request would
    get a 400 instead of its answer."""

    def next_event(self):
        if self.their_state is h11.MUST_CLOSE:
            buffer = getattr(self, "_receive_buffer", None)
            if buffer is not None and len(buffer):
                self._receive_buffer = type(buffer)()
        return super().next_event()

    def _clean_up_response_headers_for_sending(self, response: h11.Response) -> h11.Response:
        """h11's own (h11 0.16), but each header edit reuses the headers h11 validated when
        the event was made. h11 validates the whole list again at every edit: two or
        three times a head, for headers that are already valid (docs/benchmarks.md, the
        burst). The edits add only constants and values read from those headers."""
        headers = response.headers
        need_close = False
        method = self._request_method  # (set: a server's response follows a request)
        framing_type, _ = _body_framing(
            b"GET" if method == b"HEAD" else method, response  # type: ignore[arg-type]
        )
        if framing_type in ("chunked", "http/1.0"):
            headers = _set_comma_header(headers, b"content-length", [])
            version = self.their_http_version
            if version is None or version < b"1.1":
                headers = _set_comma_header(headers, b"transfer-encoding", [])
                if method != b"HEAD":
                    need_close = True
            else:
                headers = _set_comma_header(headers, b"transfer-encoding", [b"chunked"])
        if not self._cstate.keep_alive or need_close:
            connection = set(get_comma_header(headers, b"connection"))
            connection.discard(b"keep-alive")
            connection.add(b"close")
            headers = _set_comma_header(headers, b"connection", sorted(connection))
        return h11.Response(
            headers=headers, status_code=response.status_code,
            http_version=response.http_version, reason=response.reason,
        )

    def _get_io_object(self, role, event, io_dict):
        io = super()._get_io_object(role, event, io_dict)  # type: ignore[misc]
        if io is not None and role is h11.CLIENT and self._cstate.states[role] is h11.IDLE:
            return functools.partial(_read_head_strictly, io)
        return io


def _set_comma_header(headers, name: bytes, values: list[bytes]):
    """h11's ``set_comma_header`` on headers it has validated: the other headers as they
    are, then ``name`` (title-cased, as h11 writes it) with each of ``values``, valid
    header values (constants, or parts of the values already there)."""
    items = [item for item in headers._full_items if item[1] != name]
    title = name.title()
    items.extend((title, name, value) for value in values)
    return Headers(items)


def queued_receive(receive):
    """The ``receive_nowait`` behind an ASGI ``receive`` that is hypercorn's (a Trio memory
    channel's ``receive``), to take queued messages without a scheduler trip; else None."""
    channel = getattr(receive, "__self__", None)
    if isinstance(channel, trio.MemoryReceiveChannel):
        return channel.receive_nowait
    return None
