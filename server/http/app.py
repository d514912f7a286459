"""The ASGI application: a Quart-Trio app whose POST routes run on raw ASGI.

``create_app(config)`` builds it. Every endpoint is a row of :mod:`server.http.routes`:
the POST routes (generation, embeddings, tokenize, LoRA, ``/invocations``; the hot path)
are served by :meth:`LLMServerApp.serve_route` before Quart sees the request, the small
GETs (``/health``, ``/metrics``, ``/v1/models``, ...) are registered with Quart. Quart also
runs the lifespan, in whose nursery the engine runs as a service. Every error, Quart's own
404 and 405 included, is answered with an OpenAI-style JSON body.

Before any route, :meth:`LLMServerApp.__call__` does what every HTTP request needs, in order:

1. the request id (``X-Request-Id``, or a new one) goes into the logging context, and onto
   the response's headers;
2. CORS, when enabled: a preflight is answered here; other responses get the CORS headers;
3. API keys, when configured: every path but ``/health``, ``/ready`` and ``/metrics`` needs
   ``Authorization: Bearer KEY`` (401 otherwise; see :mod:`server.http.auth`), checked
   against the keys in force (key files re-read when they change: :mod:`.key_files`);
4. a generation request gets a :class:`~server.observability.RequestRecord`, recorded in the
   metrics and logged in one line when it ends, whatever the outcome.

Embedding in a Trio program that already has an engine (or several, one per model)::

    app = create_app(ServerConfig(), engine=engine)   # the app will not start or stop it
    app = create_app(ServerConfig(), engines=[small, large])   # each config names its model

Several models (``ServerConfig.models``, or several engines) are several pools, each its own
engine; :mod:`server.http.models` resolves a request's ``model`` to its pool.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Sequence

import trio
from quart import Response
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..batches.service import BatchService
from ..config import ServerConfig
from ..errors import (
    ClientError,
    MethodNotAllowed,
    NotFound,
    ServerError,
    ServiceUnavailable,
    Unauthorized,
    error_body,
    error_headers,
)
from ..manager.engine import Engine, run_engine
from ..media import MediaFetcher, policy_from_config
from ..manager.worker import WorkerStartupError
from ..observability import Metrics, request_id_from_header
from ..observability.logs import request_id_var
from ..observability.batch_metrics import BatchCollector
from ..observability.state_metrics import StateStoreCollector
from ..observability.tracing import Tracing
from ..state import StateStore, StateStoreError
from ..state.service import StateService, in_virtual_time, state_config
from .asgi import CLOSE, HeaderSend, header, send_empty, send_error
from .auth import APIKeys, is_protected
from .cors import CORSPolicy
from .key_files import KeyFiles
from ..observability.key_metrics import KeyFileCollector
from ..openai.encode import dumps
from ..connections.accept import connection_info
from .models import ModelTable, Pool
from .responses_background import BackgroundCollector, BackgroundResponses, BackgroundService
from .routes import quart_routes, raw_routes

__all__ = ["LLMServerApp", "create_app"]

log = logging.getLogger("server.http")

_WWW_AUTHENTICATE = [(b"www-authenticate", b"Bearer")]


class OriginNotAllowed(ClientError):
    """A CORS preflight from an origin that is not in ``--allowed-origins``."""

    status = 403
    code = "origin_not_allowed"


def _json_error(exc: ServerError) -> Response:
    response = Response(dumps(error_body(exc)), status=exc.status, content_type="application/json")
    for name, value in error_headers(exc):
        response.headers[name.decode()] = value.decode()
    return response


def _status_body(status: str, models: dict | None) -> dict:
    """``{"status": ...}``, and each model's when several are served."""
    return {"status": status} if models is None else {"status": status, "models": models}


def _has_body(scope: dict) -> bool:
    """Whether the request declares a body (a non-zero Content-Length, or chunked)."""
    length = header(scope, b"content-length")
    if length is not None:
        return length.strip() not in (b"", b"0")
    return header(scope, b"transfer-encoding") is not None


class LLMServerApp(QuartTrio):
    """The server's ASGI app. ``engine`` is None until the lifespan has started it."""

    def __init__(
        self, config: ServerConfig, *, engine: Engine | None = None, tracer_provider=None,
        engines: Sequence[Engine] = (),
    ) -> None:
        super().__init__("trio_llm_server")
        self.server_config = config
        if engine is not None:
            if engines:
                raise ValueError("create_app: 'engine' or 'engines', not both")
            engines = (engine,)
        #: The served models, each a pool with its engine (server.http.models).
        self.models = ModelTable(config, engines)
        self.started_at = time.time()
        self._owns_engine = not engines
        self._engine_shutdown = trio.Event()
        self._engine_started = trio.Event()
        self._engine_stopped = trio.Event()
        self._engine_nursery: trio.Nursery | None = None
        #: Set (with ``fatal_error``) when the engine cannot start, or stopped by an error:
        #: serve() then stops, and raises it.
        self.fatal = trio.Event()
        self.fatal_error: BaseException | None = None
        #: The keys of ``--api-key-file``, kept current (server.http.key_files); None
        #: without files: then the fixed keys alone, or none needed.
        self.key_files: KeyFiles | None = None
        self._fixed_keys = APIKeys(config.api_keys) if config.api_keys else None
        if config.api_key_files:
            self.key_files = KeyFiles(config.api_keys, config.api_key_files,
                                      config.api_key_file_interval,
                                      handed=config.api_key_files_handed)
        self.cors = CORSPolicy(config.allowed_origins) if config.allowed_origins else None
        #: The HTTP server's :class:`~server.connections.accept.ConnectionPool` while it serves.
        self.connections = None
        #: The ``/metrics`` families, in a registry of this app's own.
        self.metrics = Metrics(
            lambda: [(p.name, p.engine) for p in self.models.pools],
            more_models=[p.name for p in self.models.pools[1:]],
        )
        #: The state store (server.state: stored responses, files), open for the server's
        #: lifetime in the lifespan's nursery: ``state_store``.
        self.state = StateService(state_config(config))
        #: Background responses (server.http.responses_background): ``background``.
        self._background = BackgroundService(self)
        #: The Batch API's runner (server.batches): ``batches``.
        self._batches = BatchService(self)
        self.metrics.registry.register(BackgroundCollector(self._background,
                                                           self.models.pools[0].name))
        self.metrics.registry.register(BatchCollector(
            lambda: None if self.batches is None else self.batches.statistics(),
            self.models.pools[0].name))
        self.metrics.registry.register(StateStoreCollector(
            lambda: None if self.state.store is None else self.state.store.statistics(),
            self.models.pools[0].name))
        if self.key_files is not None:
            self.metrics.registry.register(KeyFileCollector(self.key_files.reloads,
                                                            self.models.pools[0].name))
        #: A span per generation request (OpenTelemetry), when asked; else None.
        self.tracing: Tracing | None = None
        if tracer_provider is not None:
            self.tracing = Tracing(tracer_provider)
        elif config.otlp_traces_endpoint:
            self.tracing = Tracing.from_endpoint(config.otlp_traces_endpoint)
        #: The image fetcher of every request's image URLs (server.media, docs/media.md).
        self.media = MediaFetcher(policy_from_config(config))
        #: Path -> the raw routes this app serves (server.http.routes).
        self.raw_routes = raw_routes(config)
        self._routes()

    @property
    def api_keys(self) -> APIKeys | None:
        """The keys a request is checked against now; None when none is needed. A key
        file's change replaces them (server.http.key_files): read it per request."""
        return self.key_files.api_keys if self.key_files is not None else self._fixed_keys

    @property
    def accepted_keys(self) -> tuple[str, ...]:
        """The keys themselves that :attr:`api_keys` accepts now (the batch runner sends
        its batch owner's)."""
        return self.key_files.keys if self.key_files is not None \
            else self.server_config.api_keys

    @property
    def engine(self) -> Engine | None:
        """The engine of the (first) model, None until the lifespan has started it."""
        return self.models.default.engine

    @property
    def state_store(self) -> StateStore | None:
        """The state store while the server serves (docs/state.md); else None."""
        return self.state.store

    @property
    def background(self) -> BackgroundResponses | None:
        """The background responses' service while the server serves with a store."""
        return self._background.responses

    @property
    def batches(self):
        """The batch runner (server.batches.BatchRunner) while the server serves with a
        store; else None."""
        return self._batches.runner

    async def stop_batches(self) -> None:
        """Stop the batch runner: its lines in flight are aborted (not recorded) and its
        leases released, for the next server to resume (the drain's first step)."""
        await self._batches.stop()

    def require_engine(self) -> Engine:
        """The (first) model's engine, or ServiceUnavailable while it is not running."""
        return self.models.default.require_engine()

    async def __call__(self, scope, receive, send) -> None:
        """Every HTTP request: request id, CORS, API key, then the route (module docstring)."""
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self._lifespan(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
            return
        request_id, _ = request_id_from_header(header(scope, b"x-request-id"))
        token = request_id_var.set(request_id)
        conn = connection_info.get()
        if conn is not None:
            conn.request_id = request_id
        try:
            await self._serve_http(scope, receive, send, request_id)
        finally:
            request_id_var.reset(token)

    async def _serve_http(self, scope, receive, send, request_id: str) -> None:
        extra = [(b"x-request-id", request_id.encode("ascii"))]
        cors = self.cors
        if cors is not None:
            origin = header(scope, b"origin")
            if cors.is_preflight(scope, origin, header(scope, b"access-control-request-method")):
                allowed = cors.preflight_headers(
                    origin, header(scope, b"access-control-request-headers")
                )
                if allowed is None:
                    exc = OriginNotAllowed("This origin may not call the API (CORS).")
                    await send_error(send, exc, extra)
                else:
                    await send_empty(send, 204, allowed + extra)
                return
            extra.extend(cors.response_headers(origin))
        await self.serve_route(scope["path"], scope, receive, send, extra, request_id)

    async def serve_route(
        self, path: str, scope, receive, send, extra: list, request_id: str
    ) -> None:
        """Serve the request as one to ``path`` (the request's own path, or the one
        ``/invocations`` dispatched it to); ``extra``: the response's headers so far.

        A raw route (:mod:`server.http.routes`) is served here, the hot path: its body
        messages go to hypercorn's send directly. Anything else goes to Quart."""
        route = self.raw_routes.get(path)
        if route is not None:
            await route.serve(self, path, scope, receive, send, extra, request_id)
            return
        if _has_body(scope):
            # No route served from here reads a request body: the answer (404, 405, 401) may
            # end before the body does, and then the connection cannot carry another request.
            extra.append(CLOSE)
        send = HeaderSend(send, extra)
        receive = send.receive(receive)
        if self.api_keys is not None and is_protected(path):
            try:
                self.api_keys.check(header(scope, b"authorization"))
            except Unauthorized as exc:
                await send_error(send, exc, _WWW_AUTHENTICATE)
                return
        await super().__call__(scope, receive, send)

    def authorized(self, scope: dict) -> bool:
        """Whether the request may see what the server knows (its API key, if one is set)."""
        if self.api_keys is None:
            return True
        try:
            self.api_keys.check(header(scope, b"authorization"))
        except Unauthorized:
            return False
        return True

    def watch_connections(self, pool) -> None:
        """Called by the HTTP server with its connection pool (statistics in ``/metrics``)."""
        self.connections = pool
        self.metrics.watch_connections(pool)

    def sequence_limit(self, pool: Pool | None = None) -> int | None:
        """Sequences admitted at once into ``pool`` (default: the first model's):
        ``max_concurrent_sequences``; None for no limit (the default, and 0)."""
        pool = pool or self.models.default
        return pool.max_sequences or None

    def admission_error(self, engine: Engine, sequences: int) -> ServerError | None:
        """Why a request of ``sequences`` sequences (prompts x n) may not be admitted now:
        a 503 when it would take the server past its limits (decided before anything is
        queued), a 400 when it could never fit; None when it may run.

        By default there is no limit: requests beyond what the workers run at once wait
        in their engine's queue and start as batch slots free up, as vLLM's do (the
        queue-time limit, ``--max-queue-time``, bounds the wait; see generate.py). An
        explicit ``--max-concurrent-sequences`` or ``--max-concurrent-requests`` is a hard
        cap: over it a 503, and a request larger than the sequence limit alone a 400. The
        limits are those of ``engine``'s model (each model's pool has its own)."""
        pool = self.models.of_engine(engine)
        limit = pool.max_requests
        if limit is not None and engine.open_streams >= limit:
            return ServiceUnavailable(
                f"The server is at its limit of {limit} concurrent requests; retry later.",
                code="server_overloaded",
            )
        limit = self.sequence_limit(pool)
        if limit is None:
            return None
        if sequences > limit:
            return ClientError(
                f"This request asks for {sequences} sequences (prompts x n); the server runs "
                f"at most {limit} at once.",
                param="n",
            )
        if engine.open_sequences + sequences > limit:
            return ServiceUnavailable(
                f"The server is at its limit of {limit} concurrent sequences; retry later.",
                code="server_overloaded",
            )
        return None

    def saturated(self, pool: Pool | None = None) -> bool:
        """Whether a one-sequence request to ``pool`` (default: the first model's) would be
        refused for want of capacity now."""
        engine = (pool or self.models.default).engine
        return engine is not None and self.admission_error(engine, 1) is not None

    # -- lifespan ----------------------------------------------------------------------------

    async def _lifespan(self, scope, receive, send) -> None:
        """Quart's ASGI lifespan, inside the nursery the engine runs in (Quart's startup
        starts it, its shutdown stops it); the nursery ends with the lifespan."""
        async with trio.open_nursery() as nursery:
            self._engine_nursery = nursery
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._engine_nursery = None
                nursery.cancel_scope.cancel()  # an engine that outlived the lifespan

    async def _open_state_store(self) -> None:
        assert self._engine_nursery is not None, "the store opens in the ASGI lifespan"
        if not self.server_config.state_store or in_virtual_time():
            # (none asked for; or a test's virtual clock, which jumps ahead while a store's
            # read runs in its thread: ServerConfig.state_store)
            return
        try:
            await self.state.start(self._engine_nursery)
        except StateStoreError as exc:  # a configuration error: the server stops
            log.error("%s", exc)
            self._fail(exc)
            return
        await self._background.start(self._engine_nursery, self.state.store)
        await self._batches.start(self._engine_nursery, self.state.store)

    async def _watch_key_files(self) -> None:
        # (not in a test's virtual time: a look runs in a thread, as the store's reads)
        if self.key_files is None or in_virtual_time():
            return
        assert self._engine_nursery is not None, "the watch runs in the ASGI lifespan"
        await self._engine_nursery.start(self.key_files.run)

    async def _start_engine(self) -> None:
        if not self._owns_engine or self.fatal.is_set():
            return
        nursery = self._engine_nursery
        assert nursery is not None, "the engine starts in the ASGI lifespan"
        for pool in self.models.pools:
            pool.engine = await nursery.start(self._run_engine, pool)
        self._engine_started.set()

    async def _run_engine(self, pool: Pool, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # Each model's engine is a service of its own: one pool's workers dying or
        # restarting touch nothing of the others'. One that cannot start, or fails, stops
        # the server (a configuration error, or a bug), as the only one would.
        try:
            await run_engine(
                pool.config.engine, shutdown=self._engine_shutdown, task_status=task_status
            )
        except* WorkerStartupError as group:  # (it comes grouped out of the engine's nursery)
            exc = _first_leaf(group)
            log.error("%s", exc)
            self._fail(exc)
        except* Exception as group:
            # Anything else that ended the engine's nursery is a bug: the engine is gone,
            # and a server without one could only answer 503. It ends the server (and the
            # CLI's process, non-zero, so that its supervisor restarts it).
            exc = _only_leaf(group)
            log.critical("the engine failed: %r; stopping the server", exc, exc_info=exc)
            self._fail(exc)
        finally:
            pool.engine = None
            if not self.models.engines():
                self._engine_stopped.set()

    def _fail(self, exc: BaseException) -> None:
        if self.fatal_error is None:
            self.fatal_error = exc
        self.fatal.set()

    async def wait_engine_ready(self) -> None:
        """Wait until every model's engine runs and every worker has loaded (returns at
        once for engines the caller passed in, which are ready by construction)."""
        if self._owns_engine:
            await self._engine_started.wait()
        for engine in self.models.engines():
            await engine.wait_ready()

    async def stop_engine(self) -> None:
        """Stop the engines this app started (shielded); nothing for a caller's engines."""
        if not self._owns_engine or not self.models.engines():
            return
        self._engine_shutdown.set()
        with trio.CancelScope(shield=True):
            await self._engine_stopped.wait()

    def probe_answer(self, path: str) -> tuple[int, dict]:
        """The status and JSON body of ``/health`` or ``/ready``, for the API port's routes
        and the probe port (:mod:`server.connections.probes`) alike (docs/operations.md,
        "Health checks").

        Each pool is ``unavailable`` while no worker of it answers pings (or its engine is
        not running or draining), ``degraded`` while some but not all of its workers do
        (one crashed and is being restarted), and ``ok`` (``/health``) or ``ready``
        (``/ready``) otherwise; for ``/ready`` also ``saturated`` while an admission limit
        is reached. ``/health`` is liveness: 503 while any pool is unavailable, else 200,
        ``degraded`` included (restarting the server would not help a worker that is being
        restarted). ``/ready`` is readiness: 503 while any pool is unavailable or every pool
        is saturated, else 200; ``degraded`` is a 200, so that a load balancer keeps the
        capacity there is, and its body says how much (``workers_alive`` of ``workers``)
        rather than claim a full pool. With several models the body says each one's
        state, and the counts per model."""
        pools = self.models.pools
        counts = {p.name: p.workers() for p in pools}
        state: dict[str, str] = {}
        for p in pools:
            answering, total = counts[p.name]
            state[p.name] = (
                "unavailable" if not p.healthy() else
                "saturated" if path == "/ready" and self.saturated(p) else
                "degraded" if answering < total else
                "ok" if path == "/health" else "ready"
            )
        states = set(state.values())
        several = self.models.several
        if "unavailable" in states:
            return 503, _status_body("unavailable", state if several else None)
        if states == {"saturated"}:
            return 503, _status_body("saturated", state if several else None)
        if "degraded" not in states:
            return 200, _status_body("ok" if path == "/health" else "ready",
                                     state if several else None)
        body = _status_body("degraded", state if several else None)
        alive = {name: n for name, (n, _) in counts.items()}
        workers = {name: n for name, (_, n) in counts.items()}
        body["workers_alive"] = alive if several else alive[pools[0].name]
        body["workers"] = workers if several else workers[pools[0].name]
        return 200, body

    # -- Quart's routes and error handlers ---------------------------------------------------

    def _routes(self) -> None:
        self.before_serving(self._watch_key_files)
        self.before_serving(self._open_state_store)
        self.before_serving(self._start_engine)
        self.after_serving(self._batches.stop)  # (before the drain: lines do not hold it)
        self.after_serving(self.stop_engine)
        self.after_serving(self._background.stop)  # (its jobs' last writes need the store)
        self.after_serving(self.state.stop)  # after the engine: its last writes are stored

        for route in quart_routes(self.server_config):
            self.add_url_rule(route.path, route.serve.__name__, partial(route.serve, self),
                              methods=list(route.methods))

        @self.errorhandler(ServerError)
        async def server_error(exc: ServerError):
            return _json_error(exc)

        @self.errorhandler(HTTPException)
        async def http_error(exc: HTTPException):
            if exc.code == 404:
                return _json_error(NotFound("Not found."))
            if exc.code == 405:
                return _json_error(MethodNotAllowed("Method not allowed."))
            error = ServerError(exc.description or exc.name)
            error.status = exc.code or 500
            error.type = "invalid_request_error" if (exc.code or 500) < 500 else "internal_error"
            return _json_error(error)

        @self.errorhandler(Exception)
        async def internal_error(exc: Exception):
            log.error("internal error", exc_info=exc)
            return _json_error(ServerError("Internal server error."))


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _only_leaf(group: BaseExceptionGroup) -> BaseException:
    """The one exception inside nested groups of one; else the group itself."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def create_app(
    config: ServerConfig | None = None, *, engine: Engine | None = None, tracer_provider=None,
    engines: Sequence[Engine] = (),
) -> LLMServerApp:
    """Build the ASGI app. Without ``engine`` or ``engines`` the app starts its own in its
    lifespan (one per model of ``config``). ``engines``: several running engines, one per
    model, each named by its ``config.model`` (the first is the default); the app neither
    starts nor stops them, and the server's limits apply to each. ``tracer_provider`` (an
    OpenTelemetry one): a span per generation request through it (else through
    ``config.otlp_traces_endpoint``, if set; else no tracing)."""
    return LLMServerApp(config or ServerConfig(), engine=engine, engines=engines,
                        tracer_provider=tracer_provider)
