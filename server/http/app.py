"""The ASGI application: a Quart-Trio app whose generation routes run on raw ASGI.

``create_app(config)`` builds it. Quart serves the small routes (``/health``, ``/metrics``,
``/v1/models``) and the lifespan, in whose nursery the engine runs as a service; the two
generation routes, the hot path, go to :mod:`server.http.generate` before Quart sees them.
Every error, Quart's own 404 and 405 included, is answered with an OpenAI-style JSON body.

Before any route, :meth:`LLMServerApp.__call__` does what every HTTP request needs, in order:

1. the request id (``X-Request-Id``, or a new one) goes into the logging context, and onto
   the response's headers;
2. CORS, when enabled: a preflight is answered here; other responses get the CORS headers;
3. API keys, when configured: every path but ``/health``, ``/ready`` and ``/metrics`` needs
   ``Authorization: Bearer KEY`` (401 otherwise; see :mod:`server.http.auth`);
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
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from .. import __version__
from ..config import ServerConfig
from ..errors import (
    ClientError,
    MethodNotAllowed,
    NotFound,
    ServerError,
    ServiceUnavailable,
    Unauthorized,
    error_body,
)
from ..manager.engine import Engine, run_engine
from ..manager.worker import WorkerStartupError
from ..observability import Metrics, RequestRecord, log_request, request_id_from_header
from ..observability.group import group_exposition
from ..observability.logs import request_id_var
from ..observability.tracing import Tracing
from .asgi import CLOSE, HeaderSend, header, send_empty, send_error
from .auth import APIKeys, is_protected
from .cors import CORSPolicy
from ..openai.encode import dumps
from .embeddings import PATH as EMBEDDINGS_PATH
from .embeddings import handle_embeddings
from .adapters import ROUTES as LORA_ROUTES
from .adapters import adapter_cards, handle_lora
from .tokenize import ROUTES as TOKENIZE_ROUTES
from .tokenize import handle_tokenize
from .generate import handle_generate
from .invocations import PATH as INVOCATIONS_PATH
from .invocations import handle_invocations
from .responses_write import PATH as RESPONSES_PATH
from .responses_write import ROUTE as RESPONSES
from .chat_batch import PATH as CHAT_BATCH_PATH
from .chat_batch import ROUTE as CHAT_BATCH
from ..connections.accept import connection_info
from .models import ModelTable, Pool
from .orca import REQUEST_HEADER as ORCA_FORMAT
from .orca import load_report, named_metrics

__all__ = ["LLMServerApp", "create_app"]

log = logging.getLogger("server.http")

_GENERATE_ROUTES = {
    "/v1/completions": False,
    "/v1/chat/completions": True,
    RESPONSES_PATH: True,
    CHAT_BATCH_PATH: True,
}
#: The generation routes with shapes of their own (handle_generate's ``route``).
_ROUTE_SHAPES = {RESPONSES_PATH: RESPONSES, CHAT_BATCH_PATH: CHAT_BATCH}


_now = time.perf_counter
_WWW_AUTHENTICATE = [(b"www-authenticate", b"Bearer")]


class OriginNotAllowed(ClientError):
    """A CORS preflight from an origin that is not in ``--allowed-origins``."""

    status = 403
    code = "origin_not_allowed"


def _json_error(exc: ServerError) -> Response:
    response = Response(dumps(error_body(exc)), status=exc.status, content_type="application/json")
    if isinstance(exc, ServiceUnavailable):
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def _status_body(status: str, models: dict | None) -> dict:
    """``{"status": ...}``, and each model's when several are served."""
    return {"status": status} if models is None else {"status": status, "models": models}


def _status_json(code: int, body: dict) -> Response:
    """A probe's answer, with ``Retry-After: 1`` on a 503."""
    headers = {"Retry-After": "1"} if code == 503 else None
    return Response(dumps(body), status=code, content_type="application/json", headers=headers)


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
        self.api_keys = APIKeys(config.api_keys) if config.api_keys else None
        self.cors = CORSPolicy(config.allowed_origins) if config.allowed_origins else None
        #: The HTTP server's :class:`~server.connections.accept.ConnectionPool` while it serves.
        self.connections = None
        #: The ``/metrics`` families, in a registry of this app's own.
        self.metrics = Metrics(
            lambda: [(p.name, p.engine) for p in self.models.pools],
            more_models=[p.name for p in self.models.pools[1:]],
        )
        #: A span per generation request (OpenTelemetry), when asked; else None.
        self.tracing: Tracing | None = None
        if tracer_provider is not None:
            self.tracing = Tracing(tracer_provider)
        elif config.otlp_traces_endpoint:
            self.tracing = Tracing.from_endpoint(config.otlp_traces_endpoint)
        self._routes()

    @property
    def engine(self) -> Engine | None:
        """The engine of the (first) model, None until the lifespan has started it."""
        return self.models.default.engine

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
        path = scope["path"]
        if path == INVOCATIONS_PATH:  # SageMaker's: one of the routes below, by the body
            await handle_invocations(self, scope, receive, send, headers=extra,
                                     dispatch=partial(self._serve_route, request_id=request_id))
            return
        await self._serve_route(path, scope, receive, send, extra, request_id=request_id)

    async def _serve_route(
        self, path: str, scope, receive, send, extra: list, *, request_id: str
    ) -> None:
        """Serve the request as one to ``path`` (the request's own path, or the one
        ``/invocations`` dispatched it to); ``extra``: the response's headers so far."""
        chat = _GENERATE_ROUTES.get(path)
        if chat is not None:  # the hot path: its body messages go to hypercorn's send directly
            orca = header(scope, ORCA_FORMAT)
            if orca is not None and self._authorized(scope):
                # a load balancer asks for a load report (server.http.orca)
                try:  # (every model's pool: the report comes before the body names one)
                    engines = self.models.engines()
                    latest = [w.report.latest or {} for e in engines for w in e.workers
                              if w.alive]
                    usage = [r["kv_cache_usage"] for r in latest if "kv_cache_usage" in r]
                    metrics = named_metrics([e.statistics() for e in engines], usage)
                    extra = [*extra, load_report(orca, metrics)]
                except ServerError as exc:
                    await send_error(send, exc, [*extra, CLOSE])
                    return
            record = RequestRecord(request_id, path)
            try:
                await handle_generate(
                    self, scope, receive, send, chat=chat, record=record, headers=extra,
                    route=_ROUTE_SHAPES.get(path),
                )
            finally:
                record.finish = _now()
                self.metrics.of(record.model).observe(record)
                log_request(record)
                if self.tracing is not None:
                    self.tracing.export(record, record.model or self._served_model(),
                                        header(scope, b"traceparent"))
            return
        if path == EMBEDDINGS_PATH:
            record = RequestRecord(request_id, path)
            try:
                await handle_embeddings(self, scope, receive, send, headers=extra, record=record)
            finally:  # (its log line, as a generation request's; not its metrics)
                record.finish = _now()
                log_request(record)
            return
        op = TOKENIZE_ROUTES.get(path)
        if op is not None:
            await handle_tokenize(self, scope, receive, send, op=op, headers=extra)
            return
        op = LORA_ROUTES.get(path)
        if op is not None:
            await handle_lora(self, scope, receive, send, op=op, headers=extra)
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

    def _authorized(self, scope: dict) -> bool:
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

    async def _start_engine(self) -> None:
        if not self._owns_engine:
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

    # -- the small routes --------------------------------------------------------------------

    def _routes(self) -> None:
        self.before_serving(self._start_engine)
        self.after_serving(self.stop_engine)

        @self.get("/health")
        async def health():
            return _status_json(*self.probe_answer("/health"))

        @self.get("/ready")
        async def ready():
            return _status_json(*self.probe_answer("/ready"))

        @self.get("/metrics")
        async def metrics():
            accept = request.headers.get("accept")
            group = self.server_config.frontend_dir
            if group is None:
                body, content_type = self.metrics.exposition(accept)
            else:  # one of several frontends (--api-servers): answer for all of them
                body, content_type = await group_exposition(
                    group, self.server_config.frontend_index,
                    self.metrics.local_exposition(), accept,
                )
            return Response(body, status=200, content_type=content_type)

        if self.server_config.enable_tokenizer_info:

            @self.get("/tokenizer_info")
            async def tokenizer_info():
                # A worker's tokenizer, as for /tokenize (server.http.tokenize).
                info = await self.require_engine().tokenize({"op": "info"})
                return Response(dumps(info), content_type="application/json")

        @self.get("/load")
        async def load():
            # vLLM's --enable-server-load-tracking route, always on here (the count is kept
            # anyway): generation requests in flight on this frontend.
            body = {"server_load": sum(e.open_streams for e in self.models.engines())}
            return Response(dumps(body), content_type="application/json")

        @self.get("/version")
        async def version():
            # vLLM's route: "version" is vLLM's with the vllm engine (clients read it to
            # know what vLLM serves), else this server's; both named besides.
            info = self.engine.info if self.engine is not None else {}
            body = {"version": info.get("vllm_version") or __version__,
                    "server_version": __version__, "engine": info.get("engine")}
            if info.get("vllm_version"):
                body["vllm_version"] = info["vllm_version"]
            return Response(dumps(body), content_type="application/json")

        @self.get("/v1/models")
        async def models():
            data = []
            for pool in self.models.pools:
                card = self._model_card(pool)
                data.append(card)
                if pool.engine is not None:  # its LoRA adapters, as vLLM lists them
                    data += adapter_cards(pool.engine, card)
            body = {"object": "list", "data": data}
            return Response(dumps(body), content_type="application/json")

        @self.get("/v1/models/<path:model_id>")
        async def model(model_id: str):
            pool = self.models.resolve(model_id)  # (a 404 for a name nothing serves)
            card = self._model_card(pool)
            if card["id"] != model_id and pool.engine is not None:  # a LoRA adapter
                card = next(c for c in adapter_cards(pool.engine, card) if c["id"] == model_id)
            return Response(dumps(card), content_type="application/json")

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

    def _served_model(self) -> str:
        return self.models.default.name

    def _model_card(self, pool: Pool) -> dict:
        """A model's card, with vLLM's fields: ``root`` the model's path as configured
        (its name when it has none: the sim, remote workers), ``parent`` null (an adapter's
        card names its base model: :func:`adapter_cards`), and ``permission``, which
        clients that read vLLM's cards expect."""
        created = int(self.started_at)
        card = {
            "id": pool.name,
            "object": "model",
            "created": created,
            "owned_by": "trio-llm-server",
            "root": pool.config.engine.engine_options.get("model_path") or pool.name,
            "parent": None,
            "permission": [{
                "id": f"modelperm-{pool.name}", "object": "model_permission",
                "created": created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        }
        engine = pool.engine
        if engine is not None and engine.info.get("max_model_len"):
            card["max_model_len"] = engine.info["max_model_len"]
        return card


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
