"""Helpers for tests of remote workers: a listening worker as a real process
(``python -m server.workers --listen``), optionally inside a network namespace, and a
self-signed TLS certificate made with the openssl command.

``listening_worker(...)`` starts the worker, waits for its "listening on" line and yields a
:class:`Listening` (its address, process, and log); leaving the block stops it (SIGTERM,
then SIGKILL, bounded) and checks that it is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from server.protocol.handshake import SECRET_ENV, WorkerAddress, parse_address

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
):
    log = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "server.workers", "--listen", listen, *FAST_ARGS, *args]
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
        with trio.fail_after(20):
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
