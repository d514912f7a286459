"""The engine worker as a network service: ``python -m server.workers --listen ADDRESS``.
No trio here.

Several frontends (``trio-llm-server --worker-address ADDRESS``, or the processes of one
server) connect to one worker and share its engine. Each connection speaks the wire
protocol of the pipe worker (:mod:`server.workers.main`), after a handshake
(:mod:`server.worker_protocol.handshake`): the worker challenges, the frontend proves it knows the
shared secret, the worker answers HELLO (with its own proof) or REFUSED.

Theory of operation
-------------------
One thread, one loop, like the pipe worker, multiplexing sockets with :mod:`selectors`::

    wait for the listener, a connection or a finished preparation, at most until
    engine.next_deadline()
    accept new connections; read what the ready ones sent; handle complete messages
    admit the requests prepared meanwhile (server.workers.prepare)
    if the deadline has passed: outputs += engine.step(now)
    route every accept, note and output of this iteration to the connection that owns
    its request (a note of no request's, the engine's KV events, to every connection),
    one STEP frame per connection; send what each socket takes now

*Routed notices.* A SUBMIT may carry the prompt's block names (the frontend's routing
prediction, docs/routing.md). The worker strips them and passes them on, as the note
``[nil, {"routed": names}]`` of the next STEP, to every *other* connection subscribed to
the same topic (``[SUBSCRIBE, ["routed/N"]]``, N the version of the frontends' block
naming). So each frontend predicts what the others sent here. A connection's names are of
its topic's naming, and those of a connection that did not subscribe go nowhere. Only a
frontend that subscribed gets them (an older one would take the note for a protocol
violation), and only a worker shared by several frontends sends any. Notices are hints, and
one frontend's traffic must not get another dropped for not reading. So a connection is
given none while its output waiting exceeds a quarter of ``--max-buffer-bytes``, nor more
than :data:`_NOTICE_BYTES` of them per loop pass. The rest are skipped (counted, and logged
when the connection ends).

*Request ids.* Each connection has its own id space (the frontend's ``rid``); the engine
sees internal ids. ``owners`` maps an internal id to ``(connection, rid)`` and each
connection maps its rids to internal ids, until the request's terminal output.

*The connection is the unit of abort.* When a connection ends (closed, reset, a protocol
violation, a SHUTDOWN, silent for ``--frontend-timeout``, or not reading: more than
``--max-buffer-bytes`` of output waiting), every request it owns is aborted in the engine
at once; what the engine still reports for them is dropped.

*What a frontend may cost.* Its frames are read within bounds
(:mod:`server.worker_protocol.limits`):

- before it authenticated, 4 KiB a frame;
- after, SUBMIT and CALL up to 64 MiB and every other type 4 KiB, judged from a frame's
  first bytes;
- no frame decoded to more objects than a budget.

A request over the budget gets its own ``invalid_request`` error; anything else over a
bound ends the connection. Across connections:

- all of them together hold at most ``--max-total-buffer-bytes`` of unfinished frames and
  unsent output (past it, the one holding the most is dropped);
- at most ``--max-frontends`` connections are authenticated at once. One more is closed
  after its AUTH without REFUSED, which frontends take for a credential error: a full
  worker is one to retry;
- at most :data:`_MAX_UNAUTHENTICATED_CONNS` wait to authenticate (the oldest goes);
- the lines of connections that end before authenticating are throttled (one per
  :data:`_QUIET` seconds, the rest counted).

*Never blocked by a frontend.* Sockets are non-blocking; output a socket does not take is
kept in the connection's buffer (bounded, see above) and sent when it becomes writable.

*Big answers in parts.* A RESULT of ``wire.BIG_FRAME`` or more added whole to a
connection's output would hold every STEP behind it until the socket took it all. To a
connection that subscribed to ``wire.PARTS_TOPIC`` (the HELLO offers it: ``PARTS_KEY``) it
goes as PART frames (:mod:`server.worker_protocol.parts`): a pass's share is added after the
pass's STEP, once the socket has taken everything before it, and while parts wait the
connection is watched for writability, so the loop adds more as soon as it can take them.
(What the kernel's send buffer holds is not counted: on a slow network a STEP may still
wait behind that much of an answer, up to the buffer's size.)

*Busy is not hung.* Frontends must not take a worker making progress for hung. So while
one engine step, or a CALL answered on the loop (an embedding's forward, a LoRA load), runs
longer than a second, a thread beside the loop (:mod:`server.workers.pulse`) speaks for it.
It sends every ready connection an unasked PONG (sequence number 0; the counts of the last
PING answered) once the output waiting for it is sent. A frontend's silence is
checked after its socket was read, never right after a step; after a long read pass (its
pings arrived meanwhile) only if it has nothing waiting unread, so that back-to-back long
passes cannot keep a frontend that went silent.

*Told to stop* (SIGTERM: a Kubernetes scale-down), the worker leaves rather than stops
(:mod:`server.workers.leaving`): it tells the frontends that subscribed (LEAVING), takes
no new request, lets what runs finish within ``--shutdown-timeout``, closes its
connections and exits with status 0. A second SIGTERM stops it at once.

*A broken engine* (:class:`~server.workers.base.EngineBroken`) ends every connection's
requests with their errors, then the worker exits with status 3: run listening workers
under something that restarts them (systemd, Kubernetes, a supervisor); frontends
reconnect by themselves.
"""

from __future__ import annotations

import argparse
import itertools
import os
import selectors
import socket
import ssl
import stat
import sys
import time
import traceback

from ..engine_args import add_engine_arguments, engine_options
from ..option_bounds import COUNT, SECONDS, ZERO_OK
from ..option_table import Option, add_options, section
from ..worker_protocol import handshake, limits, wire
from ..worker_protocol.parts import PartQueue, is_big_answer
from ..worker_protocol.wire import OutputRow
from .base import EngineBroken, one_line
from .leaving import Leave
from .main import (
    build_engine, cleanup_begins, cleanup_uncut, close_before_exit, freeze_startup_heap,
    handle_in_pulse, handle_message, open_preparer, run_as_worker,
)
from .pulse import Pulse

#: What a listening worker takes from an authenticated frontend (wire.LISTENER_REQUESTS),
#: each message handed on as its list.
_REQUESTS = wire.LISTENER_REQUESTS.as_lists()

__all__ = ["main", "serve_listening", "open_listener"]

PROG = "trio-llm-server worker"

#: Largest frame before authentication (the AUTH message is ~100 bytes).
_MAX_UNAUTHENTICATED = 4096
#: Seconds a new connection has to finish TLS and authenticate.
_HANDSHAKE_TIMEOUT = 10.0
#: How often, at most, the loop wakes to check connection timeouts.
_HOUSEKEEPING = 0.5
#: After a read pass longer than this (a CALL answered on the loop: an embedding's
#: forward, a LoRA load), a connection with bytes waiting unread is not checked for silence:
#: its pings arrived meanwhile.
_LONG_ANSWER = 1.0
#: Connections that have not authenticated yet, at most (the oldest goes first): anyone who
#: can reach the port can open them, and each holds a descriptor until its handshake ends.
_MAX_UNAUTHENTICATED_CONNS = 64
#: After accept() failed (out of descriptors), seconds before accepting again.
_ACCEPT_PAUSE = 0.5
#: The most routed-notice bytes added to one connection's output per loop pass (the rest
#: are skipped: hints, not worth a slow loop or a frontend's buffer).
_NOTICE_BYTES = 1 << 20
#: Seconds between two lines about connections that ended before authenticating (anyone
#: who reaches the port can open thousands a second): the others are counted in the next.
_QUIET = 5.0


def say(message: str) -> None:
    """One line for the operator, on stderr."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class _Conn:
    """One frontend connection."""

    __slots__ = (
        "sock", "peer", "decoder", "out", "state", "nonce", "rids", "last_heard", "opened",
        "accepts", "outputs", "notes", "writing", "snapshot_due", "routed",
        "notice_bytes", "notices_skipped", "parts", "leaving", "told", "image_stats",
    )

    def __init__(self, sock: socket.socket, peer: str, state: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        #: (the handshake's limits until it authenticated: AUTH only, 4 KiB)
        self.decoder = wire.FrameDecoder(limits=limits.HANDSHAKE)
        self.out = bytearray()
        #: "tls" (TLS handshake), "auth" (challenged), "ready", "closing" (the worker left:
        #: its write side is shut, it waits for the frontend to close)
        self.state = state
        self.nonce = handshake.new_nonce()
        #: the frontend's rid -> the engine's id, for every request it owns
        self.rids: dict[int, int] = {}
        self.last_heard = now
        self.opened = now
        self.accepts: list = []
        self.outputs: list = []
        self.notes: list = []
        self.writing = False  # registered for EVENT_WRITE
        #: the KV cache's snapshot is owed (with the first STEP after its first message)
        self.snapshot_due = False
        #: the routed notices' topic it subscribed to (its block naming), or None
        self.routed: str | None = None
        #: bytes of routed notices queued for it in this loop pass (about)
        self.notice_bytes = 0
        #: routed notices not sent to it: its output was backed up, or the pass's share full
        self.notices_skipped = 0
        #: its big answers' parts yet to be added to ``out``, once it subscribed to them
        #: (wire.PARTS_TOPIC); None: big answers go whole
        self.parts: PartQueue | None = None
        #: it reads LEAVING (subscribed to wire.LEAVING_TOPIC), and was sent it
        self.leaving = False
        self.told = False
        #: its PONGs may hold the image-cache counters (subscribed to wire.IMAGE_STATS_TOPIC)
        self.image_stats = False

    def answer(self, frame: bytes) -> None:
        """A RESULT frame for this connection: in parts when it asked and the frame is
        big, else whole, after the output waiting."""
        if self.parts is not None and is_big_answer(frame):
            self.parts.add(frame)
        else:
            self.out += frame

    def parts_pending(self) -> bool:
        return self.parts is not None and self.parts.pending()

    def waiting(self) -> int:
        """Bytes of output waiting: in ``out``, and the parts not yet added to it."""
        return len(self.out) + (self.parts.queued_bytes() if self.parts is not None else 0)


class _Closed(Exception):
    """The connection must end (``reason`` for the log)."""


class _Throttled:
    """One kind of log line, at most once per ``interval`` seconds: the ones held back are
    counted, and told with the next line or by :meth:`flush` once the interval is over."""

    __slots__ = ("interval", "what", "until", "held")

    def __init__(self, interval: float, what: str) -> None:
        self.interval = interval
        self.what = what  # what the held lines were about, for the count
        self.until = 0.0
        self.held = 0

    def say(self, line: str, now: float) -> None:
        if now < self.until:
            self.held += 1
            return
        if self.held:
            line += f" (and {self.held} more {self.what} before it, not logged one by one)"
            self.held = 0
        say(line)
        self.until = now + self.interval

    def flush(self, now: float) -> None:
        if self.held and now >= self.until:
            say(f"{self.held} more {self.what} (not logged one by one: at most one line per "
                f"{self.interval:g} s)")
            self.held = 0
            self.until = now + self.interval


class Server:
    """The state of the loop; :func:`serve_listening` runs it."""

    def __init__(self, engine, listener: socket.socket, *, secret: bytes | None,
                 tls: ssl.SSLContext | None, frontend_timeout: float,
                 max_buffer: int, max_frontends: int = 64, max_total_buffer: int = 256 << 20,
                 pulse_period: float = 1.0, shutdown_timeout: float = 25.0) -> None:
        self.engine = engine
        self.listener = listener
        self.secret = secret
        self.tls = tls
        self.frontend_timeout = frontend_timeout
        self.max_buffer = max_buffer
        #: authenticated connections at most (--max-frontends)
        self.max_frontends = max_frontends
        #: bytes all connections may hold together, unfinished frames and unsent output
        #: (--max-total-buffer-bytes)
        self.max_total_buffer = max_total_buffer
        #: the lines of connections that end before authenticating
        self.unauthenticated = _Throttled(
            _QUIET, "connection(s) ended before authenticating")
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        #: the engine's preparation stage (server.workers.prepare), if it has one; its
        #: wake-up descriptor is registered with the connection ``self``
        self.preparer = open_preparer(engine)
        if self.preparer is not None:
            self.selector.register(self.preparer.fileno(), selectors.EVENT_READ, self)
        #: CALL requests being prepared: internal seq -> (connection, its seq)
        self.tokenizing: dict[int, tuple[_Conn, int]] = {}
        self.conns: set[_Conn] = set()
        #: accept() failed: not accepting until then (monotonic), or None
        self.accept_paused: float | None = None
        #: the engine's id -> (connection, its rid)
        self.owners: dict[int, tuple[_Conn, int]] = {}
        self._ids = itertools.count(1)
        # What this iteration's messages and step produced, in the engine's ids.
        self.accepts: list = []
        self.outputs: list = []
        #: running and waiting of the last PING answered (what the pulse repeats)
        self.counts = [0, 0]
        self.pulse = Pulse(self._pulse, pulse_period)
        #: SIGTERM's leave (server.workers.leaving); its wake-up descriptor is registered
        #: with the data ``leave``
        self.leave = Leave(shutdown_timeout)
        self.selector.register(self.leave.fileno(), selectors.EVENT_READ, self.leave)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        clock = time.monotonic
        engine = self.engine
        pulse = self.pulse
        pulse.start()
        leave = self.leave
        while True:
            if leave.asked and not leave.started:
                self._start_leave(clock())
            if leave.started and self._gone(clock()):
                return
            deadline = engine.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - clock())
            busy = self.conns or self.accept_paused is not None or self.unauthenticated.held
            if busy and (timeout is None or timeout > _HOUSEKEEPING):
                timeout = _HOUSEKEEPING
            events = self.selector.select(timeout)
            selected = clock()
            for key, mask in events:
                conn = key.data
                if conn is None:
                    self._accept()
                    continue
                if conn is self:  # a preparation finished: collected below
                    continue
                if conn is leave:  # SIGTERM: the leave starts at the top of the loop
                    leave.woken()
                    continue
                try:
                    if mask & selectors.EVENT_READ:
                        self._readable(conn)
                    if mask & selectors.EVENT_WRITE and conn in self.conns:
                        self._flush(conn)
                except _Closed as exc:
                    self._drop(conn, str(exc))
                except EngineBroken:
                    raise
                except Exception as exc:  # noqa: BLE001 - the per-connection boundary
                    # A bug of ours, met handling what one frontend sent, ends that
                    # connection, not the worker that other frontends share.
                    traceback.print_exc(file=sys.stderr)
                    self._drop(conn, f"internal error: {one_line(exc)}")
            if self.preparer is not None:
                self._collect()
            now = clock()
            # (after reading, not after a step; after a long read pass, not a frontend whose
            # pings arrived meanwhile and wait unread)
            self._expire(now, long_pass=now - selected >= _LONG_ANSWER)
            deadline = engine.next_deadline()
            now = clock()
            if deadline is not None and now >= deadline:
                broken = None
                pulse.enter()
                try:
                    self.outputs.extend(engine.step(now))
                except EngineBroken as exc:
                    broken = exc
                finally:
                    pulse.leave()
                if broken is not None:
                    self.outputs.extend(broken.outputs)
                    self._send_results()
                    raise broken
            self._send_results()
            self._hold_within_budget()

    # -- connections -------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: the connection waits in the backlog
                # The listener stays readable: without a pause the loop would spin.
                say(f"cannot accept a connection: {exc}; pausing accepts for "
                    f"{_ACCEPT_PAUSE:g} s")
                self.selector.unregister(self.listener)
                self.accept_paused = time.monotonic() + _ACCEPT_PAUSE
                return
            pending = [c for c in self.conns if c.state != "ready"]
            if len(pending) >= _MAX_UNAUTHENTICATED_CONNS:
                self._drop(min(pending, key=lambda c: c.opened),
                           "too many connections awaiting authentication")
            peer = _peer_name(addr)
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            state = "auth"
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True,
                                            do_handshake_on_connect=False)
                state = "tls"
            conn = _Conn(sock, peer, state, time.monotonic())
            self.conns.add(conn)
            self.selector.register(sock, selectors.EVENT_READ, conn)
            try:
                if state == "tls":
                    self._tls_handshake(conn)
                else:
                    self._challenge(conn)
            except _Closed as exc:
                self._drop(conn, str(exc))

    def _challenge(self, conn: _Conn) -> None:
        conn.state = "auth"
        message = [wire.CHALLENGE, handshake.VERSION, conn.nonce, self.secret is not None]
        conn.out += wire.encode(message)
        self._flush(conn)

    def _tls_handshake(self, conn: _Conn) -> None:
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want_write(conn, False)
            return
        except ssl.SSLWantWriteError:
            self._want_write(conn, True)
            return
        except (ssl.SSLError, OSError) as exc:
            raise _Closed(f"TLS handshake failed: {one_line(exc)}") from None
        self._want_write(conn, False)
        self._challenge(conn)

    def _readable(self, conn: _Conn) -> None:
        if conn.state == "tls":
            self._tls_handshake(conn)
            return
        if conn.state == "closing":  # (the worker left: what it sends is not read)
            self._receive(conn)
            return
        data = self._receive(conn)
        conn.last_heard = time.monotonic()
        try:
            messages = conn.decoder.feed(data)
            if conn.state == "auth":
                if not messages:
                    if conn.decoder.buffered > _MAX_UNAUTHENTICATED:
                        raise wire.ProtocolError("a large frame before authenticating")
                    return
                self._authenticate(conn, wire.check(messages[0], (wire.AUTH,)))
                # (frames that came with the AUTH were decoded before its reader was set)
                messages = [wire.check_listener_request(msg) for msg in messages[1:]]
            for msg in messages:
                self._handle(conn, msg)
            refused = conn.decoder.refused
            if refused:
                for request in refused:
                    self._refuse_request(conn, request)
                refused.clear()
        except wire.ProtocolError as exc:
            raise _Closed(f"protocol violation: {exc}") from None

    def _refuse_request(self, conn: _Conn, request: wire.Oversized) -> None:
        """A SUBMIT or CALL over the decoding limits (server.worker_protocol.limits):
        answered as that request's error, as the engine answers one it cannot take."""
        error = ["invalid_request", request.message]
        if request.kind == wire.SUBMIT:
            conn.outputs.append(OutputRow(request.ident, "", 0, "error", error))
        else:
            conn.answer(wire.encode([wire.RESULT, request.ident, None, error]))

    def _receive(self, conn: _Conn) -> bytes:
        """What the socket has (a TLS socket is read until its buffer is empty too, since
        the selector does not see bytes already decrypted)."""
        chunks: list[bytes] = []
        total = 0
        while total < 1 << 20:
            try:
                data = conn.sock.recv(1 << 18)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                break
            except ssl.SSLWantWriteError:  # renegotiation: rare; retried on the next read
                break
            except (ssl.SSLError, OSError) as exc:
                raise _Closed(f"connection broke: {one_line(exc)}") from None
            if not data:
                if chunks:
                    break
                raise _Closed("closed by the frontend")
            chunks.append(data)
            total += len(data)
            if not isinstance(conn.sock, ssl.SSLSocket):
                break
        return b"".join(chunks)

    def _authenticate(self, conn: _Conn, msg: list) -> None:
        """``msg``: a checked AUTH."""
        cnonce, proof = msg[1], msg[2]
        secret = self.secret
        if secret is not None:
            if proof is None:
                self._refuse(conn, "authentication failed: this worker requires a shared "
                             f"secret (${handshake.SECRET_ENV} or --worker-secret-file)")
            if not handshake.verify(handshake.client_proof(secret, conn.nonce, cnonce), proof):
                self._refuse(conn, "authentication failed: wrong secret")
        ready = sum(1 for c in self.conns if c.state == "ready")
        if ready >= self.max_frontends:
            # Closed without REFUSED: every frontend reads REFUSED as a credential error
            # (the first time, its server exits), but retries a dropped connection with
            # backoff, and a full worker is worth retrying (docs/protocol.md).
            raise _Closed(f"this worker serves {ready} frontends already "
                          f"(--max-frontends {self.max_frontends}): closed before HELLO, "
                          "the frontend retries")
        conn.state = "ready"
        conn.decoder.limits = limits.REQUESTS
        conn.decoder.reader = _REQUESTS
        mine = None if secret is None else handshake.worker_proof(secret, conn.nonce, cnonce)
        info = {**wire.hello_info(self.engine.info), wire.ROUTED_KEY: True,
                wire.PARTS_KEY: True, wire.LEAVING_KEY: True, wire.IMAGE_STATS_KEY: True}
        conn.out += wire.encode([wire.HELLO, info, mine])
        conn.snapshot_due = True
        say(f"frontend {conn.peer} connected")

    def _refuse(self, conn: _Conn, reason: str) -> None:
        conn.out += wire.encode([wire.REFUSED, reason])
        try:
            self._flush(conn)
        except _Closed:
            pass
        raise _Closed(f"refused: {reason}")

    def _handle(self, conn: _Conn, msg: list) -> None:
        """``msg``: a checked request (wire.LISTENER_REQUESTS, as a list)."""
        kind = msg[0]
        if conn.snapshot_due:
            # The blocks the engine holds now (the KV events from now on follow), with
            # the first STEP after the frontend's first message: never where the frontend
            # still reads its handshake (it takes nothing but HELLO there).
            conn.snapshot_due = False
            snapshot = getattr(self.engine, "kv_snapshot", None)
            note = snapshot() if snapshot is not None else None
            if note is not None:
                conn.notes.append(tuple(note))
        if kind == wire.SUBMIT:
            if conn.told:  # leaving: the frontend sends it to another worker
                conn.outputs.append(OutputRow(msg[1], "", 0, "error", [
                    wire.LEAVING_KIND, "this engine worker is stopping (SIGTERM)"]))
                return
            names = None
            if len(msg) == 6:  # the prompt's block names: for the other frontends
                names = msg.pop()
                if msg[4] is None:
                    msg.pop()
            rid = msg[1]
            if rid in conn.rids:
                conn.outputs.append(OutputRow(rid, "", 0, "error", [
                    "invalid_request", f"request id {rid} is already running"]))
                return
            if names and conn.routed is not None:
                self._notify_routed(conn, names)
            internal = next(self._ids)
            conn.rids[rid] = internal
            self.owners[internal] = (conn, rid)
            msg[1] = internal
            handle_message(self.engine, msg, self.accepts, self.outputs, self.preparer)
        elif kind == wire.ABORT:
            held = conn.rids.get(msg[1])
            if held is not None:
                handle_message(self.engine, [wire.ABORT, held], self.accepts, self.outputs,
                               self.preparer)
        elif kind == wire.PING or kind == wire.CALL:
            seq = msg[1]
            if kind == wire.CALL and self.preparer is not None:
                internal = next(self._ids)
                self.tokenizing[internal] = (conn, seq)
                msg = [kind, internal, *msg[2:]]
            reply = handle_in_pulse(self.pulse, self.engine, msg, self.accepts, self.outputs,
                                    self.preparer)
            if reply is None:  # answered by the preparer later: _collect
                return
            if kind == wire.PING:  # this connection's share, before the engine's stats
                self.counts = reply[2:4]
                reply.insert(4, len(conn.rids))
                reply = wire.pong_for(reply, conn.image_stats)
            else:
                self.tokenizing.pop(msg[1], None)
                reply[1] = seq
            conn.answer(wire.encode(reply))
        elif kind == wire.SUBSCRIBE:  # routed notices of one naming, parts
            for topic in msg[1]:
                if topic == wire.PARTS_TOPIC:
                    if conn.parts is None:
                        out = conn.out
                        conn.parts = PartQueue(out.extend)  # (`out` is never replaced)
                elif topic == wire.IMAGE_STATS_TOPIC:
                    conn.image_stats = True
                elif topic == wire.LEAVING_TOPIC:
                    conn.leaving = True
                    if self.leave.started:  # (it subscribed after the signal)
                        self._tell(conn, time.monotonic())
                else:
                    conn.routed = topic
        else:  # SHUTDOWN: one frontend does not stop a shared worker
            raise _Closed("the frontend said SHUTDOWN")

    def _notify_routed(self, sender: _Conn, names: list[bytes]) -> None:
        """``sender`` sent this worker a prompt of the blocks ``names``: tell every other
        connection subscribed to its topic (naming), with its next STEP (one note per prompt), unless its
        output is backed up (past a quarter of max_buffer, this note included) or it had
        :data:`_NOTICE_BYTES` of them in this pass already: then skipped."""
        note = (None, {"routed": names})
        topic = sender.routed
        size = 10 * len(names) + 16  # (encoded: 8-byte bins with their 2-byte headers)
        room = self.max_buffer // 4
        for conn in self.conns:
            if conn.routed == topic and conn is not sender and conn.state == "ready":
                queued = conn.notice_bytes + size
                if queued > _NOTICE_BYTES or conn.waiting() + queued > room:
                    conn.notices_skipped += 1
                    continue
                conn.notice_bytes = queued
                conn.notes.append(note)

    def _drop(self, conn: _Conn, reason: str) -> None:
        """End ``conn``: abort every request it owns, close the socket."""
        if conn not in self.conns:
            return
        self.conns.discard(conn)
        engine = self.engine
        preparer = self.preparer
        for internal in conn.rids.values():
            del self.owners[internal]
            if preparer is None or not preparer.abort(internal):
                engine.abort(internal)
        aborted = len(conn.rids)
        conn.rids.clear()
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.state in ("ready", "closing") or aborted:
            skipped = (f"; skipped {conn.notices_skipped} routed notice(s)"
                       if conn.notices_skipped else "")
            say(f"frontend {conn.peer} disconnected ({reason}); aborted {aborted} "
                f"request(s){skipped}")
        else:  # (throttled: anyone who reaches the port can open connections)
            self.unauthenticated.say(f"connection from {conn.peer} ended: {reason}",
                                     time.monotonic())

    def _hold_within_budget(self) -> None:
        """While all connections together hold more than ``max_total_buffer`` bytes
        (unfinished frames, unsent output and parts), drop the one that holds the most:
        each connection's own bounds (a frame's 64 MiB, --max-buffer-bytes) times the
        connections would be more than a worker should hold."""
        held = {conn: conn.decoder.buffered + conn.waiting() for conn in self.conns}
        total = sum(held.values())
        while total > self.max_total_buffer:
            conn = max(held, key=held.__getitem__)
            mine = held.pop(conn)
            self._drop(conn, f"over the worker's buffer budget: it held {mine} of the "
                       f"{total} bytes held (--max-total-buffer-bytes "
                       f"{self.max_total_buffer})")
            total -= mine

    def _collect(self) -> None:
        """Admit the requests prepared since the last iteration; route RESULT replies
        to their connections (a reply for a connection that ended is dropped)."""
        assert self.preparer is not None
        for reply in self.preparer.collect(self.accepts, self.outputs):
            owner = self.tokenizing.pop(reply[1], None)
            if owner is not None and owner[0] in self.conns:
                reply[1] = owner[1]
                owner[0].answer(wire.encode(reply))

    def _expire(self, now: float, *, long_pass: bool = False) -> None:
        """Resume accepting after a pause; drop the connections silent past their timeout
        (the handshake's, or --frontend-timeout). After a ``long_pass`` (a read pass of
        :data:`_LONG_ANSWER` or more) a ready connection with bytes waiting unread is not
        silent: they arrived during the pass and are read next. A connection that sent
        nothing is judged all the same, so back-to-back long passes cannot keep it forever;
        nor can a peer's dribbled bytes stretch its handshake's time."""
        if self.accept_paused is not None and now >= self.accept_paused:
            self.accept_paused = None
            self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.unauthenticated.flush(now)
        unread = self._unread() if long_pass else ()
        for conn in list(self.conns):
            if conn.state == "closing":  # (bounded by the leave: _gone)
                continue
            if conn.state != "ready":  # (a handshake's time runs, read or unread)
                if now - conn.opened > _HANDSHAKE_TIMEOUT:
                    self._drop(conn, "no authentication in time")
            elif conn not in unread and now - conn.last_heard > self.frontend_timeout:
                self._drop(conn, f"silent for {self.frontend_timeout:g} s")

    def _unread(self) -> set[_Conn]:
        """The connections with bytes waiting unread now (in the socket, or decrypted
        already in a TLS socket's buffer)."""
        unread = {
            key.data for key, mask in self.selector.select(0)
            if mask & selectors.EVENT_READ and isinstance(key.data, _Conn)
        }
        unread.update(conn for conn in self.conns
                      if isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending())
        return unread

    # -- output ------------------------------------------------------------------------------

    def _send_results(self) -> None:
        """Route this iteration's accepts, notes and outputs to their connections; one STEP
        frame each; send."""
        owners = self.owners
        for row in self.accepts:
            owner = owners.get(row[0])
            if owner is not None:
                owner[0].accepts.append((owner[1], row[1]))
        notes = getattr(self.engine, "notes", None)
        if notes:
            for rid, note in notes:
                if rid is None:  # the worker's own (KV events): every frontend's that
                    for conn in self.conns:  # has had its snapshot (see _handle)
                        if conn.state == "ready" and not conn.snapshot_due:
                            conn.notes.append((None, note))
                    continue
                owner = owners.get(rid)
                if owner is not None:
                    owner[0].notes.append((owner[1], note))
            notes.clear()
        for row in self.outputs:
            owner = owners.get(row[0])
            if owner is None:  # its connection ended (its abort) or no such request
                continue
            conn, rid = owner
            if row[3] is not None:
                del owners[row[0]]
                del conn.rids[rid]
            conn.outputs.append((rid, *row[1:]))
        self.accepts = []
        self.outputs = []
        for conn in list(self.conns):
            conn.notice_bytes = 0  # (a new pass)
            if conn.accepts or conn.outputs or conn.notes:
                message = [wire.STEP, conn.accepts, conn.outputs]
                if conn.notes:
                    message.append(conn.notes)
                    conn.notes = []
                conn.out += wire.encode(message)
                conn.accepts = []
                conn.outputs = []
            if conn.out or conn.parts_pending():
                try:
                    self._flush(conn, parts=True)
                except _Closed as exc:
                    self._drop(conn, str(exc))

    def _flush(self, conn: _Conn, *, parts: bool = False) -> None:
        """Send what the socket takes now; keep the rest (watching for writability). With
        ``parts`` (once per pass, after its STEP), once the socket took everything, the
        pass's share of a big answer's parts goes next: so a STEP waits behind one share
        at most here (and behind what the kernel's send buffer still holds), and while
        parts wait the loop is woken as soon as the socket can take more."""
        if conn.state == "tls":
            self._tls_handshake(conn)
            return
        out = conn.out
        self._send(conn)
        queue = conn.parts
        if parts and queue is not None and not out and queue.pending():
            queue.write_some(pile=None)
            self._send(conn)
        waiting = conn.waiting()
        if waiting > self.max_buffer:
            raise _Closed(f"not reading ({waiting} bytes of output waiting)")
        self._want_write(conn, bool(out) or conn.parts_pending())

    def _send(self, conn: _Conn) -> None:
        out = conn.out
        tls = isinstance(conn.sock, ssl.SSLSocket)
        while out:
            try:
                # a TLS write is retried with the same bytes: at most one record's worth
                sent = conn.sock.send(out[:16384] if tls else out)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError,
                    ssl.SSLWantReadError):
                break
            except (ssl.SSLError, OSError) as exc:
                raise _Closed(f"connection broke: {one_line(exc)}") from None
            del out[:sent]

    def _want_write(self, conn: _Conn, want: bool) -> None:
        if want != conn.writing:
            conn.writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self.selector.modify(conn.sock, events, conn)

    def _pulse(self) -> None:
        """In the pulse's thread, while the loop is in a long step: an unasked PONG to each
        ready connection, once the output waiting for it (a big frame the socket did not
        take at once) is sent; while some still waits, what the socket takes now is sent
        instead (any bytes are proof of life). Write interest is left to the loop."""
        for conn in list(self.conns):
            if conn.state != "ready":
                continue
            out = conn.out
            if out:
                tls = isinstance(conn.sock, ssl.SSLSocket)
                try:
                    while out:
                        # (a TLS write is retried with the same bytes: one record at most)
                        sent = conn.sock.send(out[:16384] if tls else out)
                        del out[:sent]
                except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError,
                        ssl.SSLWantReadError):
                    continue
                except (ssl.SSLError, OSError):  # the loop finds out after the step
                    continue
            frame = wire.encode([wire.PONG, 0, *self.counts, len(conn.rids)])
            try:
                sent = conn.sock.send(frame)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError,
                    ssl.SSLWantReadError):
                sent = 0
            except (ssl.SSLError, OSError):  # the loop finds out after the step
                continue
            if sent < len(frame):
                conn.out += frame[sent:]  # (sent after the step, or its end kept whole)

    def close(self) -> None:
        self.pulse.close()
        for conn in list(self.conns):
            self._drop(conn, "the worker is stopping")
        if self.preparer is not None:
            self.preparer.close()
        self.selector.close()
        self.leave.close()

    # -- leaving (SIGTERM: server.workers.leaving) -------------------------------------------

    def _start_leave(self, now: float) -> None:
        """Close the listener, drop the connections still in their handshake, and tell the
        others that read it (LEAVING): from now on, their SUBMITs are refused."""
        within = self.leave.start(now)
        if self.accept_paused is None:
            self.selector.unregister(self.listener)
        self.accept_paused = None
        self.listener.close()  # (a frontend that connects now is refused: it retries)
        told = 0
        for conn in list(self.conns):
            if conn.state != "ready":
                self._drop(conn, "the worker is stopping")
            elif conn.leaving:
                try:
                    self._tell(conn, now)
                except _Closed as exc:
                    self._drop(conn, str(exc))
                    continue
                told += 1
        say(f"stopping (SIGTERM): told {told} of {len(self.conns)} frontend(s); "
            f"{len(self.owners)} request(s) may finish within {within:g} s "
            "(--shutdown-timeout); a second SIGTERM stops at once")

    def _tell(self, conn: _Conn, now: float) -> None:
        """LEAVING to ``conn``, sent now (not after the loop's next wait: up to
        :data:`_HOUSEKEEPING` later), so its frontend stops sending SUBMITs here at once."""
        conn.told = True
        conn.out += wire.encode([wire.LEAVING, self.leave.left(now)])
        self._flush(conn)

    def _gone(self, now: float) -> bool:
        """Whether the leave is over (the loop returns). Once nothing runs and every answer
        is sent, or at the cut, each connection's write side is shut (what still runs is
        aborted first: its frontend moves it); then the frontends close, within a grace."""
        leave = self.leave
        if leave.closing_until is None:
            assert leave.until is not None
            self._close_untold()
            drained = not self.owners and not self.tokenizing and not any(
                conn.out or conn.parts_pending() for conn in self.conns)
            if not drained and now < leave.until:
                return False
            if not drained:
                say(f"--shutdown-timeout is over: cutting {len(self.owners)} request(s) "
                    "(their frontends move them)")
            for conn in list(self.conns):
                self._shut(conn)
            leave.close_soon(now)
        if self.conns and now < leave.closing_until:  # type: ignore[operator]
            return False
        say("stopped: every frontend was told" if not self.conns else
            f"stopped: {len(self.conns)} frontend(s) had not closed in time")
        return True

    def _close_untold(self) -> None:
        """Shut each connection that was not told (an older frontend: it did not subscribe
        to LEAVING) once its own requests are over and answered: it would send new ones
        until the cut. It finds the worker gone, as when a worker stopped at once."""
        busy = {conn for conn, _ in self.tokenizing.values()}
        for conn in list(self.conns):
            if (conn.state == "ready" and not conn.leaving and not conn.rids
                    and conn not in busy and not conn.out and not conn.parts_pending()):
                self._shut(conn)

    def _shut(self, conn: _Conn) -> None:
        """Abort what ``conn`` still runs, send what the socket takes, and shut its write
        side: the frontend reads to the end (its stream ends as planned), then closes."""
        engine = self.engine
        for internal in conn.rids.values():
            del self.owners[internal]
            if self.preparer is None or not self.preparer.abort(internal):
                engine.abort(internal)
        conn.rids.clear()
        try:
            self._send(conn)
            if isinstance(conn.sock, ssl.SSLSocket):
                _close_notify(conn.sock)
            conn.sock.shutdown(socket.SHUT_WR)
        except (_Closed, OSError) as exc:
            self._drop(conn, f"while the worker stopped: {one_line(exc)}")
            return
        conn.state = "closing"
        conn.out.clear()
        conn.parts = None
        self._want_write(conn, False)


def _close_notify(sock: ssl.SSLSocket) -> None:
    """TLS's end of data (close_notify), before the socket's write side is shut. Without
    it the frontend's TLS stream takes the end for a broken link, and the leave for a
    crash. The frontend's own close_notify is not awaited: it closes without one."""
    try:
        sock.unwrap()  # (sends ours, then finds the peer's missing: WantRead)
    except ssl.SSLError:  # (sent or not, the write side is shut next all the same)
        pass


def _peer_name(addr) -> str:
    if isinstance(addr, tuple):
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return "a local process"


def serve_listening(engine, listener: socket.socket, *, secret: bytes | None = None,
                    tls: ssl.SSLContext | None = None, frontend_timeout: float = 30.0,
                    max_buffer: int = 64 << 20, max_frontends: int = 64,
                    max_total_buffer: int = 256 << 20, shutdown_timeout: float = 25.0) -> None:
    """Serve ``engine`` to the frontends that connect to ``listener`` (a bound, listening
    socket), until SIGTERM's leave is over (server.workers.leaving), or EngineBroken, which
    propagates after the errors went out."""
    listener.setblocking(False)
    server = Server(engine, listener, secret=secret, tls=tls,
                    frontend_timeout=frontend_timeout, max_buffer=max_buffer,
                    max_frontends=max_frontends, max_total_buffer=max_total_buffer,
                    shutdown_timeout=shutdown_timeout)
    try:
        # (a second SIGTERM, or one after the leave: server.close and the engine's
        # cleanup run uncut)
        with server.leave.handling_sigterm(), cleanup_uncut():
            server.run()
            cleanup_begins()
    finally:
        server.close()


def open_listener(address: handshake.WorkerAddress, backlog: int = 128) -> socket.socket:
    """A listening socket on ``address``. A unix socket is created with mode 0600 (only
    this user may connect); a stale socket file (nobody listening) is replaced."""
    if address.path is not None:
        path = address.path
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                probe = socket.socket(socket.AF_UNIX)
                try:
                    probe.connect(path)
                except OSError:
                    os.unlink(path)  # stale: its worker is gone
                else:
                    raise OSError(f"{path}: another worker listens there")
                finally:
                    probe.close()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
    else:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    sock.listen(backlog)
    return sock


#: A listening worker's own options; the engine's follow (server.engine_args).
LISTEN_OPTIONS: tuple[Option, ...] = section(
    "listening",
    Option("--listen", required=True, metavar="ADDRESS",
           help="HOST:PORT, [IPV6]:PORT (port 0: any free port, printed) or unix:/path"),
    Option("--secret-file", metavar="PATH",
           help=f"the shared secret, in a file (default: ${handshake.SECRET_ENV}); "
           "required unless the address is loopback or a unix socket"),
    Option("--tls-cert", metavar="PATH",
           help="serve over TLS with this PEM certificate (chain)"),
    Option("--tls-key", metavar="PATH", help="the private key of --tls-cert (PEM)"),
    Option("--frontend-timeout", type=float, default=30.0, bounds=SECONDS,
           help="seconds a connected frontend may stay silent (frontends ping every "
           "second) before its connection is dropped and its requests aborted"),
    Option("--max-buffer-bytes", type=int, default=64 << 20, bounds=COUNT,
           help="output waiting for a frontend that does not read, beyond which its "
           "connection is dropped and its requests aborted"),
    Option("--max-frontends", type=int, default=64, bounds=COUNT,
           help="authenticated connections at most: one more is refused (REFUSED, "
           "and a line in the log)"),
    Option("--max-total-buffer-bytes", type=int, default=256 << 20, bounds=COUNT,
           help="bytes all connections may hold together (unfinished frames, unsent "
           "output); beyond it the connection holding the most is dropped and its "
           "requests aborted"),
    Option("--shutdown-timeout", type=float, default=25.0, bounds=ZERO_OK,
           help="on SIGTERM, seconds running requests may keep streaming (the frontends "
           "are told at once and send new ones elsewhere) before they are cut and move "
           "to other workers; then the worker exits 0. A second SIGTERM stops at once. "
           "Below Kubernetes' terminationGracePeriodSeconds (30 s by default)"),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of :data:`LISTEN_OPTIONS` and the engine's options."""
    p = argparse.ArgumentParser(
        prog="python -m server.workers",
        description="An engine worker that serves the wire protocol to frontends "
        "(trio-llm-server --worker-address) connecting over TCP or a unix socket. "
        "See docs/scaling.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_options(p, LISTEN_OPTIONS)
    add_engine_arguments(p, spawned=False)
    return p


def main(argv: list[str]) -> None:
    """``python -m server.workers --listen ...`` (SIGTERM: leave, then exit 0; a second
    SIGTERM: stop at once; SIGINT ignored)."""
    run_as_worker(_main, argv)


def _main(argv: list[str]) -> None:
    from ..config import EngineConfig

    args = build_parser().parse_args(argv)
    try:
        address = handshake.parse_address(args.listen)
        secret = handshake.read_secret(args.secret_file)
    except ValueError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None
    if secret is None and not address.loopback:
        raise SystemExit(
            f"{PROG}: --listen {address} is reachable from other machines: set a shared "
            f"secret (${handshake.SECRET_ENV} or --secret-file), or listen on loopback"
        )
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit(f"{PROG}: --tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert is not None:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            tls.load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise SystemExit(f"{PROG}: cannot load --tls-cert/--tls-key: {one_line(exc)}") from None
    options = engine_options(args, PROG)  # (names the model: args.served_model_name)
    config = EngineConfig(engine=args.engine, model=args.served_model_name,
                          engine_options=options)
    try:
        engine = build_engine(config.worker_argument())
    except Exception as exc:
        say(f"cannot start engine: {one_line(exc)}")
        raise SystemExit(2) from None
    freeze_startup_heap(engine)
    try:
        try:
            listener = open_listener(address)
        except OSError as exc:
            raise SystemExit(f"{PROG}: cannot listen on {address}: {exc}") from None
        try:
            where = listener.getsockname()
            shown = handshake.WorkerAddress(None, None, where) if address.path else \
                handshake.WorkerAddress(where[0], where[1], None)
            say(f"listening on {shown} ({'TLS' if tls else 'no TLS'}, "
                f"{'secret required' if secret else 'no secret'}, engine {args.engine})")
            serve_listening(engine, listener, secret=secret, tls=tls,
                            frontend_timeout=args.frontend_timeout,
                            max_buffer=args.max_buffer_bytes,
                            max_frontends=args.max_frontends,
                            max_total_buffer=args.max_total_buffer_bytes,
                            shutdown_timeout=args.shutdown_timeout)
        except EngineBroken as exc:
            say(f"engine failed, exiting: {exc.message}")
            raise SystemExit(3) from None
        finally:
            listener.close()
            if address.path is not None:
                try:
                    os.unlink(address.path)
                except OSError:
                    pass
    finally:
        close_before_exit(engine)
