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

Embedding in a Trio program that already has an engine::

    app = create_app(ServerConfig(), engine=engine)   # the app will not start or stop it
"""

from __future__ import annotations

import logging
import time

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
    clip,
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
from .encode import dumps
from .embeddings import PATH as EMBEDDINGS_PATH
from .embeddings import handle_embeddings
from .adapters import ROUTES as LORA_ROUTES
from .adapters import adapter_cards, handle_lora
from .tokenize import ROUTES as TOKENIZE_ROUTES
from .tokenize import handle_tokenize
from .generate import handle_generate
from .responses_write import PATH as RESPONSES_PATH
from .responses_write import ROUTE as RESPONSES
from .listen import connection_info

__all__ = ["LLMServerApp", "create_app"]

log = logging.getLogger("server.http")

_GENERATE_ROUTES = {
    "/v1/completions": False,
    "/v1/chat/completions": True,
    RESPONSES_PATH: True,
}


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


def _status_json(status: str, code: int = 200) -> Response:
    """``{"status": ...}``, with ``Retry-After: 1`` on a 503 (the probes' answers)."""
    headers = {"Retry-After": "1"} if code == 503 else None
    return Response(
        dumps({"status": status}), status=code, content_type="application/json", headers=headers
    )


def _has_body(scope: dict) -> bool:
    """Whether the request declares a body (a non-zero Content-Length, or chunked)."""
    length = header(scope, b"content-length")
    if length is not None:
        return length.strip() not in (b"", b"0")
    return header(scope, b"transfer-encoding") is not None


class LLMServerApp(QuartTrio):
    """The server's ASGI app. ``engine`` is None until the lifespan has started it."""

    def __init__(
        self, config: ServerConfig, *, engine: Engine | None = None, tracer_provider=None
    ) -> None:
        super().__init__("trio_llm_server")
        self.server_config = config
        self.engine = engine
        self.started_at = time.time()
        self._owns_engine = engine is None
        self._engine_shutdown = trio.Event()
        self._engine_started = trio.Event()
        self._engine_stopped = trio.Event()
        #: Set (with ``fatal_error``) when the engine cannot start, or stopped by an error:
        #: serve() then stops, and raises it.
        self.fatal = trio.Event()
        self.fatal_error: BaseException | None = None
        self.api_keys = APIKeys(config.api_keys) if config.api_keys else None
        self.cors = CORSPolicy(config.allowed_origins) if config.allowed_origins else None
        #: The HTTP server's :class:`~server.http.listen.ConnectionPool` while it serves.
        self.connections = None
        #: The ``/metrics`` families, in a registry of this app's own.
        self.metrics = Metrics(lambda: self.engine, self._served_model)
        #: A span per generation request (OpenTelemetry), when asked; else None.
        self.tracing: Tracing | None = None
        if tracer_provider is not None:
            self.tracing = Tracing(tracer_provider)
        elif config.otlp_traces_endpoint:
            self.tracing = Tracing.from_endpoint(config.otlp_traces_endpoint)
        self._routes()

    def require_engine(self) -> Engine:
        """The engine, or ServiceUnavailable while it is not running."""
        engine = self.engine
        if engine is None:
            raise ServiceUnavailable("The engine is not running (starting or stopping).", code="no_engine")
        return engine

    async def __call__(self, scope, receive, send) -> None:
        """Every HTTP request: request id, CORS, API key, then the route (module docstring)."""
        if scope["type"] != "http":
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
        chat = _GENERATE_ROUTES.get(path)
        if chat is not None:  # the hot path: its body messages go to hypercorn's send directly
            record = RequestRecord(request_id, path)
            try:
                await handle_generate(
                    self, scope, receive, send, chat=chat, record=record, headers=extra,
                    route=RESPONSES if path == RESPONSES_PATH else None,
                )
            finally:
                record.finish = _now()
                self.metrics.observe(record)
                log_request(record)
                if self.tracing is not None:
                    self.tracing.export(record, self._served_model(), header(scope, b"traceparent"))
            return
        if path == EMBEDDINGS_PATH:
            await handle_embeddings(self, scope, receive, send, headers=extra)
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

    def watch_connections(self, pool) -> None:
        """Called by the HTTP server with its connection pool (statistics in ``/metrics``)."""
        self.connections = pool
        self.metrics.watch_connections(pool)

    def sequence_limit(self) -> int | None:
        """Sequences admitted at once (``max_concurrent_sequences``, or twice the engine's
        capacity by default), or None for no limit."""
        configured = self.server_config.max_concurrent_sequences
        if configured is not None:
            return configured or None
        engine = self.engine
        capacity = engine.capacity if engine is not None else None
        return None if capacity is None else 2 * capacity

    def admission_error(self, engine: Engine, sequences: int) -> ServerError | None:
        """Why a request of ``sequences`` sequences (prompts x n) may not be admitted now:
        a 503 when it would take the server past its limits (decided before anything is
        queued), a 400 when it could never fit; None when it may run.

        A request larger than the default sequence limit (twice what the workers run at
        once) runs when nothing else is in flight, as vLLM runs it: its sequences start as
        batch slots free up, and other requests get 503 meanwhile. An explicit
        ``--max-concurrent-sequences`` is a hard cap: larger is a 400."""
        limit = self.server_config.max_concurrent_requests
        if limit is not None and engine.open_streams >= limit:
            return ServiceUnavailable(
                f"The server is at its limit of {limit} concurrent requests; retry later.",
                code="server_overloaded",
            )
        configured = self.server_config.max_concurrent_sequences
        limit = self.sequence_limit()
        if limit is None:
            return None
        if sequences > limit and configured is not None:
            return ClientError(
                f"This request asks for {sequences} sequences (prompts x n); the server runs "
                f"at most {limit} at once.",
                param="n",
            )
        if engine.open_streams and engine.open_sequences + sequences > limit:
            return ServiceUnavailable(
                f"The server is at its limit of {limit} concurrent sequences; retry later.",
                code="server_overloaded",
            )
        return None

    def saturated(self) -> bool:
        """Whether a one-sequence request would be refused for want of capacity now."""
        engine = self.engine
        return engine is not None and self.admission_error(engine, 1) is not None

    # -- lifespan ----------------------------------------------------------------------------

    async def _start_engine(self) -> None:
        if not self._owns_engine:
            return
        self.engine = await self.nursery.start(self._run_engine)
        self._engine_started.set()

    async def _run_engine(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await run_engine(
                self.server_config.engine, shutdown=self._engine_shutdown, task_status=task_status
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
            self.engine = None
            self._engine_stopped.set()

    def _fail(self, exc: BaseException) -> None:
        if self.fatal_error is None:
            self.fatal_error = exc
        self.fatal.set()

    async def wait_engine_ready(self) -> None:
        """Wait until the engine runs and every worker has loaded (returns at once for an
        engine the caller passed in, which is ready by construction)."""
        if self._owns_engine:
            await self._engine_started.wait()
        engine = self.engine
        if engine is not None:
            await engine.wait_ready()

    async def stop_engine(self) -> None:
        """Stop the engine this app started (shielded); nothing for a caller's engine."""
        if not self._owns_engine or self.engine is None:
            return
        self._engine_shutdown.set()
        with trio.CancelScope(shield=True):
            await self._engine_stopped.wait()

    # -- the small routes --------------------------------------------------------------------

    def _routes(self) -> None:
        self.before_serving(self._start_engine)
        self.after_serving(self.stop_engine)

        @self.get("/health")
        async def health():
            engine = self.engine
            if engine is None or not engine.healthy():
                return _status_json("unavailable", 503)
            return _status_json("ok")

        @self.get("/ready")
        async def ready():
            # Readiness, distinct from liveness (/health): 503 also while saturated, so that
            # a load balancer sends new requests elsewhere while this server is full.
            engine = self.engine
            if engine is None or not engine.healthy():
                return _status_json("unavailable", 503)
            if self.saturated():
                return _status_json("saturated", 503)
            return _status_json("ready")

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
            card = self._model_card()
            data = [card]
            if self.engine is not None:
                data += adapter_cards(self.engine, card)
            body = {"object": "list", "data": data}
            return Response(dumps(body), content_type="application/json")

        @self.get("/v1/models/<path:model_id>")
        async def model(model_id: str):
            cards = [self._model_card()]
            if self.engine is not None:
                cards += adapter_cards(self.engine, cards[0])
            card = next((c for c in cards if c["id"] == model_id), None)
            if card is None:
                raise NotFound(
                    f"The model '{clip(model_id)}' does not exist.",
                    param="model",
                    code="model_not_found",
                )
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
        if self.engine is not None:
            return self.engine.model_name
        return self.server_config.engine.model or self.server_config.engine.engine

    def _model_card(self) -> dict:
        card = {
            "id": self._served_model(),
            "object": "model",
            "created": int(self.started_at),
            "owned_by": "trio-llm-server",
        }
        if self.engine is not None and self.engine.info.get("max_model_len"):
            card["max_model_len"] = self.engine.info["max_model_len"]
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
    config: ServerConfig | None = None, *, engine: Engine | None = None, tracer_provider=None
) -> LLMServerApp:
    """Build the ASGI app. Without ``engine`` the app starts its own in its lifespan.
    ``tracer_provider`` (an OpenTelemetry one): a span per generation request through it
    (else through ``config.otlp_traces_endpoint``, if set; else no tracing)."""
    return LLMServerApp(config or ServerConfig(), engine=engine, tracer_provider=tracer_provider)
