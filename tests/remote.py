"""Helpers for tests of remote workers: a listening worker as a real process
(``python -m server.workers --listen``), optionally inside a network namespace, and a
self-signed TLS certificate made with the openssl command.

``listening_worker(...)`` starts the worker, waits for its "listening on" line and yields a
:class:`Listening` (its address, process, and log); leaving the block stops it (SIGTERM,
then SIGKILL, bounded) and checks that it is gone. A :class:`FrameProxy` between frontends
and a worker lets a test put frames of its own in the worker's stream.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from server.config import EngineConfig
from server.worker_protocol.handshake import SECRET_ENV, WorkerAddress, parse_address
from server.worker_protocol.wire import HELLO, FrameDecoder, ProtocolError, encode

ROOT = Path(__file__).resolve().parent.parent
SECRET = "correct horse battery staple 42"
FAST_ARGS = ["--sim-itl-ms", "2", "--sim-ttft-ms", "5", "--sim-prefill-us-per-token", "0"]


class Listening:
    def __init__(self, proc: trio.Process, log: Path) -> None:
        self.proc = proc
        self.log = log
        self.address: WorkerAddress | None = None

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def remote_config(*workers, secret: str | None = SECRET, **kw) -> EngineConfig:
    """An engine config for the listening ``workers`` (anything with an ``address``)."""
    kw.setdefault("shutdown_grace", 0.3)
    return EngineConfig(
        worker_addresses=tuple(w.address for w in workers), workers=len(workers),
        worker_secret=None if secret is None else secret.encode(), **kw,
    )


async def wait_until(predicate, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(secret: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if secret is not None:
        env[SECRET_ENV] = secret
    return env


@asynccontextmanager
async def listening_worker(
    tmp_path: Path,
    listen: str = "127.0.0.1:0",
    *args: str,
    secret: str | None = SECRET,
    netns: str | None = None,
    name: str = "worker",
    prefix: tuple[str, ...] = (),
    startup: float = 120.0,
):
    log = tmp_path / f"{name}.log"
    engine = args[args.index("--engine") + 1] if "--engine" in args else "sim"
    fast = FAST_ARGS if engine == "sim" else []  # (--sim-* with another engine is refused)
    cmd = [*prefix, sys.executable, "-m", "server.workers", "--listen", listen, *fast, *args]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    err = log.open("wb")  # noqa: ASYNC230 (a local file, before the process exists)
    try:
        proc = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            env=worker_env(secret), cwd=ROOT,
        )
    finally:
        err.close()
    worker = Listening(proc, log)
    try:
        with trio.fail_after(startup):  # a sim worker; one loading a model needs more
            while True:
                found = re.search(r"listening on (\S+)", worker.text())
                if found:
                    worker.address = parse_address(found.group(1))
                    break
                if proc.poll() is not None:
                    raise AssertionError(f"the worker exited: {worker.text()}")
                await trio.sleep(0.02)
        yield worker
    finally:
        with trio.CancelScope(shield=True):
            await stop(proc)


async def stop(proc: trio.Process) -> None:
    """SIGTERM, then SIGKILL after 5 s; waits for it."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def make_certificate(directory: Path, *names: str) -> tuple[Path, Path]:
    """A self-signed certificate (also its own CA) for ``names`` (IP addresses or DNS
    names), and its key, made by the openssl command."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    sans = ",".join(
        f"IP:{n}" if re.fullmatch(r"[\d.]+|[0-9a-f:]+", n) else f"DNS:{n}" for n in names
    )
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=trio-llm test worker",
         "-addext", f"subjectAltName={sans}", "-addext", "basicConstraints=critical,CA:TRUE",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


# -- a supervisor of several frontends (--api-servers) ---------------------------------------


class Supervised:
    """A running ``python -m server --api-servers N``: its process, URL, log, and its
    children as found in /proc (frontends by number, workers)."""

    def __init__(self, proc: trio.Process, log: Path) -> None:
        self.proc = proc
        self.log = log
        self.url = ""
        self.seen: set[int] = set()  # every child pid ever seen

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def children(self) -> tuple[dict[int, int], list[int]]:
        """``({frontend number: pid}, [worker pids])``, live ones."""
        from tests.conftest import children_of

        frontends, workers = {}, []
        for pid in children_of(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"server.workers" in argv:
                workers.append(pid)
            elif b"--frontend-index" in argv:
                frontends[int(argv[argv.index(b"--frontend-index") + 1])] = pid
        self.seen |= set(frontends.values()) | set(workers)
        return frontends, workers

    def directory(self) -> Path:
        found = re.search(r"private directory (\S+)\)", self.text())
        assert found, self.text()
        return Path(found.group(1))


@asynccontextmanager
async def supervised(tmp_path: Path, *args: str, frontends: int = 2, sim: bool = True,
                     secret: str | None = None):
    """The supervisor with ``frontends`` frontends on port 0 and the fast sim engine (unless
    ``sim`` is false: remote workers), up (its ``serving on`` line); killed, with anything
    left of its children, at the end."""
    from tests.conftest import pid_exists

    log = tmp_path / "supervisor.log"
    err = log.open("wb")  # noqa: ASYNC230 (a local file, before the process exists)
    try:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "server", "--api-servers", str(frontends), "--port", "0",
             *(FAST_ARGS if sim else ()), *args],
            stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=worker_env(secret), cwd=ROOT,
        )
    finally:
        err.close()
    sup = Supervised(proc, log)
    try:
        with trio.fail_after(120):  # (three processes start: slow on 2 busy cores)
            while not (found := re.search(r"server\.supervisor: serving on (\S+) \(", sup.text())):
                assert proc.poll() is None, sup.text()
                await trio.sleep(0.05)
        sup.url = found.group(1)
        sup.children()
        yield sup
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for pid in sup.seen:
                if pid_exists(pid):
                    os.kill(pid, signal.SIGKILL)
            found = (re.search(r"private directory (\S+)\)", sup.text())
                     or re.search(r"unix:(\S+)/worker-0\.sock", sup.text()))
            if found:  # (a SIGKILLed supervisor leaves its private directory behind)
                shutil.rmtree(found.group(1), ignore_errors=True)


async def local_metrics(directory: Path, index: int) -> dict[tuple, float]:
    """Frontend ``index``'s own metrics, read from its private socket:
    ``{(sample name, frozenset of labels): value}``."""

    stream = await trio.open_unix_socket(str(directory / f"frontend-{index}.sock"))
    async with stream:
        data = b""
        while chunk := await stream.receive_some(1 << 16):
            data += chunk
    return parse_samples(data.decode())


def parse_samples(text: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def worker_counts(path: Path) -> tuple[int, int]:
    """``(running, waiting)`` of the listening worker at ``path``, by its own count: a PING
    over a connection of our own."""
    from server import EngineConfig, open_engine

    config = EngineConfig(worker_addresses=(parse_address(f"unix:{path}"),),
                          shutdown_grace=0.3)
    async with open_engine(config) as engine:
        (counts,) = await engine.ping_all()
    return counts


# -- a proxy that slips frames of the test's between a worker's ------------------------------


class _Relay:
    """One frontend's connection through a :class:`FrameProxy`."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.lock = trio.Lock()  # one frame at a time toward the frontend


class FrameProxy:
    """A TCP proxy between frontends and the listening worker at ``upstream``: bytes pass
    through unchanged toward the worker; the worker's frames are passed on one at a time,
    so that :meth:`inject` can put a frame of the test's between two of them. ``current``:
    the newest connection whose HELLO went through (None while there is none)."""

    def __init__(self, upstream: WorkerAddress) -> None:
        self.upstream = upstream
        self.address: WorkerAddress | None = None
        self.current: _Relay | None = None
        self.connections = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.address = parse_address(f"127.0.0.1:{port}")
        task_status.started(self)
        await trio.serve_listeners(self._relay, listeners)

    async def inject(self, relay: _Relay, frame: bytes) -> None:
        """Send ``frame`` (bytes) to the frontend of ``relay``, between two worker frames."""
        async with relay.lock:
            await relay.stream.send_all(frame)

    async def _relay(self, down: trio.SocketStream) -> None:
        self.connections += 1
        relay = _Relay(down)
        try:
            up = await trio.open_tcp_stream(self.upstream.host, self.upstream.port)
        except OSError:
            await down.aclose()
            return
        broken = (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError)
        async with down, up, trio.open_nursery() as nursery:

            async def toward_worker() -> None:
                try:
                    while data := await down.receive_some(1 << 16):
                        await up.send_all(data)
                except broken:
                    pass
                nursery.cancel_scope.cancel()

            async def toward_frontend() -> None:
                decoder = FrameDecoder()
                try:
                    while data := await up.receive_some(1 << 16):
                        for message in decoder.feed(data):
                            async with relay.lock:
                                await down.send_all(encode(message))
                            if message[0] == HELLO:
                                self.current = relay
                except broken:
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(toward_worker)
            nursery.start_soon(toward_frontend)
        if self.current is relay:
            self.current = None
