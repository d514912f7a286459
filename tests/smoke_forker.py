"""Run Python scripts in forked children of one process that imported their heavy modules
once: ``python -m tests.smoke_forker MODULE ...``, driven by :class:`Forker`.

The bench smoke runs (tests/test_bench_smoke.py) each imported torch and transformers
again: about 3.5 s of CPU a script, most of its smoke run. Here the parent imports them
once, then forks a child per script. The child runs the script as ``python SCRIPT ARGS``
would: ``__main__``, ``sys.argv``, the script's folder first on ``sys.path``, stdin from
/dev/null, stdout and stderr to files, and an exit as the interpreter makes one.

A fork is safe only while the parent runs a single thread. NumPy's BLAS starts threads at
import, so the parent imports with ``OPENBLAS_NUM_THREADS=1`` and restores the variable
afterwards (its children's own subprocesses get the usual environment). Where a thread is
still there, or ``os.pidfd_open`` is missing, the parent says so and :class:`Forker`
runs each script as a plain subprocess instead.

The protocol is JSON lines. The parent first says ``{"fork": bool, "why": str}``; then for
each request (``script``, ``args``, ``cwd``, ``stdout``, ``stderr``, ``timeout``) it answers
``{"returncode": int, "timed_out": bool}`` once the child has ended. A child that outlives
its ``timeout`` is killed with its process group (a hang guard, not a measurement).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_BLAS_THREADS = "OPENBLAS_NUM_THREADS"


@dataclass
class Outcome:
    """How a script's run ended, and what it printed."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


def preload(modules: list[str]) -> str:
    """Import ``modules`` (those installed) with one BLAS thread; returns why a fork would
    be unsafe, or ``""``."""
    gc.disable()  # (until the fork: see main)
    before = os.environ.get(_BLAS_THREADS)
    os.environ[_BLAS_THREADS] = "1"
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # (an extra not installed: the scripts that need it are skipped)
    finally:
        if before is None:
            del os.environ[_BLAS_THREADS]
        else:
            os.environ[_BLAS_THREADS] = before
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is missing"
    threads = len(os.listdir("/proc/self/task"))
    return f"{threads} threads run after the imports" if threads != 1 else ""


def _run_child(request: dict) -> None:
    """In the forked child: become ``python SCRIPT ARGS``; never returns."""
    os.setpgid(0, 0)  # (the hang guard kills the script and its subprocesses together)
    gc.enable()
    for fd, path, flags in [(0, os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)]:
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exc:  # (what the interpreter makes of it at exit)
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    _exit(status)


def _exit(status: int) -> None:
    """End as the interpreter does (threads joined, atexit handlers run, output flushed),
    without its teardown of every module: that writes to each object the parent imported,
    copying all their pages (about 1.5 s a child here, more than the script's own work)."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def _serve(request: dict) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_child(request)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], request["timeout"])
    finally:
        os.close(pidfd)
    if not ready:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": not ready}


def main() -> None:
    why = preload(sys.argv[1:])
    # What the parent holds moves out of the collector's sight: a child's collections would
    # otherwise write to every object, copying the pages the fork shares.
    gc.freeze()
    print(json.dumps({"fork": not why, "why": why}), flush=True)
    if why:
        return
    for line in sys.stdin:
        print(json.dumps(_serve(json.loads(line))), flush=True)


class Forker:
    """The client: :meth:`run` a script in a forked child of a parent that imported
    ``modules``, or as a plain subprocess where the parent cannot fork safely. One run at a
    time; :meth:`close` ends the parent."""

    def __init__(self, modules: list[str], log: Path) -> None:
        self._log = log
        with log.open("wb") as err:
            self._proc = subprocess.Popen([sys.executable, "-m", "tests.smoke_forker", *modules],
                                          cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=err, text=True)
        hello = self._reply()
        #: Why scripts run as plain subprocesses (``""``: they are forked).
        self.why_not = hello["why"]

    def _reply(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            raise AssertionError(f"the forking parent exited ({self._proc.returncode}): "
                                 + self._log.read_text(errors="replace")[-4000:])
        return json.loads(line)

    def run(self, script: Path, args: list[str], *, cwd: Path, out_dir: Path,
            timeout: float) -> Outcome:
        """Run ``python script *args`` in ``cwd``, its stdout and stderr kept in ``out_dir``;
        killed (``timed_out``) after ``timeout`` seconds."""
        if self.why_not:
            try:
                proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd,
                                      capture_output=True, text=True, timeout=timeout,
                                      stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired as exc:
                return Outcome(-signal.SIGKILL, _text(exc.stdout), _text(exc.stderr), True)
            return Outcome(proc.returncode, proc.stdout, proc.stderr)
        stdout, stderr = out_dir / "stdout", out_dir / "stderr"
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({
            "script": str(script), "args": args, "cwd": str(cwd), "stdout": str(stdout),
            "stderr": str(stderr), "timeout": timeout}) + "\n")
        self._proc.stdin.flush()
        reply = self._reply()
        return Outcome(reply["returncode"], stdout.read_text(errors="replace"),
                       stderr.read_text(errors="replace"), reply["timed_out"])

    def close(self) -> None:
        """End the parent (it exits at the end of its input), bounded."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


if __name__ == "__main__":
    main()
