"""The command line: ``trio-llm-server`` and ``python -m server``.

Every option is documented here (``--help``) and in docs/cli.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import stat
import sys

import trio

from .config import EngineConfig, Limits, ModelConfig, ServerConfig
from .openai.tool_parsers import PARSERS as TOOL_PARSERS
from .engine_args import ENGINE_DESTS, add_engine_arguments, engine_options, resolve_model_args
from .manager.routing import DEFAULT_BALANCE, POLICIES
from .model_config import MAX_FILE_BYTES, MODEL_DESTS, model_argvs
from .option_bounds import bound_numbers
from .worker_protocol.handshake import SECRET_ENV, parse_address, read_secret
from .observability.logs import configure_logging, lean_log_records

__all__ = ["main", "build_parser", "config_from_args", "API_KEY_ENV"]

#: The environment variable read for API keys when ``--api-key`` is not given.
API_KEY_ENV = "TRIO_LLM_API_KEY"


def _split_commas(values: list[str] | None) -> tuple[str, ...]:
    """``["a,b", "c"]`` -> ``("a", "b", "c")``: repeated options, each possibly a list."""
    out: list[str] = []
    for value in values or ():
        out.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trio-llm-server",
        description="An OpenAI-compatible LLM server on Trio: SSE streaming, engine workers "
        "over pipes. Serves /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, "
        "/tokenize, "
        "/detokenize, /health, /ready and /metrics over HTTP/1.1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--keep-alive-timeout", type=float, default=30.0,
                   help="seconds an idle connection (nothing sent yet, or between requests) "
                   "stays open")
    g.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send its request body (then 408); "
                   "connections that send nothing are closed by --keep-alive-timeout")
    g.add_argument("--send-timeout", type=float, default=30.0,
                   help="seconds a client may accept no bytes of its response (it stopped "
                   "reading) before its connection is closed and its request aborted "
                   "(0: never)")
    g.add_argument("--backlog", type=int, default=2048,
                   help="listen backlog: connections the kernel queues before they are "
                   "accepted (capped by net.core.somaxconn)")
    g.add_argument("--health-port", type=int, default=None, metavar="PORT",
                   help="also answer /health and /ready on this port (same --host), on a "
                   "listener of its own, so that probes never wait behind a burst of "
                   "connects on the API port (0: a free port; default: none)")
    g.add_argument("--max-connections", type=int, default=None,
                   help="open connections beyond which a new one first closes the oldest "
                   "idle keep-alive connection, else is answered 503 and closed (default: "
                   "the file-descriptor limit, ulimit -n, less 128)")
    g.add_argument("--allow-http-fallback", action="store_true",
                   help="when the installed hypercorn or h11 is not the exact version the "
                   "server's own HTTP path was written for, serve through hypercorn's public "
                   "serve() (slower; no connection limit, bounded writes or request-head "
                   "checks; warned at every start, trio_llm:http_fallback in /metrics) "
                   "instead of refusing to start")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log lines written (info: one line per finished request)")
    g.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text, or as one JSON object per line (for Loki, "
                   "Logstash); see docs/observability.md")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send an OpenTelemetry span per generation request to this OTLP/HTTP "
                   "endpoint (e.g. http://collector:4318/v1/traces; the client's traceparent "
                   "is its parent); needs the [otel] extra")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no INFO line per finished request (a failed one is still logged, "
                   "at WARNING)")

    g = p.add_argument_group("access control")
    g.add_argument("--api-key", action="append", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on every route (repeatable, "
                   "or comma-separated; /health, /ready and /metrics stay open). None: the keys in "
                   f"${API_KEY_ENV} (comma-separated) if it is set, else no key is needed. "
                   "Prefer the variable: a command line is visible to other users")
    g.add_argument("--allowed-origins", action="append", metavar="ORIGINS", default=None,
                   help="enable CORS for these browser origins (repeatable or comma-separated, "
                   "e.g. https://app.example.com; '*' for any). None: CORS off")

    add_engine_arguments(p, spawned=True)
    g = p.add_argument_group("remote workers")
    g.add_argument("--worker-address", action="append", metavar="ADDRESS", default=None,
                   help="connect to a worker started with 'python -m server.workers --listen "
                   "ADDRESS' instead of spawning workers (repeatable: one per worker; "
                   "HOST:PORT, [IPV6]:PORT or unix:/path). The engine options are the "
                   "worker's, not given here; see docs/scaling.md")
    g.add_argument("--worker-secret-file", default=None, metavar="PATH",
                   help="the shared secret of the remote workers, in a file (default: "
                   f"${SECRET_ENV}); required by a worker that listens beyond loopback")
    g.add_argument("--worker-tls-ca", default=None, metavar="PATH",
                   help="connect to the remote workers over TLS, trusting the CA "
                   "certificate(s) in this PEM file (the workers' --tls-cert must be "
                   "issued for the host names or addresses given to --worker-address)")

    g = p.add_argument_group("routing")
    g.add_argument("--routing", default="prefix", choices=list(POLICIES),
                   help="how each request's engine worker is chosen: 'prefix' sends it to "
                   "the worker predicted to hold most of its prompt in its prefix (KV) cache, "
                   "unless that worker is too loaded (--routing-balance); 'least-loaded'; "
                   "'round-robin'. See docs/routing.md")
    g.add_argument("--routing-balance", type=int, default=DEFAULT_BALANCE, metavar="N",
                   help="prefix routing: the most extra outstanding requests the "
                   "best-matching worker may carry over the least loaded one before the "
                   "least loaded one gets the request (0: only an equally loaded worker)")
    g.add_argument("--max-migrations", type=int, default=3, metavar="N",
                   help="when an engine worker dies or its connection ends, move each of "
                   "its unfinished requests to another worker, which resumes it where it "
                   "stopped (the client's stream goes on), at most N times per request; 0: "
                   "those streams end with an error event. See docs/routing.md")

    g = p.add_argument_group("several models")
    g.add_argument("--model-config", default=None, metavar="FILE",
                   help="serve several models, each its own worker pool and engine, from "
                   "this YAML (or JSON) file: 'models:', a list of mappings, each a 'name' "
                   "and that model's options as keys (engine, model, sim-itl-ms, "
                   "worker-address, max-concurrent-requests, ...). A request's 'model' picks "
                   "its pool. The pool options given here (--routing, --max-restarts, "
                   "--max-concurrent-*) are every model's default; the engine's are refused "
                   "with it. See docs/operations.md")

    g = p.add_argument_group("several frontends")
    g.add_argument("--api-servers", "--api-server-count", type=int, default=1, metavar="N",
                   help="run N frontend processes serving the same port (SO_REUSEPORT) and "
                   "sharing the engine workers, under a supervisor process (this one) that "
                   "starts, restarts and stops them all; 1: one process serves HTTP itself "
                   "(N > 1: Linux only; see docs/scaling.md)")
    g.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                   help="serve on this inherited listening socket (a file descriptor) instead "
                   "of --host/--port (what the supervisor of --api-servers gives each "
                   "frontend; also socket activation)")
    g.add_argument("--health-listen-fd", type=int, default=None, metavar="FD",
                   help="answer the probes of --health-port on this inherited listening socket "
                   "(what the supervisor of --api-servers gives each frontend with "
                   "--health-port)")
    g.add_argument("--frontend-dir", default=None, metavar="DIR",
                   help="set by the supervisor of --api-servers: this process is one of its "
                   "frontends, whose private sockets are in DIR; /metrics merges them all")
    g.add_argument("--frontend-index", type=int, default=None, metavar="I",
                   help="set by the supervisor of --api-servers with --frontend-dir: this "
                   "frontend's number (the 'frontend' label of its gauges in /metrics)")

    g = p.add_argument_group("frontend")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split a reasoning model's <think>...</think> from its chat answers "
                   "into reasoning_content (qwen3: when the answer opens with <think>; "
                   "deepseek_r1: the answer starts in reasoning, up to </think>)")

    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's configuration, special "
                   "tokens and chat template, as vLLM does (lm-eval reads the template there); "
                   "off by default: it shows the template and configuration to any client "
                   "with a key")

    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="usage in every chunk of every stream and a usage chunk at its "
                   "end, as if it asked with stream_options include_usage and "
                   "continuous_usage_stats (vLLM's option)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs' tokens spelled 'token_id:N' unless a request says "
                   "otherwise with return_tokens_as_token_ids (vLLM's option)")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="vLLM's switch for GET /load (requests in flight): always served "
                   "here; accepted for vLLM's command lines")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto: here --tool-call-parser alone "
                   "serves it; accepted with one")
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                   help="serve tool_choice auto: parse chat answers into tool_calls "
                   "(hermes: <tool_call>{json}</tool_call>; llama3_json: {\"name\": ..., "
                   "\"parameters\": ...} calls separated by ';'; mistral: [TOOL_CALLS] "
                   "and a JSON array of calls); without it auto is refused (required, "
                   "named functions, none and tool history need no parser)")

    g = p.add_argument_group("limits and timeouts")
    g.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="requests in flight beyond which new ones get 503 with Retry-After")
    g.add_argument("--max-concurrent-sequences", type=int, default=None,
                   help="sequences (prompts x n) in flight beyond which new requests get 503 "
                   "with Retry-After; a request asking for more than this alone is a 400 "
                   "(unset or 0: no limit; requests beyond what the workers run at once wait "
                   "in the engine's queue, as vLLM's do)")
    g.add_argument("--max-queue-time", type=float, default=None, metavar="SECONDS",
                   help="a request that has not started (no output from the engine yet) "
                   "this many seconds after it was queued is aborted and answered 503 "
                   "server_overloaded with Retry-After (unset or 0: no limit, as vLLM)")
    g.add_argument("--queued-heartbeat-s", type=float, default=15.0,
                   help="a streaming request still queued after this many seconds starts its "
                   "response and sends an SSE comment this often until its first token, so "
                   "that proxies with read timeouts keep it (0: wait silently)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may run before the server aborts it")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may keep streaming "
                   "before they are aborted (0: abort at once)")
    g.add_argument("--stream-interval-ms", type=float, default=0.0,
                   help="least time between two SSE events of one stream; tokens produced "
                   "meanwhile go out merged in one event. 0 (default): an event per engine "
                   "step while the client keeps up; a stream that falls behind gets what is "
                   "pending merged into its next event. The first and last events are never "
                   "delayed")
    g.add_argument("--drain-timeout", type=float, default=1.0,
                   help="after an abort, seconds a worker has to confirm before the stream "
                   "is cut off")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body; larger is a 413")
    g.add_argument("--max-n", type=int, default=16, help="largest 'n' accepted")
    g.add_argument("--max-tokens-cap", type=int, default=32768, help="largest 'max_tokens' accepted")
    g.add_argument("--max-prompts", type=int, default=64, help="most prompts in one completions request")
    g.add_argument("--max-answer-logprobs", type=int, default=2**19,
                   help="most logprobs a non-streaming answer may be asked to hold: choices x "
                   "max_tokens x (top_logprobs + 1); more is a 400 (0: no limit)")
    g.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds a worker may leave pings unanswered before it is restarted")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="most worker restarts within 60 s before the worker is restarted only "
                   "every 5 s (an error logged), until it stays up for 60 s; never left down")
    bound_numbers(p)  # (each numeric option's range: server.option_bounds)
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from its parsed command line (which this normalizes in
    place: the model's names, see :func:`~server.engine_args.resolve_model_args`)."""
    models: tuple[ModelConfig, ...] = ()
    allow_faults = args.sim_faults
    if args.model_config is not None:
        _check_frontend_options(args)
        models = _models_from_file(args)
        engine = EngineConfig()
        allow_faults = any(m.engine.engine_options.get("faults") for m in models)
    else:
        resolve_model_args(args, "trio-llm-server")
        _check_frontend_options(args)
        engine = _engine_config(args, "trio-llm-server")
    limits = Limits(
        max_n=args.max_n,
        max_tokens=args.max_tokens_cap,
        max_prompts=args.max_prompts,
        max_answer_logprobs=args.max_answer_logprobs,
        allow_faults=allow_faults,
        force_include_usage=args.enable_force_include_usage,
        tokens_as_ids=args.return_tokens_as_token_ids,
    )
    api_keys = _split_commas(args.api_key)
    if not api_keys:
        api_keys = _split_commas([os.environ.get(API_KEY_ENV, "")])
    return ServerConfig(
        engine=engine,
        models=models,
        host=args.host,
        port=args.port,
        limits=limits,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_sequences=args.max_concurrent_sequences,
        max_queue_time=args.max_queue_time or None,
        queued_heartbeat=args.queued_heartbeat_s or None,
        backlog=args.backlog,
        health_port=args.health_port,
        health_listen_fd=args.health_listen_fd,
        max_connections=args.max_connections,
        allow_http_fallback=args.allow_http_fallback,
        shutdown_timeout=args.shutdown_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        read_timeout=args.read_timeout,
        send_timeout=args.send_timeout or None,
        api_keys=api_keys,
        allowed_origins=_split_commas(args.allowed_origins),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        listen_fd=args.listen_fd,
        frontend_dir=args.frontend_dir,
        frontend_index=args.frontend_index or 0,
    )


def _read_config_file(path: str, prog: str) -> str:
    """The text of a configuration file: a regular file (a FIFO would hang the start, a
    device such as /dev/zero never end) of at most MAX_FILE_BYTES, in UTF-8; SystemExit
    with one line naming the file otherwise."""
    try:
        # (O_NONBLOCK: opening a FIFO waits for a writer otherwise; the file is then
        # checked through the descriptor opened, not by its name before)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SystemExit(f"{prog}: not a regular file")
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SystemExit(f"{prog}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SystemExit(f"{prog}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SystemExit(f"{prog}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _models_from_file(args: argparse.Namespace) -> tuple[ModelConfig, ...]:
    """Each model of ``--model-config``: its options parsed over the command line's (its
    pool options the defaults; its model options refused there), checked as the command
    line's are; SystemExit with one line naming the file, the model and the option."""
    prog = f"trio-llm-server: {args.model_config}"
    parser = build_parser()
    given = ["--" + d.replace("_", "-") for d in (*MODEL_DESTS, "served_model_name")
             if getattr(args, d) != parser.get_default(d)]
    if args.model_tag is not None:
        given.insert(0, "MODEL")
    if given:
        raise SystemExit(f"trio-llm-server: {', '.join(given)}: not with --model-config: "
                         "give each model's in its entry of the file")
    text = _read_config_file(args.model_config, prog)

    def refuse(message: str):
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]  # (a one-line error, not usage)
    try:
        entries = model_argvs(text, parser)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    models = []
    for i, (name, argv) in enumerate(entries):
        where = f"{prog}: models[{i}] ({name})"
        ns = argparse.Namespace(**vars(args))
        for dest in (*MODEL_DESTS, "served_model_name", "model_tag"):
            delattr(ns, dest)  # (the parser's defaults, then the entry's)
        try:
            parser.parse_args(argv, namespace=ns)
        except ValueError as exc:
            raise SystemExit(f"{where}: {exc}") from None
        if ns.worker_address and not any(o.startswith("--max-restarts=") for o in argv):
            ns.max_restarts = parser.get_default("max_restarts")  # (a spawned pool's default)
        resolve_model_args(ns, where)
        models.append(ModelConfig(_engine_config(ns, where), ns.max_concurrent_requests,
                                  ns.max_concurrent_sequences, ns.max_queue_time))
    return tuple(models)


def _engine_config(args: argparse.Namespace, prog: str) -> EngineConfig:
    """One model's engine and worker pool from its (resolved) options."""
    remote = _remote_workers(args, prog)
    options = {} if remote else engine_options(args, prog)
    startup = args.worker_startup_timeout
    if startup is None:
        startup = 1800.0 if args.engine == "vllm" else 120.0
    engine = EngineConfig(
        engine=args.engine,
        model=args.served_model_name,
        workers=len(remote) if remote else args.engine_workers,
        worker_addresses=remote,
        worker_secret=_worker_secret(args, prog) if remote else None,
        worker_tls_ca=args.worker_tls_ca,
        startup_timeout=startup,
        devices_per_worker=args.devices_per_worker,
        engine_options=options,
        drain_timeout=args.drain_timeout,
        stream_interval=args.stream_interval_ms / 1000.0,
        heartbeat_timeout=args.heartbeat_timeout,
        max_restarts=args.max_restarts,
        routing=args.routing,
        routing_balance=args.routing_balance,
        max_migrations=args.max_migrations,
    )
    if args.routing_balance < 0:
        raise SystemExit(f"{prog}: --routing-balance must be at least 0")
    if args.max_migrations < 0:
        raise SystemExit(f"{prog}: --max-migrations must be at least 0")
    if args.devices_per_worker is not None:
        if args.devices_per_worker < 1:
            raise SystemExit(f"{prog}: --devices-per-worker must be at least 1")
        try:
            engine.for_worker(engine.workers - 1).visible_devices()
        except ValueError as exc:
            raise SystemExit(f"{prog}: --devices-per-worker: {exc}") from None
    return engine


def _check_frontend_options(args: argparse.Namespace) -> None:
    """Refuse the combinations of --api-servers, --listen-fd and the group options that
    could not be honoured (one line each)."""
    parser = build_parser()
    if args.api_servers < 1:
        raise SystemExit("trio-llm-server: --api-servers must be at least 1")
    if args.api_servers > 1 and args.model_config is not None:
        raise SystemExit("trio-llm-server: --model-config: not with --api-servers (yet): "
                         "its frontends share one model's workers")
    if args.api_servers > 1:
        for name in ("listen_fd", "health_listen_fd", "frontend_dir", "frontend_index"):
            if getattr(args, name) is not None:
                raise SystemExit(
                    f"trio-llm-server: --{name.replace('_', '-')} is not an option of "
                    "--api-servers: the supervisor opens the listening sockets and starts "
                    "the frontends itself"
                )
        if getattr(args, "allow_runtime_lora", None):
            raise SystemExit(
                "trio-llm-server: --allow-runtime-lora is not an option of --api-servers: "
                "each frontend keeps its own table of adapters loaded at run time (give the "
                "adapters with --lora-modules)"
            )
    if args.listen_fd is not None:
        given = [f"--{n}" for n in ("host", "port") if getattr(args, n) != parser.get_default(n)]
        if given:
            raise SystemExit(
                f"trio-llm-server: {' and '.join(given)}: not with --listen-fd (the inherited "
                "socket is already bound)"
            )
        if args.listen_fd < 0:
            raise SystemExit("trio-llm-server: --listen-fd must be a file descriptor")
    if args.health_port is not None and args.health_port == args.port != 0:
        raise SystemExit("trio-llm-server: --health-port must differ from --port")
    if args.health_listen_fd is not None:
        if args.health_port is not None:
            raise SystemExit("trio-llm-server: --health-port: not with --health-listen-fd "
                             "(the inherited socket is the probe port)")
        if args.health_listen_fd < 0:
            raise SystemExit("trio-llm-server: --health-listen-fd must be a file descriptor")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("trio-llm-server: --enable-auto-tool-choice needs --tool-call-parser")
    if (args.frontend_dir is None) != (args.frontend_index is None):
        raise SystemExit("trio-llm-server: --frontend-dir and --frontend-index go together")


#: Options about spawned workers only, besides the engine's own (ENGINE_DESTS).
_SPAWNED_ONLY = ("max_restarts",)


def _remote_default(parser: argparse.ArgumentParser, dest: str):
    """An option's value when not given to a server of remote workers (its engine: sim,
    the engine chosen when no model is named; the workers' own is theirs)."""
    return "sim" if dest == "engine" else parser.get_default(dest)


def _remote_workers(args: argparse.Namespace, prog: str) -> tuple:
    """The parsed ``--worker-address`` list (empty: spawn the workers). With remote
    workers, an option that configures the engine or spawned workers is refused (named),
    rather than ignored: it belongs on the worker's command line."""
    if not args.worker_address:
        for name in ("worker_secret_file", "worker_tls_ca"):
            if getattr(args, name) is not None:
                raise SystemExit(
                    f"{prog}: --{name.replace('_', '-')} is an option of remote "
                    "workers: give --worker-address too"
                )
        return ()
    parser = build_parser()
    given = [
        "--" + dest.replace("_", "-")
        for dest in ENGINE_DESTS + _SPAWNED_ONLY
        if dest != "sim_faults" and getattr(args, dest) != _remote_default(parser, dest)
    ]
    if given:
        raise SystemExit(
            f"{prog}: {', '.join(given)}: not with --worker-address: these "
            "configure the engine or spawned workers, and the engine runs in the remote "
            "workers (give its options to 'python -m server.workers --listen')"
        )
    try:
        return tuple(parse_address(a) for a in _split_commas(args.worker_address))
    except ValueError as exc:
        raise SystemExit(f"{prog}: --worker-address {exc}") from None


def _worker_secret(args: argparse.Namespace, prog: str) -> bytes | None:
    try:
        return read_secret(args.worker_secret_file)
    except ValueError as exc:
        raise SystemExit(f"{prog}: the workers' secret: {exc}") from None


def _own_logging(args: argparse.Namespace) -> None:
    """The CLI owns its process's logging: only our handler on the root logger, and lean
    records (what a library call of configure_logging leaves alone)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    lean_log_records()
    configure_logging(args.log_level, args.log_format, sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    _own_logging(args)
    if args.api_servers > 1:
        from .supervisor import supervise

        raise SystemExit(supervise(args, config))
    if args.disable_log_requests:
        logging.getLogger("server.request").setLevel(logging.WARNING)
    if config.api_keys:
        logging.getLogger("server").info(
            "API keys required (%d key(s)); /health, /ready and /metrics are open",
            len(config.api_keys),
        )
    from .http.app import create_app
    from .http.serve import serve
    from .connections.accept import ListenError
    from .connections.private_api import HTTPPathError
    from .manager.worker import WorkerStartupError

    app = create_app(config)
    # The CLI owns the process: it takes the signals, tunes and watches the collector, and
    # listens at once (answering 503 until the workers are up, for readiness probes).
    run = functools.partial(
        serve, config, app=app, handle_signals=True, tune_gc=True, gc_metrics=True,
        wait_ready=False, exit_when_stuck=True,
    )
    failures: list[BaseException] = []
    try:
        trio.run(run)
    except* (WorkerStartupError, ListenError, HTTPPathError) as group:  # (grouped by the nurseries)
        failures = _leaves(group)
    if failures:  # configuration errors: one line each, no traceback
        for exc in failures:
            print(f"trio-llm-server: {exc}", file=sys.stderr)
        raise SystemExit(1)


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for exc in group.exceptions for leaf in _leaves(exc)]
    return [group]


if __name__ == "__main__":  # pragma: no cover
    main()
