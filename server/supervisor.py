"""The supervisor of ``trio-llm-server --api-servers N`` (N > 1): the engine workers and N
frontend processes, all its children, accepting on one port. Linux only.

Theory of operation
-------------------
::

    supervisor (this process: no HTTP, no engine)
    ├── worker 0 (python -m server.workers --listen unix:DIR/worker-0.sock ...)
    ├── worker M-1
    ├── frontend 0 (python -m server --listen-fd FD --worker-address unix:... ...)
    └── frontend N-1          DIR: a private directory, mode 0700

1. The supervisor binds and listens on ``--host``/``--port`` itself (port 0: the port
   chosen is in its ``serving on`` line), with the server's socket options and
   ``--backlog``: one socket per frontend, all on the same port with ``SO_REUSEPORT``.
   Frontend *i* inherits socket *i*; the kernel spreads new connections over the sockets
   (one shared socket would give them all to whichever frontend wakes first). The
   supervisor keeps every socket open, so connections queued for a frontend that died
   are not refused: its successor takes them when it starts (after its backoff), and new
   connections keep being hashed to its socket meanwhile: a dead frontend delays its
   share of new connections by its restart time (docs/scaling.md).
2. It starts ``--engine-workers`` listening workers on unix sockets in ``DIR`` (no secret:
   the directory's mode is the access control). It waits until each listens (its socket
   file appears: a worker binds only once its engine is loaded). Then it starts the
   frontends, each given every worker's address, and waits until each answers on its
   private socket (:mod:`server.observability.group`). ``DIR`` is locked as long as the supervisor
   lives; at start, the directories of supervisors that were killed are removed
   (:mod:`server.private_dir`).
3. With ``--api-key-file``, the supervisor watches the files as each frontend does
   (:class:`~server.http.key_files.KeyFiles`), so it knows the files' keys in force. It
   hands them to each frontend it restarts, in the environment: a frontend whose file is
   refused when it starts serves with them rather than exit. A broken file and one crash
   would otherwise end the supervisor, and every frontend with it.
4. Supervision: a child that exits is restarted (:class:`~server.restarts.Restarts`:
   backoff from 0.1 s, doubling to 5 s), a worker on the same socket path, so that the
   frontends reconnect by themselves. A dead frontend's connections to the workers end,
   and the workers abort its requests; the other frontends are not touched. A child that
   cannot start the first time ends the supervisor with status 1 and one line. A worker
   that dies more than ``--max-restarts`` times within 60 s is over its budget. It is
   restarted every 5 s (one error line for the episode) until it stays up for 60 s, as a
   frontend retries a worker it spawned, while the frontends serve on the other workers.
   A frontend over its budget ends the supervisor with status 1: a frontend that keeps
   dying leaves its share of new connections waiting in its socket's queue, so better the
   orchestrator restarts the whole. A child the supervisor could not start for its own
   reasons (out of descriptors or memory: :func:`~server.restarts.starter_fault`) is
   retried without that counting against its budget.
5. SIGTERM/SIGINT: SIGTERM to every frontend (each drains with ``--shutdown-timeout`` as
   a server on its own does); once they are all gone, the workers get SIGTERM, then
   SIGKILL after a grace. A second signal is forwarded too (each frontend hurries).

No child outlives the supervisor. Each is started in its own process group (a Ctrl-C
reaches the supervisor only, which decides) with a parent-death signal (``prctl
PR_SET_PDEATHSIG``: SIGKILL when the supervisor dies, even of SIGKILL). Whatever is left
when the supervisor ends is killed, with what is left of its process group (what a worker
started: vLLM's engine core). Children are started from the Trio thread itself,
not with ``trio.lowlevel.open_process``: that forks from a worker thread, and the
parent-death signal fires when the *thread* that forked exits (Trio's idle threads do).
A child's exit is awaited on its pidfd.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from .cli_options import API_KEY_ENV, FRONTEND_FILE_KEYS_ENV, FRONTEND_KEYS_ENV
from .config import ServerConfig
from .connections.accept import ListenError, open_sockets
from .http.key_files import KeyFileError, KeyFiles
from .http.serve import hypercorn_config
from .observability.group import peer_socket
from .manager.transport import kill_group
from .private_dir import make_private_directory, remove_stale_directories
from .restarts import Restarts, starter_fault
from .supervisor_plan import Plan, plan

__all__ = ["supervise"]

log = logging.getLogger("server.supervisor")

_PR_SET_PDEATHSIG = 1
#: How long a frontend may take to answer on its private socket after it started.
_FRONTEND_STARTUP = 60.0
#: After SIGTERM, how long a worker (or a child, at a fatal end) has before SIGKILL.
_GRACE = 3.0


class Fatal(Exception):
    """A child could not start, or kept dying: the supervisor ends with status 1 (raised
    by :meth:`Supervisor.give_up`, which notes why)."""


class Child:
    """One child process, started from the calling (Trio) thread, with a pidfd."""

    def __init__(self, argv: list[str], *, pass_fds: tuple = (), env: dict | None = None) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getpid()

        def setup() -> None:  # in the child, between fork and exec
            os.setpgid(0, 0)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, pass_fds=pass_fds, env=env, preexec_fn=setup,
        )
        self.pid = self.popen.pid
        self.started = time.monotonic()
        self._pidfd = os.pidfd_open(self.pid)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        if self.popen.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
        return self.popen.wait()

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace``; waits for it. Shielded and bounded."""
        with trio.CancelScope(shield=True):
            self.signal(signal.SIGTERM)
            with trio.move_on_after(grace):
                await self.wait()
            if self.popen.poll() is None:
                self.popen.kill()
                await self.wait()
            kill_group(self.pid)  # what it started and left (vLLM's engine core)
            trio.lowlevel.notify_closing(self._pidfd)
            os.close(self._pidfd)


def describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


class Supervisor:
    def __init__(self, args: argparse.Namespace, config: ServerConfig, plan: Plan,
                 sockets: list[socket.socket], directory: str,
                 probe_sockets: list[socket.socket] | None = None,
                 key_files: KeyFiles | None = None) -> None:
        self.args = args
        self.config = config
        #: With --api-key-file: the files' keys in force, watched as a frontend watches
        #: them; handed to each restarted frontend.
        self.key_files = key_files
        self.plan = plan
        self.sockets = sockets
        #: With --health-port: one socket of the probe port per frontend (SO_REUSEPORT).
        self.probe_sockets = probe_sockets or []
        self.dir = directory
        self.stopping = trio.Event()
        self.frontends: dict[int, Child] = {}
        #: With --worker-address, the frontends connect to those workers: none is started.
        self.remote = bool(config.engine.worker_addresses)
        self.workers_paths = [] if self.remote else [
            os.path.join(directory, f"worker-{i}.sock") for i in range(args.engine_workers)
        ]
        self.worker_addresses = (
            [str(a) for a in config.engine.worker_addresses] if self.remote
            else [f"unix:{p}" for p in self.workers_paths]
        )
        #: While children start: the scope that a signal cancels.
        self._starting: trio.CancelScope | None = None
        #: Why the supervisor gives up (then its children are stopped at once).
        self.fatal: str | None = None

    def give_up(self, why: str) -> Fatal:
        if self.fatal is None:
            self.fatal = why
        return Fatal(why)

    async def run(self) -> None:
        args = self.args
        async with trio.open_nursery() as root:
            root.start_soon(self._watch_signals)
            if self.key_files is not None:
                await root.start(self.key_files.run)
            try:
                async with trio.open_nursery() as workers:
                    self._starting = workers.cancel_scope  # a signal now stops everything
                    await _start_all(workers, self._worker, len(self.workers_paths))
                    async with trio.open_nursery() as frontends:
                        await _start_all(frontends, self._frontend, args.api_servers)
                        self._starting = None
                        host, port = self.sockets[0].getsockname()[:2]
                        host = f"[{host}]" if ":" in host else host
                        log.info("serving on http://%s:%d (%d frontends, %d engine workers%s; "
                                 "private directory %s)", host, port, args.api_servers,
                                 len(self.worker_addresses), ", remote" if self.remote else "",
                                 self.dir)
                        if self.probe_sockets:
                            host, port = self.probe_sockets[0].getsockname()[:2]
                            host = f"[{host}]" if ":" in host else host
                            log.info("probes (/health, /ready) on http://%s:%d (every frontend)",
                                     host, port)
                    workers.cancel_scope.cancel()  # every frontend is gone: stop the workers
            except* Fatal:
                pass  # (self.fatal says why)
            root.cancel_scope.cancel()

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                log.info("%s: stopping %d frontend(s)%s", name, len(self.frontends),
                         ", hurrying" if self.stopping.is_set() else "")
                self.stopping.set()
                if self._starting is not None:
                    self._starting.cancel()
                for child in self.frontends.values():
                    child.signal(signal.SIGTERM)

    async def _worker(self, index: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        path = self.workers_paths[index]
        argv = self.plan.worker_argv(path)
        env = None
        devices = self.config.engine.for_worker(index).visible_devices()
        if devices is not None:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices}
        restarts = Restarts(self.args.max_restarts)
        first = True
        while True:
            try:
                os.unlink(path)  # a killed predecessor's
            except FileNotFoundError:
                pass
            child = await self._start(f"engine worker {index}", first, restarts, argv,
                                      env=env)
            if child is None:
                continue
            try:
                if not await self._until(lambda: os.path.exists(path), child,
                                         self.config.engine.startup_timeout):
                    why = describe(child.returncode) if child.returncode is not None \
                        else "not listening in time"
                    if first:
                        raise self.give_up(f"engine worker {index} could not start ({why})")
                else:
                    if first:
                        first = False
                        task_status.started()
                    code = await child.wait()
                    why = describe(code)
            finally:
                if child.returncode is None:  # we stop it (the end, or giving up)
                    await child.stop(_GRACE)
                    log.info("engine worker %d stopped (%s)", index, describe(child.popen.wait()))
                else:
                    await child.stop(_GRACE)  # (closes its pidfd)
            await self._restart_after(f"engine worker {index}", why, restarts, child)

    async def _frontend(self, index: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        fd = self.sockets[index].fileno()
        fds: tuple[int, ...] = (fd,)
        health_fd = None
        if self.probe_sockets:
            health_fd = self.probe_sockets[index].fileno()
            fds += (health_fd,)
        argv = self.plan.frontend_argv(index, fd, self.dir, self.worker_addresses, health_fd)
        path = peer_socket(self.dir, index)
        restarts = Restarts(self.args.max_restarts)
        first = True
        while not self.stopping.is_set():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            # A restart gets the files' keys in force now; a first start, none (a file
            # refused then stops the supervisor, as it stops a server on its own).
            handed = None if first or self.key_files is None else self.key_files.file_keys
            env = frontend_environment(self.config.api_keys, handed)
            child = await self._start(f"frontend {index}", first, restarts, argv,
                                      give_up=True, pass_fds=fds, env=env)
            if child is None:
                continue
            self.frontends[index] = child
            try:
                if self.stopping.is_set():  # a signal came while it started
                    child.signal(signal.SIGTERM)
                if not await self._until(lambda: _answers(path), child, _FRONTEND_STARTUP):
                    why = describe(child.returncode) if child.returncode is not None \
                        else "not serving in time"
                    if first and not self.stopping.is_set():
                        raise self.give_up(f"frontend {index} could not start ({why})")
                else:
                    if first:
                        first = False
                        task_status.started()
                    why = describe(await child.wait())
            finally:
                del self.frontends[index]
                # A frontend drains on SIGTERM (for --shutdown-timeout), unless we give up.
                drain = self.config.shutdown_timeout + 10.0
                await child.stop(_GRACE if self.fatal is not None else drain)
            if self.stopping.is_set():
                log.info("frontend %d stopped (%s)", index, why)
                break
            await self._restart_after(f"frontend {index}", why, restarts, child,
                                      give_up=True)
        if first:
            task_status.started()

    async def _start(self, name: str, first: bool, restarts: Restarts, argv: list[str], *,
                     give_up: bool = False, **options) -> Child | None:
        """Start child ``name``; None when that failed (logged), after its restart's wait
        (``give_up``: as :meth:`_restart_after`'s). A failure of the first start ends the
        supervisor; a later one for the supervisor's own reasons (out of descriptors,
        memory or processes) is not the child's fault: retried without counting against
        its budget."""
        try:
            return Child(argv, **options)
        except OSError as exc:
            if first:
                raise self.give_up(f"{name} could not be started: {exc}") from None
            why = f"could not be started ({exc})"
            if starter_fault(exc):
                why += ": the supervisor's own resources, not counted against its restarts"
            await self._restart_after(name, why, restarts, None,
                                      charged=not starter_fault(exc), give_up=give_up)
            return None

    async def _restart_after(self, name: str, why: str, restarts: Restarts,
                             child: Child | None, *, charged: bool = True,
                             give_up: bool = False) -> None:
        """Wait before child ``name`` is started again after it died (``why``), or could
        not be started (``child`` None). Over its budget: ``give_up`` ends the supervisor,
        else it is restarted at the capped backoff and that is logged once (the episode)."""
        now = time.monotonic()
        restart = restarts.died(now, now - child.started if child is not None else 0.0,
                                charged=charged)
        over = f"{name} died more than {restarts.limit} times within {restarts.window:.0f} s"
        if restart.over_budget_now and give_up:
            raise self.give_up(f"{over} (last: {why})")
        what = f"{name} (pid {child.pid}) exited ({why})" if child is not None \
            else f"{name} {why}"
        log.error("%s; restarting in %.1f s", what, restart.delay)
        if restart.over_budget_now:
            log.error("%s: restarting it every %.0f s until it stays up for %.0f s", over,
                      restart.delay, restarts.window)
        with trio.move_on_after(restart.delay):
            await self.stopping.wait()

    async def _until(self, ready, child: Child, timeout: float) -> bool:
        """Whether ``ready()`` came true before ``child`` exited (within ``timeout``)."""
        with trio.move_on_after(timeout):
            while child.returncode is None:
                if ready():
                    return True
                await trio.sleep(0.05)
        return False


async def _start_all(nursery: trio.Nursery, service, n: int) -> None:
    """Start ``service(i)`` for i < n in ``nursery``, all at once; return once each has
    called ``started()`` (an error in one ends the others)."""
    async with trio.open_nursery() as starting:
        for i in range(n):
            starting.start_soon(nursery.start, service, i)


def _answers(path: Path) -> bool:
    """Whether a frontend listens on its private socket (it then serves HTTP too)."""
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.setblocking(False)
        try:
            s.connect(os.fspath(path))
        except OSError:
            return False
    return True


def open_group_sockets(config: ServerConfig, n: int, port: int | None = None) -> list[socket.socket]:
    """``n`` listening sockets on the same address, in one SO_REUSEPORT group (the port of
    the first, when the port is 0), with the server's options and backlog; on
    ``config.port``, or on ``port`` (the probe port's group)."""
    if port is not None:
        config = dataclasses.replace(config, port=port, listen_fd=None)
    hc = hypercorn_config(config)
    hc.workers = n  # (hypercorn sets SO_REUSEPORT for several workers)
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            (sock,) = open_sockets(hc, config.backlog)
            sockets.append(sock)
            host = f"[{config.host}]" if ":" in config.host else config.host
            hc.bind = [f"{host}:{sock.getsockname()[1]}"]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def frontend_environment(keys: tuple[str, ...],
                         file_keys: tuple[str, ...] | None = None) -> dict[str, str]:
    """A frontend's environment: ours, with the API keys we read (from ``--api-key`` or
    the variable) in :data:`FRONTEND_KEYS_ENV`, one per line, and not the variable it
    would otherwise read. ``file_keys``, the key files' keys in force, go apart in
    :data:`FRONTEND_FILE_KEYS_ENV`: the frontend reads the files itself, and takes these
    only while a file is refused. So a key later removed from a file goes from every
    frontend."""
    ours = (API_KEY_ENV, FRONTEND_KEYS_ENV, FRONTEND_FILE_KEYS_ENV)
    env = {k: v for k, v in os.environ.items() if k not in ours}
    if keys:
        env[FRONTEND_KEYS_ENV] = "\n".join(keys)
    if file_keys is not None:
        env[FRONTEND_FILE_KEYS_ENV] = "\n".join(file_keys)
    return env


def supervise(args: argparse.Namespace, config: ServerConfig) -> int:
    """Run the supervisor until its frontends stopped (SIGTERM/SIGINT): the exit status."""
    from .cli import build_parser

    key_files = None
    if config.api_key_files:
        try:
            key_files = KeyFiles(config.api_keys, config.api_key_files,
                                 config.api_key_file_interval, logger=log)
        except KeyFileError as refused:  # (broken since the command line's check)
            print(f"trio-llm-server: {refused}", file=sys.stderr)
            return 1
    sockets: list[socket.socket] = []
    probe_sockets: list[socket.socket] = []
    what = f"cannot listen on {config.host}:{config.port}"
    try:
        sockets = open_group_sockets(config, args.api_servers)
        if config.health_port is not None:
            what = f"--health-port {config.health_port}: cannot listen on {config.host}"
            probe_sockets = open_group_sockets(config, args.api_servers, config.health_port)
    except (ListenError, OSError) as exc:
        for sock in sockets:
            sock.close()
        why = exc if isinstance(exc, ListenError) else f"{what}: {exc.strerror or exc}"
        print(f"trio-llm-server: {why}", file=sys.stderr)
        return 1
    removed = remove_stale_directories()
    if removed:
        log.info("removed %d private directories of killed supervisors: %s", len(removed),
                 " ".join(removed))
    try:
        directory, lock = make_private_directory()  # mode 0700
    except OSError as exc:  # e.g. a read-only root filesystem without a /tmp volume
        for sock in sockets + probe_sockets:
            sock.close()
        print(f"trio-llm-server: cannot create a private directory in "
              f"{tempfile.gettempdir()}: {exc} (set TMPDIR)", file=sys.stderr)
        return 1
    supervisor = Supervisor(args, config, plan(build_parser(), args), sockets, directory,
                            probe_sockets, key_files)
    try:
        trio.run(supervisor.run)
    finally:
        for sock in sockets + probe_sockets:
            sock.close()
        shutil.rmtree(directory, ignore_errors=True)
        os.close(lock)
    if supervisor.fatal is not None:
        print(f"trio-llm-server: {supervisor.fatal}", file=sys.stderr)
        return 1
    return 0
