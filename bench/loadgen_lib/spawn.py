"""``--spawn-server``: start the server on a free loopback port, wait until it is healthy,
stop it afterwards."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

from .report import log
from .target import GET_ERRORS, Target, simple_get

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup(cpus: frozenset[int] | None) -> None:
    """In the server's process, before it runs: die with this process (Linux
    ``PR_SET_PDEATHSIG``: SIGTERM, so that it stops its workers, if the benchmark is killed
    without a chance to stop it) and keep to ``cpus`` (inherited by its workers)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if cpus:
        os.sched_setaffinity(0, cpus)


class SpawnedServer:
    """``python -m server --host 127.0.0.1 --port PORT ARGS``, output to a log file; with
    ``cpus``, it (and the workers it starts) run on those CPUs only."""

    def __init__(self, extra_args: str, module: str, log_path: str | None,
                 cpus: frozenset[int] | None = None) -> None:
        self.port = free_port()
        self.cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port",
                    str(self.port), *shlex.split(extra_args)]
        if log_path:
            self.log_path = log_path
            self._log_file = open(log_path, "wb")
        else:
            fd, self.log_path = tempfile.mkstemp(prefix="loadgen-server-", suffix=".log")
            self._log_file = os.fdopen(fd, "wb")
        log(f"starting server: {shlex.join(self.cmd)}  (log: {self.log_path})")
        self.proc = subprocess.Popen(self.cmd, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: _child_setup(cpus))

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
            except GET_ERRORS as exc:
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
                log("server did not exit 10 s after SIGINT; sending SIGKILL")
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
