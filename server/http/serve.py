"""Serving the app over HTTP (server.connections.accept) with a graceful drain.

The shutdown begins when the caller's ``shutdown_trigger`` is set, or, when the CLI asks
for signal handling, at SIGTERM/SIGINT. Then, in order (see docs/operations.md):

1. The engine stops accepting (``/health`` and new requests get 503); requests in flight
   keep streaming for up to ``shutdown_timeout`` seconds.
2. Every stream still open is aborted: each open choice ends with
   ``finish_reason: "abort"`` and ``data: [DONE]`` (bounded by the engine's drain timeout).
3. The server stops listening and closes connections (``close_timeout``); the lifespan
   stops the workers (pipe closed, SIGTERM, SIGKILL, each after a grace period).

A second signal skips what is left of steps 1 and 2. If connections still do not close,
the workers are stopped anyway (and the CLI process exits). Cancelling the caller's scope
instead stops everything at once, workers included.
"""

from __future__ import annotations

import logging
import os
import signal
import socket

import trio
from trio_util import wait_any

from ..config import ServerConfig
from ..errors import printable
from ..observability.gcstats import freeze_after_startup
from ..observability.group import peer_socket, serve_peer_scrapes
from .app import LLMServerApp, create_app
from .upload import FORM_OVERHEAD
from ..connections.connection import ServingConfig, cut_stalled_writes
from ..connections.accept import ListenError, serve_app, serve_public
from ..connections.probes import serve_probes
from ..connections.private_api import use_direct_path

__all__ = ["ShutdownPhases", "serve", "hypercorn_config"]

log = logging.getLogger("server")


def hypercorn_config(config: ServerConfig) -> ServingConfig:
    """Hypercorn settings for ``config``: bind address, timeouts, no access log."""
    hc = ServingConfig()
    if config.listen_fd is not None:
        hc.bind = [f"fd://{config.listen_fd}"]
    else:
        host = f"[{config.host}]" if ":" in config.host else config.host
        hc.bind = [f"{host}:{config.port}"]
    hc.keep_alive_timeout = config.keep_alive_timeout
    # Not hypercorn's read_timeout: it bounds every read, also while a response streams and
    # the client rightly sends nothing. Idle connections (none sent yet, or between
    # requests) are closed by keep_alive_timeout; a slow body is bounded in read_body.
    hc.read_timeout = None
    # Read by connection.ServingConnection: a write that makes no progress for send_timeout
    # seconds closes the connection; none goes on past send_cutoff (set at shutdown).
    hc.send_timeout = config.send_timeout
    # Read by http11.ServingH11Protocol: a body announced over it with Expect: 100-continue
    # is a 413 from the head (framing.check_request_head), before any 100 Continue; for
    # an upload to the Files API, one over --max-file-bytes (and the form's heads).
    hc.max_body_bytes = config.max_body_bytes
    hc.upload_limits = {b"/v1/files": config.max_file_bytes + FORM_OVERHEAD}
    hc.include_server_header = False  # no banner naming the implementation
    hc.graceful_timeout = config.close_timeout
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def drain(app: LLMServerApp, timeout: float, *, hurry: trio.Event | None = None) -> None:
    """Stop accepting, let in-flight requests finish for ``timeout`` s (or until ``hurry``
    is set), then abort the rest (every model's engine at once)."""
    await app.stop_batches()  # (first: a drain waits for clients' requests, not batch lines)
    engines = app.models.engines()
    if not engines:
        return
    for engine in engines:
        engine.stop_accepting()
    open_now = sum(engine.statistics().open_streams for engine in engines)
    log.info("draining: %d request(s) in flight, up to %.1f s", open_now, timeout)

    async def all_idle() -> None:
        for engine in engines:
            await engine.wait_idle()

    waits = [all_idle] if hurry is None else [all_idle, hurry.wait]
    with trio.move_on_after(timeout):
        await wait_any(*waits)
    aborted = sum(engine.abort_all() for engine in engines)
    if aborted:
        log.info("draining: aborting %d request(s)", aborted)
        with trio.move_on_after(max(e.config.drain_timeout for e in engines) + 1.0):
            for engine in engines:
                await engine.wait_idle()


class ShutdownPhases:
    """The phases of a shutdown, as events, in the order they are set.

    ``begin``: stop accepting and drain (a first signal, the caller's trigger, or an engine
    that cannot start). ``hurry``: skip what is left of the drain (a second signal, or the
    drain's grace is over). ``stop_listening``: the HTTP server stops accepting and closes
    its connections.
    """

    __slots__ = ("begin", "hurry", "stop_listening")

    def __init__(self, begin: trio.Event | None = None) -> None:
        self.begin = begin if begin is not None else trio.Event()
        self.hurry = trio.Event()
        self.stop_listening = trio.Event()

    def signal(self, name: str) -> None:
        """A shutdown signal: the first begins the graceful drain, the second stops now."""
        if not self.begin.is_set():
            log.info("%s: shutting down gracefully", name)
            self.begin.set()
        else:
            log.warning("second signal: stopping now")
            self.hurry.set()
            self.stop_listening.set()


async def serve(
    config: ServerConfig,
    *,
    app: LLMServerApp | None = None,
    shutdown_trigger: trio.Event | None = None,
    handle_signals: bool = False,
    tune_gc: bool = False,
    gc_metrics: bool = False,
    wait_ready: bool = True,
    exit_when_stuck: bool = False,
    direct_http: bool | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``config`` until ``shutdown_trigger`` is set (or the caller's scope is
    cancelled), drained gracefully. Changes nothing process-wide unless asked.

    ``started(urls)`` reports the bound addresses, e.g. ``["http://127.0.0.1:8000"]``: with
    ``wait_ready`` (the default) once every engine worker has loaded its engine, so that
    requests are served at once; without it as soon as the server listens (it answers 503
    until the workers are up, which is what a process behind a readiness probe wants). An
    engine that cannot start raises :class:`~server.manager.worker.WorkerStartupError`; an
    error that ends the engine later (a bug: worker faults end only that worker's session)
    stops the server at once, and serve() raises it: a server without its engine could only
    answer 503.

    Options that reach beyond this server, for the CLI (or a program that wants them):

    * ``handle_signals`` takes SIGTERM/SIGINT for the graceful drain (a second signal stops
      at once);
    * ``tune_gc`` freezes what is alive after startup and raises the collector's thresholds
      for the whole process (``server.observability.gcstats``);
    * ``gc_metrics`` counts the collector's pauses for ``/metrics`` (a ``gc.callbacks``
      entry);
    * ``exit_when_stuck``: a shutdown that connections of clients that stopped reading would
      hold up forever ends the process (``os._exit(0)``) once the engine's workers are
      stopped.

    ``direct_http``: serve through this server's own HTTP/1.1 path (True) or hypercorn's
    public ``serve()`` (False); None (the default) takes the direct path when the installed
    hypercorn and h11 are the versions it was written for and ``TRIO_LLM_HTTP_FALLBACK`` is
    not set; with other versions it raises :class:`~server.connections.private_api.HTTPPathError`
    unless ``config.allow_http_fallback`` (:mod:`server.connections.private_api`).
    """
    app = app or create_app(config)
    if gc_metrics:
        app.metrics.watch_gc()
    hc = hypercorn_config(config)
    phases = ShutdownPhases(shutdown_trigger)
    direct = use_direct_path(direct_http, allow_fallback=config.allow_http_fallback)
    app.metrics.http_fallback = not direct

    async with trio.open_nursery() as nursery:

        async def run_http(*, task_status):
            if direct:
                await serve_app(
                    app,
                    hc,
                    backlog=config.backlog,
                    max_connections=config.max_connections,
                    shutdown_trigger=phases.stop_listening.wait,
                    on_pool=app.watch_connections,
                    task_status=task_status,
                )
            else:
                await serve_public(
                    app, hc, backlog=config.backlog, shutdown_trigger=phases.stop_listening.wait,
                    task_status=task_status,
                )
            nursery.cancel_scope.cancel()  # the other tasks only existed to end it

        if handle_signals:
            nursery.start_soon(_watch_signals, phases)
        nursery.start_soon(_shut_down, app, config, hc, phases, exit_when_stuck)
        nursery.start_soon(_stop_on_fatal, app, phases)
        binds = await nursery.start(run_http)
        if config.health_port is not None or config.health_listen_fd is not None:
            await nursery.start(_serve_probes, app, config)
        if config.frontend_dir is not None:  # one of --api-servers' frontends
            await nursery.start(
                serve_peer_scrapes,
                peer_socket(config.frontend_dir, config.frontend_index),
                app.metrics.local_exposition,
            )
        if wait_ready:  # (or until the engine fails, or the caller stops it meanwhile)
            await wait_any(app.wait_engine_ready, app.fatal.wait, phases.begin.wait)
        if not app.fatal.is_set():
            for url in binds:
                if config.models:
                    log.info("serving on %s (models %s)", url,  # (names escaped: a
                             ", ".join(printable(p.name) for p in app.models.pools))  # line each)
                else:
                    log.info("serving on %s (engine %s)", url, config.engine.engine)
            if tune_gc:
                freeze_after_startup()
            task_status.started(binds)
    if app.fatal_error is not None:
        raise app.fatal_error


async def _serve_probes(app: LLMServerApp, config: ServerConfig, *, task_status) -> None:
    """The probe port (``--health-port``), until the server's nursery ends."""
    port = config.health_port
    if config.health_listen_fd is not None:  # one of --api-servers' frontends
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=config.health_listen_fd))
        listeners = [trio.SocketListener(sock)]
    else:
        assert port is not None
        try:
            listeners = await trio.open_tcp_listeners(port, host=config.host)
        except OSError as exc:
            raise ListenError(f"--health-port {port}: cannot listen on {config.host}: "
                              f"{exc.strerror or exc}") from None
    try:
        for listener in listeners:
            host, port = listener.socket.getsockname()[:2]
            log.info("probes (/health, /ready) on http://%s:%d",
                     f"[{host}]" if ":" in host else host, port)
        await serve_probes(listeners, app.probe_answer, task_status=task_status)
    finally:
        for listener in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()


async def _watch_signals(phases: ShutdownPhases) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            phases.signal(signal.Signals(signum).name)


async def _stop_on_fatal(app: LLMServerApp, phases: ShutdownPhases) -> None:
    await app.fatal.wait()
    phases.hurry.set()
    phases.begin.set()


async def _shut_down(app, config: ServerConfig, hc, phases: ShutdownPhases, exit_when_stuck: bool):
    """Once begun: drain, stop listening, and stop the engine even if connections hang."""
    await phases.begin.wait()
    await drain(app, config.shutdown_timeout, hurry=phases.hurry)
    phases.stop_listening.set()
    cut_stalled_writes(hc, config.close_timeout)  # no client may hold the exit
    # The HTTP server now closes the connections (close_timeout) and runs the lifespan
    # shutdown, and this task is cancelled when it is done. Past a grace period (or at a
    # second signal), stop the engine ourselves.
    with trio.move_on_after(config.close_timeout + 5.0) as grace:
        await phases.hurry.wait()
    if grace.cancelled_caught:
        log.error("connections still open (clients not reading): stopping the engine anyway")
    else:
        log.info("stopping the engine now")
    await app.stop_engine()
    if exit_when_stuck:
        logging.shutdown()
        os._exit(1 if app.fatal_error is not None else 0)  # an engine that failed: 1
