"""The server's option table: every option of ``trio-llm-server``, in ``--help``'s order.
From it server.cli builds the parser and the configuration, server.model_config reads a
``--model-config`` entry and server.supervisor_plan writes its children's command lines
(server.option_table says how).

Each option says where its value goes (``into``: a field of server.config's objects), which
child of ``--api-servers`` takes it (``child``, default the frontend) and whether a model's
entry of ``--model-config`` may give it (``entry``, default not).
"""

from __future__ import annotations

import argparse
import functools
import os

from .engine_args import ENGINE_OPTIONS
from .manager.routing import DEFAULT_BALANCE, POLICIES
from .openai.tool_parsers import PARSERS as TOOL_PARSERS
from .option_bounds import COUNT, PORT, SECONDS, ZERO_OK
from .option_table import Into, Option, section
from .option_units import duration, size
from .worker_protocol.handshake import SECRET_ENV

__all__ = ["API_KEY_ENV", "FRONTEND_FILE_KEYS_ENV", "FRONTEND_KEYS_ENV", "OPTIONS",
           "split_commas"]

#: The environment variable read for API keys when ``--api-key`` is not given.
API_KEY_ENV = "TRIO_LLM_API_KEY"
#: Internal: the keys of a supervisor of ``--api-servers``'s ``--api-key`` (or the
#: variable's), one per line, in its frontends' environment, off their command lines.
#: Key files are not in it: each frontend reads them itself, and again when they change.
FRONTEND_KEYS_ENV = "TRIO_LLM_FRONTEND_API_KEYS"
#: Internal: the key files' keys in force at the supervisor, one per line, in a restarted
#: frontend's environment: its keys while a file is refused (server.http.key_files). Apart
#: from FRONTEND_KEYS_ENV, so that a key later removed from a file does not stay in force.
FRONTEND_FILE_KEYS_ENV = "TRIO_LLM_FRONTEND_FILE_KEYS"


def split_commas(values: list[str] | None) -> tuple[str, ...]:
    """``["a,b", "c"]`` -> ``("a", "b", "c")``: repeated options, each possibly a list."""
    out: list[str] = []
    for value in values or ():
        out.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(out)


#: A section of the server's own options: each goes to the frontends of --api-servers
#: and is no key of a --model-config entry, unless it says.
_frontend = functools.partial(section, child="frontend", entry="none")


def _postgres_url(text: str) -> str:
    """``--state-url``: a PostgreSQL URL (libpq's), refused at start otherwise."""
    if not text.startswith(("postgresql://", "postgres://")):
        raise argparse.ArgumentTypeError(
            f"expected a postgresql:// URL (the SQLite store is --state-dir), got {text!r}")
    return text


def _absolute(path: str | None) -> str | None:
    """A directory as an absolute path (the frontends of --api-servers get the same)."""
    return None if path is None else os.path.abspath(path)


def _paths(values: list[str] | None) -> tuple[str, ...]:
    """A repeated path option's values as absolute paths, once each (the frontends of
    --api-servers are started in the supervisor's directory, given the paths as given)."""
    return tuple(dict.fromkeys(os.path.abspath(p) for p in values or ()))


def _host_names(values: list[str] | None) -> tuple[str, ...]:
    """``--allowed-media-domains``: each name lowercased, without a trailing dot."""
    return tuple(name.rstrip(".").lower() for name in split_commas(values))


def _zero_is_none(value):
    """0 (the option's "no limit", "never") as the configuration's None."""
    return value or None


OPTIONS: tuple[Option, ...] = (
    *_frontend(
        "serving",
        Option("--host", default="127.0.0.1", help="address to listen on",
               child="supervisor", into=("server.host",)),
        Option("--port", type=int, default=8000, bounds=PORT, child="supervisor",
               into=("server.port",), help="port to listen on (0: any free port)"),
        Option("--keep-alive-timeout", type=float, default=30.0, bounds=SECONDS,
               into=("server.keep_alive_timeout",),
               help="seconds an idle connection (nothing sent yet, or between requests) "
               "stays open"),
        Option("--read-timeout", type=float, default=30.0, bounds=SECONDS,
               into=("server.read_timeout",),
               help="seconds a client may take to send its request body (then 408); "
               "connections that send nothing are closed by --keep-alive-timeout"),
        Option("--send-timeout", type=float, default=30.0, bounds=ZERO_OK,
               into=(Into("server.send_timeout", _zero_is_none),),
               help="seconds a client may accept no bytes of its response (it stopped "
               "reading) before its connection is closed and its request aborted "
               "(0: never)"),
        Option("--backlog", type=int, default=2048, bounds=COUNT, into=("server.backlog",),
               help="listen backlog: connections the kernel queues before they are "
               "accepted (capped by net.core.somaxconn)"),
        Option("--health-port", type=int, metavar="PORT", bounds=PORT, child="supervisor",
               into=("server.health_port",),
               help="also answer /health and /ready on this port (same --host), on a "
               "listener of its own, so that probes never wait behind a burst of "
               "connects on the API port (0: a free port; default: none)"),
        Option("--max-connections", type=int, bounds=COUNT, into=("server.max_connections",),
               help="open connections beyond which a new one first closes the oldest "
               "idle keep-alive connection, else is answered 503 and closed (default: "
               "the file-descriptor limit, ulimit -n, less 128)"),
        Option("--allow-http-fallback", kind="switch", default=False,
               into=("server.allow_http_fallback",),
               help="when the installed hypercorn or h11 is not the exact version the "
               "server's own HTTP path was written for, serve through hypercorn's public "
               "serve() (slower; no connection limit, bounded writes or request-head "
               "checks; warned at every start, trio_llm:http_fallback in /metrics) "
               "instead of refusing to start"),
        Option("--log-level", default="info", choices=("debug", "info", "warning", "error"),
               help="least severe log lines written (info: one line per finished request)"),
        Option("--log-format", default="text", choices=("text", "json"),
               help="log lines as text, or as one JSON object per line (for Loki, "
               "Logstash); see docs/observability.md"),
        Option("--otlp-traces-endpoint", metavar="URL", into=("server.otlp_traces_endpoint",),
               help="send an OpenTelemetry span per generation request to this OTLP/HTTP "
               "endpoint (e.g. http://collector:4318/v1/traces; the client's traceparent "
               "is its parent); needs the [otel] extra"),
        Option("--disable-log-requests", kind="switch", default=False,
               help="no INFO line per finished request (a failed one is still logged, "
               "at WARNING)"),
    ),
    *_frontend(
        "access control",
        # (--api-key into: server.cli, with the environment; the supervisor of
        # --api-servers hands those keys to its frontends in their environment,
        # FRONTEND_KEYS_ENV, so that they are on no child's command line. A key file goes
        # to each frontend as its path: each reads it, and again when it changes)
        Option("--api-key", kind="append", metavar="KEY", child="supervisor",
               help="require 'Authorization: Bearer KEY' on every route (repeatable, "
               "or comma-separated; /health, /ready and /metrics stay open). None: the keys "
               f"in ${API_KEY_ENV} (comma-separated) if it is set; no key from either nor "
               "--api-key-file: no key is needed. A command line is visible to other users: "
               "prefer the variable or --api-key-file"),
        Option("--api-key-file", kind="append", metavar="PATH",
               into=(Into("server.api_key_files", _paths),),
               help="also accept each key in this file (repeatable): one per line; blank "
               "lines and lines starting with # are ignored; a key with inner whitespace, "
               "or a file with no key, is refused at start. Re-read when it changes, without "
               "a restart: a file then refused keeps the keys in force (in a restarted "
               "frontend of --api-servers too). Warned of if other users may read it "
               "(chmod 600 it)"),
        Option("--api-key-file-interval", type=float, default=10.0, bounds=SECONDS,
               metavar="SECONDS", into=("server.api_key_file_interval",),
               help="how often each --api-key-file is checked for a change (its time, size "
               "and inode: a Kubernetes secret's symlink swap too); a changed file is "
               "re-read, and in force once the next check reads the same keys (one to two "
               "intervals after its last write, so that a file read while being written is "
               "not taken); a key removed from it "
               "is refused from then on"),
        Option("--allowed-origins", kind="append", metavar="ORIGINS",
               into=(Into("server.allowed_origins", split_commas),),
               help="enable CORS for these browser origins (repeatable or comma-separated, "
               "e.g. https://app.example.com; '*' for any). None: CORS off"),
    ),
    *_frontend(
        "state (stored responses, files: docs/state.md)",
        Option("--state-store", kind="bool", default=True, into=("server.state_store",),
               help="keep state at all (--no-state-store: responses are not stored, "
               "'store': true is a 400 naming it, and /v1/files answers 503)"),
        Option("--state-dir", metavar="DIR", into=(Into("server.state_dir", _absolute),),
               help="keep the state in DIR/state.sqlite3 (SQLite, WAL), shared by every "
               "frontend given DIR, kept across restarts. None (and no --state-url): a "
               "private temporary directory, removed when the server exits"),
        Option("--state-url", metavar="URL", type=_postgres_url, into=("server.state_url",),
               help="keep the state in PostgreSQL at this postgresql:// URL instead (frontends "
               "on several hosts; the state-postgres extra). Put the password in PGPASSWORD "
               "or ~/.pgpass, not here"),
        Option("--state-retention", metavar="DURATION", type=duration, default=30 * 86400,
               into=("server.state_retention",),
               help="how long a stored object stays, in seconds or with s, m, h, d, w "
               "(30d: OpenAI's; 0: until deleted). Expired objects are gone at once"),
        Option("--state-max-bytes", metavar="SIZE", type=size, default=4 * 1024**3,
               into=("server.state_max_bytes",),
               help="the state's size budget (bytes, or with K, M, G, T; 0: none). A write "
               "past it, once expired objects are deleted, is refused (507); nothing live "
               "is evicted"),
        Option("--state-max-bytes-per-key", metavar="SIZE", type=size, default=0,
               into=("server.state_max_bytes_per_key",),
               help="each API key's share of the state (bytes, or with K, M, G, T; 0: no "
               "quota); a write past it is refused (413)"),
        Option("--max-batches-per-key", metavar="N", type=int, bounds=ZERO_OK, default=0,
               into=("server.max_batches_per_key",),
               help="the most unfinished batches (validating, in_progress, finalizing, "
               "cancelling) each API key may have, all frontends of the store together "
               "(0: no quota); a create past it is refused (429)"),
        Option("--max-background-responses", metavar="N", type=int, bounds=COUNT, default=64,
               into=("server.max_background_responses",),
               help="background responses ('background': true) this frontend runs at once; "
               "past it a new one is a 503 (docs/api.md)"),
        Option("--batch-concurrency", metavar="N", type=int, bounds=COUNT, default=8,
               into=("server.batch_concurrency",),
               help="Batch API lines this frontend runs at once, only while no interactive "
               "request waits (docs/batches.md)"),
    ),
    *ENGINE_OPTIONS,
    *_frontend(
        "remote workers",
        Option("--worker-address", kind="append", metavar="ADDRESS", child="supervisor",
               entry="model",
               help="connect to a worker started with 'python -m server.workers --listen "
               "ADDRESS' instead of spawning workers (repeatable: one per worker; "
               "HOST:PORT, [IPV6]:PORT or unix:/path; or every worker a DNS name gives, "
               "re-resolved as it changes: dns:NAME:PORT for its A/AAAA records, "
               "srv:NAME for its SRV records). The engine options are the "
               "worker's, not given here; see docs/scaling.md"),
        Option("--worker-secret-file", metavar="PATH", child="remote", entry="model",
               help="the shared secret of the remote workers, in a file (default: "
               f"${SECRET_ENV}); required by a worker that listens beyond loopback"),
        Option("--worker-tls-ca", metavar="PATH", child="remote", entry="model",
               into=("engine.worker_tls_ca",),
               help="connect to the remote workers over TLS, trusting the CA "
               "certificate(s) in this PEM file (the workers' --tls-cert must be "
               "issued for the host names or addresses given to --worker-address)"),
        Option("--dns-server", metavar="HOST:PORT", child="remote", entry="model",
               into=("engine.dns_server",),
               help="the DNS server asked for the workers of a dns: or srv: "
               "--worker-address; without it, the first nameserver of /etc/resolv.conf"),
        Option("--dns-min-interval", type=float, default=1.0, bounds=SECONDS,
               child="remote", entry="model", into=("engine.dns_min_interval",),
               metavar="SECONDS",
               help="the least time between two resolutions of a DNS-named worker "
               "address, however short its TTL or often its workers fail: the bound on "
               "how fast a flapping record changes the pool"),
        Option("--dns-max-interval", type=float, default=30.0, bounds=SECONDS,
               child="remote", entry="model", into=("engine.dns_max_interval",),
               metavar="SECONDS",
               help="the most time between two resolutions, however long the TTL"),
        Option("--dns-drain-grace", type=float, default=60.0, bounds=ZERO_OK,
               child="remote", entry="model", into=("engine.dns_drain_grace",),
               metavar="SECONDS",
               help="how long a worker whose address left DNS may finish its running "
               "requests (it gets no new ones); then they move to other workers"),
    ),
    *_frontend(
        "routing",
        Option("--routing", default="prefix", choices=tuple(POLICIES), entry="pool",
               into=("engine.routing",),
               help="how each request's engine worker is chosen: 'prefix' sends it to "
               "the worker predicted to hold most of its prompt in its prefix (KV) cache, "
               "unless that worker is too loaded (--routing-balance); 'least-loaded'; "
               "'round-robin'. See docs/routing.md"),
        Option("--routing-balance", type=int, default=DEFAULT_BALANCE, metavar="N",
               bounds=ZERO_OK, entry="pool", into=("engine.routing_balance",),
               help="prefix routing: the most extra outstanding requests the "
               "best-matching worker may carry over the least loaded one before the "
               "least loaded one gets the request (0: only an equally loaded worker)"),
        Option("--max-migrations", type=int, default=3, metavar="N", bounds=ZERO_OK,
               into=("engine.max_migrations",),
               help="when an engine worker dies or its connection ends, move each of "
               "its unfinished requests to another worker, which resumes it where it "
               "stopped (the client's stream goes on), at most N times per request; 0: "
               "those streams end with an error event. See docs/routing.md"),
    ),
    *_frontend(
        "several models",
        Option("--model-config", metavar="FILE",
               help="serve several models, each its own worker pool and engine, from "
               "this YAML (or JSON) file: 'models:', a list of mappings, each a 'name' "
               "and that model's options as keys (engine, model, sim-itl-ms, "
               "worker-address, max-concurrent-requests, ...). A request's 'model' picks "
               "its pool. The pool options given here (--routing, --max-restarts, "
               "--max-concurrent-*) are every model's default; the engine's are refused "
               "with it. See docs/operations.md"),
    ),
    *_frontend(
        "several frontends",
        Option(("--api-servers", "--api-server-count"), type=int, default=1, metavar="N",
               bounds=COUNT, child="supervisor",
               help="run N frontend processes serving the same port (SO_REUSEPORT) and "
               "sharing the engine workers, under a supervisor process (this one) that "
               "starts, restarts and stops them all; 1: one process serves HTTP itself "
               "(N > 1: Linux only; see docs/scaling.md)"),
        Option("--listen-fd", type=int, metavar="FD", bounds=ZERO_OK, child="supervisor",
               into=("server.listen_fd",),
               help="serve on this inherited listening socket (a file descriptor) instead "
               "of --host/--port (what the supervisor of --api-servers gives each "
               "frontend; also socket activation)"),
        Option("--health-listen-fd", type=int, metavar="FD", bounds=ZERO_OK, internal=True,
               child="supervisor", into=("server.health_listen_fd",),
               help="answer the probes of --health-port on this inherited listening socket "
               "(what the supervisor of --api-servers gives each frontend with "
               "--health-port)"),
        Option("--frontend-dir", metavar="DIR", internal=True, child="supervisor",
               into=("server.frontend_dir",),
               help="set by the supervisor of --api-servers: this process is one of its "
               "frontends, whose private sockets are in DIR; /metrics merges them all"),
        Option("--frontend-index", type=int, metavar="I", bounds=ZERO_OK, internal=True,
               child="supervisor", into=(Into("server.frontend_index", lambda i: i or 0),),
               help="set by the supervisor of --api-servers with --frontend-dir: this "
               "frontend's number (the 'frontend' label of its gauges in /metrics)"),
    ),
    *_frontend(
        "frontend",
        Option("--reasoning-parser", choices=("qwen3", "deepseek_r1"),
               into=("server.reasoning_parser",),
               help="split a reasoning model's <think>...</think> from its chat answers "
               "into reasoning_content (qwen3: when the answer opens with <think>; "
               "deepseek_r1: the answer starts in reasoning, up to </think>)"),
        Option("--enable-tokenizer-info-endpoint", kind="switch", default=False,
               into=("server.enable_tokenizer_info",),
               help="serve GET /tokenizer_info: the tokenizer's configuration, special "
               "tokens and chat template, as vLLM does (lm-eval reads the template there); "
               "off by default: it shows the template and configuration to any client "
               "with a key"),
        Option("--enable-force-include-usage", kind="switch", default=False,
               into=("limits.force_include_usage",),
               help="usage in every chunk of every stream and a usage chunk at its "
               "end, as if it asked with stream_options include_usage and "
               "continuous_usage_stats (vLLM's option)"),
        Option("--return-tokens-as-token-ids", kind="switch", default=False,
               into=("limits.tokens_as_ids",),
               help="logprobs' tokens spelled 'token_id:N' unless a request says "
               "otherwise with return_tokens_as_token_ids (vLLM's option)"),
        Option("--enable-server-load-tracking", kind="switch", default=False,
               help="vLLM's switch for GET /load (requests in flight): always served "
               "here; accepted for vLLM's command lines"),
        Option("--enable-auto-tool-choice", kind="switch", default=False,
               help="vLLM's switch for tool_choice auto: here --tool-call-parser alone "
               "serves it; accepted with one"),
        Option("--tool-call-parser", choices=tuple(TOOL_PARSERS),
               into=("server.tool_call_parser",),
               help="serve tool_choice auto: parse chat answers into tool_calls "
               "(hermes: <tool_call>{json}</tool_call>; llama3_json: {\"name\": ..., "
               "\"parameters\": ...} calls separated by ';'; mistral: [TOOL_CALLS] "
               "and a JSON array of calls); without it auto is refused (required, "
               "named functions, none and tool history need no parser)"),
    ),
    *_frontend(
        "image URLs (docs/media.md)",
        Option("--allowed-media-domains", kind="extend", nargs="+", metavar="DOMAIN",
               into=(Into("server.allowed_media_domains", _host_names),),
               help="fetch image URLs only from these host names (exact; several, "
               "repeatable or comma-separated); others are refused before any DNS "
               "look-up. None: any host whose addresses are all public"),
        Option("--allowed-local-media-path", metavar="DIR",
               into=(Into("server.allowed_local_media_path", _absolute),),
               help="read file:// image URLs under this directory only (symlinks resolved: "
               "one that points out is refused). None: file:// URLs are refused"),
        Option("--media-fetch-timeout", type=float, default=5.0, bounds=SECONDS,
               metavar="SECONDS", into=("server.media_fetch_timeout",),
               help="seconds one image URL's fetch may take, its wait for a slot "
               "(--max-media-fetches) and its redirects included; then a 400"),
        Option("--max-media-bytes", type=size, default=20 * 1024 * 1024, bounds=COUNT,
               metavar="SIZE", into=("server.max_media_bytes",),
               help="largest image a URL may give (bytes, or with K, M, G; decoded bytes "
               "for a data: URL); larger is a 400 at the first byte over"),
        Option("--max-media-fetches", type=int, default=16, bounds=COUNT, metavar="N",
               into=("server.max_media_fetches",),
               help="image URLs this frontend fetches at once; the others wait, within "
               "--media-fetch-timeout"),
        Option("--allow-private-media-addresses", kind="switch", default=False,
               into=("server.allow_private_media_addresses",),
               help="let the hosts of --allowed-media-domains (needed with it) resolve to "
               "loopback, private (RFC 1918, fc00::/7), link-local and CGNAT addresses (a "
               "trusted network, tests); cloud metadata, multicast and reserved addresses "
               "stay refused"),
    ),
    *_frontend(
        "limits and timeouts",
        Option("--max-concurrent-requests", type=int, bounds=COUNT, entry="pool",
               into=("server.max_concurrent_requests", "model.max_concurrent_requests"),
               help="requests in flight beyond which new ones get 503 with Retry-After"),
        Option("--max-concurrent-sequences", type=int, bounds=ZERO_OK, entry="pool",
               into=("server.max_concurrent_sequences", "model.max_concurrent_sequences"),
               help="sequences (prompts x n) in flight beyond which new requests get 503 "
               "with Retry-After; a request asking for more than this alone is a 400 "
               "(unset or 0: no limit; requests beyond what the workers run at once wait "
               "in the engine's queue, as vLLM's do)"),
        Option("--max-queue-time", type=float, metavar="SECONDS", bounds=ZERO_OK, entry="pool",
               into=(Into("server.max_queue_time", _zero_is_none), "model.max_queue_time"),
               help="a request that has not started (no output from the engine yet) "
               "this many seconds after it was queued is aborted and answered 503 "
               "server_overloaded with Retry-After (unset or 0: no limit, as vLLM)"),
        Option("--queued-heartbeat-s", type=float, default=15.0, bounds=ZERO_OK,
               into=(Into("server.queued_heartbeat", _zero_is_none),),
               help="a streaming request still queued after this many seconds starts its "
               "response and sends an SSE comment this often until its first token, so "
               "that proxies with read timeouts keep it (0: wait silently)"),
        Option("--request-timeout", type=float, bounds=SECONDS,
               into=("server.request_timeout",),
               help="seconds a request may run before the server aborts it"),
        Option("--shutdown-timeout", type=float, default=30.0, bounds=ZERO_OK,
               into=("server.shutdown_timeout",),
               help="on SIGTERM/SIGINT, seconds in-flight requests may keep streaming "
               "before they are aborted (0: abort at once)"),
        Option("--stream-interval-ms", type=float, default=0.0, bounds=ZERO_OK,
               into=(Into("engine.stream_interval", lambda ms: ms / 1000.0),),
               help="least time between two SSE events of one stream; tokens produced "
               "meanwhile go out merged in one event. 0 (default): an event per engine "
               "step while the client keeps up; a stream that falls behind gets what is "
               "pending merged into its next event. The first and last events are never "
               "delayed"),
        Option("--drain-timeout", type=float, default=1.0, bounds=ZERO_OK,
               into=("engine.drain_timeout",),
               help="after an abort, seconds a worker has to confirm before the stream "
               "is cut off"),
        Option("--max-body-bytes", type=int, default=4 * 1024 * 1024, bounds=COUNT,
               into=("server.max_body_bytes",), help="largest request body; larger is a 413"),
        Option("--max-file-bytes", type=int, default=200 * 1024 * 1024, bounds=COUNT,
               into=("server.max_file_bytes",),
               help="largest file a POST /v1/files upload may carry (OpenAI's batch file "
               "limit, 200 MB, by default); larger is a 413 at the first byte over"),
        Option("--max-n", type=int, default=16, bounds=COUNT, into=("limits.max_n",),
               help="largest 'n' accepted"),
        Option("--max-tokens-cap", type=int, default=32768, bounds=COUNT,
               into=("limits.max_tokens",), help="largest 'max_tokens' accepted"),
        Option("--max-prompts", type=int, default=64, bounds=COUNT,
               into=("limits.max_prompts",), help="most prompts in one completions request"),
        Option("--max-answer-logprobs", type=int, default=2**19, bounds=ZERO_OK,
               into=("limits.max_answer_logprobs",),
               help="most logprobs a non-streaming answer may be asked to hold: choices x "
               "max_tokens x (top_logprobs + 1); more is a 400 (0: no limit)"),
        Option("--heartbeat-timeout", type=float, default=10.0, bounds=SECONDS, entry="pool",
               into=("engine.heartbeat_timeout",),
               help="seconds a worker may leave pings unanswered before it is restarted"),
        Option("--max-restarts", type=int, default=5, bounds=ZERO_OK, entry="pool",
               child="supervisor", into=("engine.max_restarts",),
               help="most worker restarts within 60 s before the worker is restarted only "
               "every 5 s (an error logged), until it stays up for 60 s; never left down"),
    ),
)
