"""Engine configuration: how many workers, which engine, and the time limits that bound
cleanup. Plain data.

Example::

    config = EngineConfig(engine="sim", workers=2, engine_options={"itl_ms": 4.0})
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

__all__ = ["EngineConfig", "Limits", "ModelConfig", "ServerConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the request manager and its engine workers.

    ``engine_options`` go to the engine's constructor in each worker process (for the sim
    engine: ``itl_ms``, ``ttft_ms``, ``prefill_us_per_token``, ``max_batch``,
    ``max_model_len``, ``faults``; see :class:`server.engines.sim.engine.SimEngine`).
    """

    engine: str = "sim"
    #: The served model name; defaults to the engine's own (``sim``, or the model directory).
    model: str | None = None
    workers: int = 1
    engine_options: dict = field(default_factory=dict)
    #: After an abort, how long output may still drain before the stream is cut off and
    #: its state freed (a worker that ignores aborts is cut off here).
    drain_timeout: float = 1.0
    #: Pacing: the least time between two wakeups of a stream's consumer for new text (0:
    #: every engine step). Text produced meanwhile is merged; first and last outputs are
    #: never delayed. The HTTP server's default is 0 too (``--stream-interval-ms``).
    stream_interval: float = 0.0
    #: How long a worker may take to load its engine and say HELLO.
    startup_timeout: float = 120.0
    #: Ping period, and how long a worker may leave pings unanswered before it is killed.
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    #: Restart backoff after a worker dies (doubling from ``restart_backoff`` up to
    #: ``restart_backoff_max``), and its budget: the most restarts in ``restart_window``
    #: seconds before a spawned worker is restarted only at ``restart_backoff_max`` (never
    #: left down), until it stays up for ``restart_window`` (server.restarts).
    restart_backoff: float = 0.1
    restart_backoff_max: float = 5.0
    max_restarts: int = 5
    restart_window: float = 60.0
    #: Worker shutdown: close its pipe and wait this long, then SIGTERM and wait again, then
    #: SIGKILL. Also how long a session's end waits for a big answer that arrived whole to be
    #: decoded (server.manager.worker).
    shutdown_grace: float = 2.0
    #: The Python interpreter that runs the workers.
    python: str = sys.executable
    #: Accelerators per worker: worker ``i`` sees devices ``i*k .. i*k+k-1`` (of those in
    #: ``CUDA_VISIBLE_DEVICES`` if the frontend has it, else of all) as its
    #: ``CUDA_VISIBLE_DEVICES``. None: every worker sees what the frontend sees.
    devices_per_worker: int | None = None
    #: Which worker a config is for (set by the request manager, for devices_per_worker).
    worker_index: int = 0
    #: Workers that listen elsewhere (``python -m server.workers --listen``), one
    #: :class:`~server.worker_protocol.handshake.WorkerAddress` or its text (``"HOST:PORT"``,
    #: ``"unix:/path"``) each: connected to instead of spawned. ``workers`` must then be
    #: 1 (the default) or their number, and ``engine_options`` empty: they are the
    #: workers' own (the Engine raises ValueError otherwise).
    worker_addresses: tuple = ()
    #: The remote workers' shared secret (None: connect without one; only loopback and
    #: unix-socket workers accept that). Never in a repr.
    worker_secret: bytes | None = field(default=None, repr=False)
    #: A PEM file of CA certificates: connect to the remote workers over TLS, trusting them.
    worker_tls_ca: str | None = None
    #: Workers found by DNS (a ``dns:`` or ``srv:`` worker address; server.discovery):
    #: the DNS server asked (``HOST:PORT``; None: resolv.conf's first), the bounds of the
    #: re-resolution period (seconds; the records' TTL between them), and how long a
    #: worker whose address left the records may finish its requests before they move.
    dns_server: str | None = None
    dns_min_interval: float = 1.0
    dns_max_interval: float = 30.0
    dns_drain_grace: float = 60.0
    #: How a request's worker is chosen (server.manager.routing.POLICIES): ``prefix`` (the
    #: worker predicted to hold most of its prompt in its prefix cache, within
    #: ``routing_balance``), ``least-loaded`` or ``round-robin``. See docs/routing.md.
    routing: str = "prefix"
    #: Prefix routing's trade-off: the most extra outstanding requests the best-matching
    #: worker may carry over the least loaded one before the least loaded one is used.
    routing_balance: int = 8  # server.manager.routing.DEFAULT_BALANCE
    #: When a worker dies or its session ends, how many times one request may be moved to
    #: another worker, resuming where it stopped (0: its stream ends with an error, as
    #: before migration existed). See docs/routing.md, "Migration".
    max_migrations: int = 3

    def for_worker(self, index: int) -> EngineConfig:
        """This config, for worker ``index``."""
        return replace(self, worker_index=index)

    def visible_devices(self, env: Mapping[str, str] | None = None) -> str | None:
        """The ``CUDA_VISIBLE_DEVICES`` of this config's worker (None: inherit)."""
        k = self.devices_per_worker
        if not k:
            return None
        env = os.environ if env is None else env
        inherited = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        first = self.worker_index * k
        if inherited:
            if first + k > len(inherited):
                raise ValueError(
                    f"worker {self.worker_index} needs devices {first}..{first + k - 1} but "
                    f"CUDA_VISIBLE_DEVICES lists {len(inherited)}"
                )
            return ",".join(inherited[first : first + k])
        return ",".join(str(d) for d in range(first, first + k))

    def worker_argument(self) -> dict:
        """The JSON-able config a worker process is started with."""
        options = dict(self.engine_options)
        if self.model is not None and self.engine == "sim":
            options.setdefault("model", self.model)
        # "pulse": how often the worker says it is alive while one step runs long
        # (server.workers.pulse): once per ping period. "parts": send a big answer in
        # parts between the STEPs (server.worker_protocol.parts; the Link's decoder
        # joins them). "image_stats": PONGs may hold the image-cache counters (this frontend
        # reads them; a worker leaves them out for one that does not say so).
        argument = {"engine": self.engine, "options": options, "pulse": self.heartbeat_interval,
                    "parts": True, "image_stats": True}
        devices = self.visible_devices()
        if devices is not None:
            argument["visible_devices"] = devices
        return argument


@dataclass(frozen=True)
class Limits:
    """Caps on what one HTTP request may ask for; over a cap is a 400."""

    max_n: int = 16
    max_tokens: int = 32768
    max_prompts: int = 64
    max_stop: int = 16
    #: Most logprobs (each token's own and its alternatives, over all choices) that one
    #: non-streaming answer may be asked to hold: ``choices x max_tokens x
    #: (top_logprobs + 1)``; more is a 400 before anything runs (0: no limit). The default,
    #: 2**19, is about a 40 MB chat answer: n=16 x 16,384 tokens x top 1, or n=16 x 1,536
    #: tokens x top 20. A stream sends them as it goes and is not bounded by it.
    max_answer_logprobs: int = 2**19
    #: Whether a request's ``fault`` field (sim engine fault injection) reaches the engine.
    allow_faults: bool = False
    #: vLLM's ``--enable-force-include-usage``: every stream ends with a usage chunk, as
    #: if it had asked with ``stream_options.include_usage`` (whatever it asked).
    force_include_usage: bool = False
    #: vLLM's ``--return-tokens-as-token-ids``: logprobs' tokens spelled ``token_id:N``
    #: for a request that does not say (its ``return_tokens_as_token_ids`` wins).
    tokens_as_ids: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """One model of a server that serves several (:attr:`ServerConfig.models`): its worker
    pool (``engine``, whose ``model`` is the name clients give) and that pool's admission
    limits. A limit left None is the server's (``ServerConfig.max_concurrent_*``)."""

    engine: EngineConfig
    #: This pool's requests in flight beyond which new ones get a 503.
    max_concurrent_requests: int | None = None
    #: This pool's sequences in flight beyond which new ones get a 503 (0: no limit).
    max_concurrent_sequences: int | None = None
    #: Seconds one of this pool's requests may wait to start before it gets a 503
    #: (0: no limit).
    max_queue_time: float | None = None


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the HTTP server (the CLI builds one from its options)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    limits: Limits = field(default_factory=Limits)
    #: Largest request body accepted; larger is a 413.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Largest file a ``POST /v1/files`` upload may carry (its body may be a few KiB more:
    #: the form's heads); larger is a 413.
    max_file_bytes: int = 200 * 1024 * 1024
    #: The state store (stored responses, files: docs/state.md): SQLite in ``state_dir``,
    #: or PostgreSQL at ``state_url``; neither: a private temporary directory (the
    #: supervisor's for ``--api-servers`` frontends), removed at exit.
    state_dir: str | None = None
    state_url: str | None = None
    #: False: no state store at all (an app under a test's virtual clock never opens one:
    #: server.state.service.in_virtual_time). Responses are then not stored (``store:
    #: true`` is a 400 naming it) and /v1/files is a 503.
    state_store: bool = True
    #: Seconds a stored object stays (0: until deleted); the store's size budget and each
    #: API key's, in bytes (0: none).
    state_retention: int = 30 * 24 * 3600
    state_max_bytes: int = 4 * 1024**3
    state_max_bytes_per_key: int = 0
    #: Each API key's unfinished batches (server.batches.objects.ACTIVE), counted in the
    #: store over every frontend; a create past it is a 429 (0: no quota).
    max_batches_per_key: int = 0
    #: Background responses (``background: true``) one frontend runs at once; past it a
    #: new one is a 503 (docs/api.md).
    max_background_responses: int = 64
    #: Batch API lines one frontend runs at once, in idle capacity only (docs/batches.md).
    batch_concurrency: int = 8
    #: Seconds a request may run before the server aborts it (None: no limit).
    request_timeout: float | None = None
    #: Requests in flight beyond which new ones get a 503 (None: no limit).
    max_concurrent_requests: int | None = None
    #: Sequences (prompts x n) in flight beyond which a new request gets a 503; one that
    #: asks for more than this alone is a 400. None or 0: no limit (requests beyond what
    #: the workers run at once wait in their engine's queue, as vLLM's do).
    max_concurrent_sequences: int | None = None
    #: Seconds a request may wait for the engine to start it (its first output) before
    #: it is aborted and answered 503 ``server_overloaded`` (None or 0: no limit).
    max_queue_time: float | None = None
    #: A streaming request still queued after this many seconds starts its response and
    #: sends an SSE comment this often until its first token, so that proxies with read
    #: timeouts (nginx: 60 s) keep it (None: wait silently).
    queued_heartbeat: float | None = 15.0
    #: On SIGTERM/SIGINT, how long in-flight requests may keep streaming before they are
    #: aborted (0: abort at once).
    shutdown_timeout: float = 30.0
    #: Idle connections (nothing sent yet, or between requests) are closed after
    #: ``keep_alive_timeout`` seconds; a request body must arrive within ``read_timeout``
    #: seconds (else 408). A response that streams is bounded by neither.
    keep_alive_timeout: float = 30.0
    read_timeout: float = 30.0
    #: A connection whose client accepts no bytes of the response for this many seconds
    #: (it stopped reading: its TCP window is full) is closed, and its request aborted
    #: (None: never). Also bounds how long such a client can hold a shutdown.
    send_timeout: float | None = 30.0
    #: The listen backlog (the kernel caps it at net.core.somaxconn).
    backlog: int = 2048
    #: A second port (same host) answering only ``/health`` and ``/ready``, on a listener
    #: of its own (:mod:`server.connections.probes`); 0 picks a free one; None: none.
    health_port: int | None = None
    #: The probe port as an inherited listening socket (a file descriptor) instead of
    #: ``health_port``: what the supervisor of ``--api-servers`` gives each frontend.
    health_listen_fd: int | None = None
    #: Open connections beyond which a new one first ends the oldest idle keep-alive
    #: connection, else gets a 503 and is closed (None: the file-descriptor limit less a
    #: reserve, see server.connections.accept.default_max_connections).
    max_connections: int | None = None
    #: Serve through hypercorn's public ``serve()`` when the installed hypercorn or h11 is
    #: not what the direct HTTP path was written for (else that is an error at start:
    #: server.connections.private_api.use_direct_path).
    allow_http_fallback: bool = False
    #: After the drain, seconds open connections (idle keep-alives) get before they are cut.
    close_timeout: float = 2.0
    #: Keys accepted (``Authorization: Bearer KEY``); empty, with no ``api_key_files``: no
    #: key is needed. Only ``/health``, ``/ready`` and ``/metrics`` are open when keys are set.
    api_keys: tuple[str, ...] = ()
    #: Files of more keys, one per line (server.key_file), read when the app is made and
    #: again when one changes, checked every ``api_key_file_interval`` seconds
    #: (server.http.key_files): a key removed from a file is refused from then on.
    api_key_files: tuple[str, ...] = ()
    api_key_file_interval: float = 10.0
    #: A frontend of ``--api-servers`` restarted: the files' keys in force at its
    #: supervisor, taken as the files' while one is refused when the app is made. None:
    #: such a refusal is an error (server.http.key_files.KeyFileError).
    api_key_files_handed: tuple[str, ...] | None = None
    #: Where to send a trace span per generation request (OTLP/HTTP, e.g.
    #: ``http://collector:4318/v1/traces``); None: no tracing. Needs the ``otel`` extra.
    otlp_traces_endpoint: str | None = None
    #: How chat answers are split into ``reasoning_content`` and ``content``
    #: (server.openai.reasoning.PARSERS: "qwen3", "deepseek_r1"); None: not split.
    reasoning_parser: str | None = None
    #: How chat answers are parsed into ``tool_calls`` (server.openai.tool_parsers.PARSERS:
    #: "hermes", "llama3_json", "mistral") with tool_choice auto; None: auto is refused
    #: (required, named and none are grammar-forced or unparsed: they need no parser).
    tool_call_parser: str | None = None
    #: Serve ``GET /tokenizer_info`` (the tokenizer's configuration and chat template, as
    #: vLLM's ``--enable-tokenizer-info-endpoint``); off, it is a 404.
    enable_tokenizer_info: bool = False
    #: Origins a browser may call the API from (CORS), or ``("*",)`` for any; empty: CORS is
    #: off (no CORS headers, preflights are not answered).
    allowed_origins: tuple[str, ...] = ()
    #: Image URLs (server.media, docs/media.md): the only hosts fetched (empty: any host
    #: whose addresses are public), the directory ``file://`` URLs are read under (None:
    #: refused), the time one fetch may take, the largest image, the fetches at once, and
    #: whether loopback and private addresses may be fetched.
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    media_fetch_timeout: float = 5.0
    max_media_bytes: int = 20 * 1024 * 1024
    max_media_fetches: int = 16
    allow_private_media_addresses: bool = False
    #: Serve on this inherited listening socket (a file descriptor) instead of host/port.
    listen_fd: int | None = None
    #: One of several frontends of a supervisor (``--api-servers``): the directory of their
    #: private sockets (each answers its peers' metrics scrapes there; ``/metrics`` merges
    #: them all), and this frontend's number. None: a server on its own.
    frontend_dir: str | None = None
    frontend_index: int = 0
    #: Several models, each its own worker pool and engine, chosen by a request's ``model``
    #: (docs/operations.md). Each needs a distinct ``engine.model``; ``engine`` is then left
    #: at its default (one model is ``engine``, the limits above its own).
    models: tuple[ModelConfig, ...] = ()

    def __post_init__(self) -> None:
        if not self.models:
            return
        if self.engine != EngineConfig():
            raise ValueError("ServerConfig: 'engine' and 'models' both configure the models: "
                             "give each model's engine in 'models' only")
        names = [m.engine.model for m in self.models]
        for i, name in enumerate(names):
            if not name:
                raise ValueError(f"ServerConfig: models[{i}].engine.model: each model of "
                                 "several needs its name")
            if name in names[:i]:
                raise ValueError(f"ServerConfig: models[{i}].engine.model: '{name}' is "
                                 "served twice")

    def pools(self) -> tuple[ModelConfig, ...]:
        """The models served, each a pool with its own limits: ``models``, or the one of
        ``engine`` with the server's limits."""
        if self.models:
            return tuple(
                replace(
                    m,
                    max_concurrent_requests=_given(m.max_concurrent_requests,
                                                   self.max_concurrent_requests),
                    max_concurrent_sequences=_given(m.max_concurrent_sequences,
                                                    self.max_concurrent_sequences),
                    max_queue_time=_given(m.max_queue_time, self.max_queue_time),
                )
                for m in self.models
            )
        return (ModelConfig(self.engine, self.max_concurrent_requests,
                            self.max_concurrent_sequences, self.max_queue_time),)


_T = TypeVar("_T")


def _given(value: _T | None, default: _T | None) -> _T | None:
    return default if value is None else value
