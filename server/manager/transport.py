"""How a :class:`~server.manager.worker.WorkerClient` reaches its worker: a *link* is one
session's byte streams to one worker, opened by spawning a process (``spawn``) or by
connecting to a worker that listens (``connect``, ``python -m server.workers --listen``).

Theory of operation
-------------------
A session (see :mod:`server.manager.worker`) does, whatever the transport::

    link = await open_spawned(...) or open_connected(...)   # SessionEnded if it cannot
    info = await link.handshake()      # until HELLO (bounded by the caller)
    ... router reads link.receive, writer writes link.send (or link.fd directly) ...
    await link.aclose()                # shielded by the caller; bounded here

*Spawned*: the process's stdout/stdin; the handshake waits for HELLO. Closing closes the
pipe, then sends SIGTERM, then SIGKILL, each after ``shutdown_grace`` (the worker exits
when its pipe closes). Then what is left of the worker's process group (it was started as
a group leader) gets SIGKILL. So the processes the worker started never outlive it, even
when it was SIGKILLed or they would not stop (vLLM's engine core process has no
parent-death handling of its own).

*Connected*: a TCP or unix socket, TLS when ``worker_tls_ca`` is set; the handshake is the
challenge-response of :mod:`server.worker_protocol.handshake`, then HELLO; closing closes
the socket at once (the worker aborts this connection's requests). A connected worker is
not ours to stop.
"""

from __future__ import annotations

import os
import signal
import ssl

import trio

from ..config import EngineConfig
from ..worker_protocol import handshake, wire
from ..worker_protocol.parts import PartsDecoder

__all__ = ["Link", "SessionEnded", "kill_group", "open_connected", "open_spawned"]


class SessionEnded(Exception):
    """The link cannot be opened or used any more; ``reason`` says why (for the log).
    ``refused``: the worker refused our credentials (a configuration error). ``cause``: the
    kind of end, for metrics (``exited``, ``disconnected``, ``hung``, ``protocol_error``).
    ``eof``: the worker ended the stream cleanly (not broken, hung or garbled)."""

    def __init__(self, reason: str, *, refused: bool = False, cause: str = "exited",
                 eof: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused
        self.cause = cause
        self.eof = eof


class Link:
    """One session's connection to a worker (see the module's docstring)."""

    #: Shown in logs: "pid 1234" or the worker's address.
    where: str
    #: The process id of a spawned worker (None when connected).
    pid: int | None = None
    #: A descriptor that :meth:`WorkerClient._send_nowait` may write to directly (a pipe or
    #: a plain socket), or None (TLS, in-memory test streams).
    fd: int | None = None
    #: What the router says when the stream ends, and its cause (see SessionEnded).
    eof_reason = "the worker process exited"
    eof_cause = "exited"
    #: After :meth:`aclose`: the signal a worker process that would not end by itself got
    #: (``"SIGTERM"``, ``"SIGKILL"``), or None.
    escalated: str | None = None
    #: After :meth:`aclose` of a worker process of ours: its exit status (None for a
    #: connection to a remote worker, which goes on running).
    returncode: int | None = None

    def __init__(self, send: trio.abc.SendStream, receive: trio.abc.ReceiveStream) -> None:
        self.send = send
        self.receive = receive
        #: Decodes the worker's frames; holds what arrived after HELLO.
        self.decoder = wire.FrameDecoder()

    async def _next_message(self, what: str, *kinds: int) -> list:
        """The next message, one of ``kinds`` in its shape (raises SessionEnded at end of
        stream, on garbage, or on any other message)."""
        while True:
            try:
                data = await self.receive.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise SessionEnded(f"connection broke during {what}: {exc}") from None
            if not data:
                raise SessionEnded(f"{self._ended_during} during {what}")
            try:
                messages = self.decoder.feed(data)
                if messages:
                    if len(messages) > 1:
                        raise wire.ProtocolError(f"sent {messages[1][0]!r} during {what}")
                    return wire.check(messages[0], kinds)
            except wire.ProtocolError as exc:
                raise SessionEnded(f"protocol violation: {exc}") from None

    _ended_during = "exited"

    async def handshake(self) -> dict:
        """Wait for HELLO; returns its info."""
        return (await self._next_message("startup", wire.HELLO))[1]

    async def aclose(self, grace: float) -> str:
        """Close the link; returns how it ended (for the log)."""
        raise NotImplementedError


class _SpawnedLink(Link):
    def __init__(self, proc) -> None:
        super().__init__(proc.stdin, proc.stdout)
        # A worker we spawn is asked for parts (server.config.EngineConfig.worker_argument):
        # its big answers come in PART frames, joined here.
        self.decoder = PartsDecoder()
        self.proc = proc
        self.pid = proc.pid
        self.where = f"pid {proc.pid}"
        fileno = getattr(proc.stdin, "fileno", None)  # None for in-memory test pipes
        self.fd = fileno() if fileno is not None else None

    async def aclose(self, grace: float) -> str:
        """Close the pipe, then SIGTERM, then SIGKILL, each after ``grace`` seconds
        (:attr:`escalated` says which signal it took)."""
        proc = self.proc
        try:
            await proc.stdin.aclose()
        except trio.BrokenResourceError:
            pass
        try:
            with trio.move_on_after(grace):
                self.returncode = await proc.wait()
                return f"exited with {self.returncode}"
            if proc.returncode is None:  # (not if it ended just now, by itself)
                self.escalated = "SIGTERM"
                proc.terminate()
            with trio.move_on_after(grace):
                self.returncode = await proc.wait()
                return f"exited with {self.returncode} after SIGTERM ({grace:g} s after " \
                    "its pipe closed)"
            self.escalated = "SIGKILL"
            proc.kill()
            self.returncode = await proc.wait()
            return f"exited with {self.returncode} after SIGKILL ({grace:g} s after SIGTERM)"
        finally:
            kill_group(self.pid)
            await proc.stdout.aclose()


def kill_group(pgid: int | None) -> None:
    """SIGKILL whatever is left in process group ``pgid`` (a worker's, after it exited).
    Linux reserves a pid while a process group of that id has members, so this reaches the
    worker's leftovers or no one."""
    if pgid is None or pgid <= 1:  # (not a process: an in-memory test worker)
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def open_spawned(config: EngineConfig, spawn) -> Link:
    """Start a worker process with ``spawn(config)`` (see :func:`spawn_process`)."""
    return _SpawnedLink(await spawn(config))


class _ConnectedLink(Link):
    eof_reason = "the worker closed the connection"
    eof_cause = "disconnected"
    _ended_during = "the worker closed the connection"

    def __init__(self, stream: trio.abc.HalfCloseableStream | trio.SSLStream, fd: int | None,
                 address: handshake.WorkerAddress, secret: bytes | None) -> None:
        super().__init__(stream, stream)
        # Joins PART frames once the session subscribed to them (wire.PARTS_TOPIC, when the
        # worker's HELLO offers them): until then, one is refused like any unasked frame.
        self.decoder = PartsDecoder(joining=False)
        self.stream = stream
        self.fd = fd
        self.where = str(address)
        self.secret = secret

    async def handshake(self) -> dict:
        msg = await self._next_message("the handshake", wire.CHALLENGE)
        if msg[1] != handshake.VERSION:
            raise SessionEnded(f"speaks handshake version {msg[1]!r}, not "
                               f"{handshake.VERSION}", refused=True)
        nonce, required = msg[2], msg[3]
        secret = self.secret
        if required and secret is None:
            raise SessionEnded(
                f"the worker requires a shared secret: set ${handshake.SECRET_ENV} or "
                "--worker-secret-file", refused=True,
            )
        cnonce = handshake.new_nonce()
        proof = None if secret is None else handshake.client_proof(secret, nonce, cnonce)
        try:
            await self.send.send_all(wire.encode([wire.AUTH, cnonce, proof]))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise SessionEnded(f"connection broke during the handshake: {exc}") from None
        # (a worker serving its --max-frontends already closes here, without REFUSED: we
        # retry it as any dropped connection)
        msg = await self._next_message(
            "the handshake, after our AUTH (as a worker at its --max-frontends does)",
            wire.HELLO, wire.REFUSED)
        if msg[0] == wire.REFUSED:
            raise SessionEnded(f"the worker refused us: {msg[1]:.200}", refused=True)
        if len(msg) != 3:
            raise SessionEnded("protocol violation: a HELLO without its proof item")
        if secret is not None and not handshake.verify(
            handshake.worker_proof(secret, nonce, cnonce), msg[2]
        ):
            raise SessionEnded(
                "the worker did not prove it knows the secret (it has another one, or "
                "none): not using it", refused=True,
            )
        return msg[1]

    async def aclose(self, grace: float) -> str:
        """Close the connection at once (TLS too: no close_notify to wait for on a link
        that may be down)."""
        await trio.aclose_forcefully(self.stream)
        return "closed"


def tls_context(ca_file: str) -> ssl.SSLContext:
    """A client context that trusts only ``ca_file`` and checks the worker's name."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def open_connected(config: EngineConfig, address: handshake.WorkerAddress,
                         tls: ssl.SSLContext | None) -> Link:
    """Connect to a listening worker (TLS with ``tls``); SessionEnded if it cannot, or if
    connecting takes longer than the heartbeat timeout (a host that drops packets would
    otherwise hold the session for the kernel's connect timeout, minutes)."""
    with trio.move_on_after(config.heartbeat_timeout):
        return await _connect(config, address, tls)
    raise SessionEnded(f"cannot connect: no answer within {config.heartbeat_timeout:g} s")


async def _connect(config: EngineConfig, address: handshake.WorkerAddress,
                   tls: ssl.SSLContext | None) -> Link:
    stream: trio.abc.HalfCloseableStream | trio.SSLStream
    try:
        if address.path is not None:
            stream = await trio.open_unix_socket(address.path)
        else:
            assert address.host is not None and address.port is not None
            stream = await trio.open_tcp_stream(address.host, address.port)
    except OSError as exc:
        raise SessionEnded(f"cannot connect: {exc.strerror or exc}") from None
    fd: int | None = stream.socket.fileno()
    if tls is not None:
        stream = trio.SSLStream(stream, tls, server_hostname=address.name or address.host)
        fd = None
        try:
            await stream.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            await trio.aclose_forcefully(stream)
            cause = exc.__cause__ or exc
            raise SessionEnded(f"TLS handshake failed: {cause}", refused=isinstance(
                cause, ssl.SSLCertVerificationError)) from None
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
    return _ConnectedLink(stream, fd, address, config.worker_secret)
