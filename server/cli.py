"""The command line: ``trio-llm-server`` and ``python -m server``.

Every option is an entry of server.cli_options' table (its ``--help``), which the parser and
the configuration are made from, and is documented in docs/cli.md. What is left here is
what no single option says: the checks across options, the models of ``--model-config``,
and the start.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import stat
import sys

import trio

from .cli_options import (API_KEY_ENV, FRONTEND_FILE_KEYS_ENV, FRONTEND_KEYS_ENV, OPTIONS,
                          split_commas)
from .config import EngineConfig, Limits, ModelConfig, ServerConfig
from .key_file import loose_permissions, parse_key_file
from .media.policy import policy_from_config
from .engine_args import ENGINE_DESTS, engine_options, resolve_model_args
from .model_config import MAX_FILE_BYTES, model_argvs
from .option_table import add_options, config_fields
from .text_files import read_text_file
from .discovery.names import parse_worker_address
from .worker_protocol.handshake import read_secret
from .observability.logs import configure_logging, lean_log_records

__all__ = ["main", "build_parser", "config_from_args", "API_KEY_ENV"]

#: Each option's default.
_DEFAULTS = {o.dest: o.default for o in OPTIONS}
#: The options that say what a model is and where it runs: a --model-config entry's own,
#: never the command line's with --model-config.
_MODEL_DESTS = tuple(o.dest for o in OPTIONS if o.entry == "model")


def build_parser() -> argparse.ArgumentParser:
    """The parser of :data:`~server.cli_options.OPTIONS`, in their groups."""
    p = argparse.ArgumentParser(
        prog="trio-llm-server",
        description="An OpenAI-compatible LLM server on Trio: SSE streaming, engine workers "
        "over pipes. Serves /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, "
        "/tokenize, "
        "/detokenize, /health, /ready and /metrics over HTTP/1.1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_options(p, OPTIONS)
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
    limits = Limits(allow_faults=allow_faults, **config_fields(OPTIONS, args, "limits"))
    config = ServerConfig(engine=engine, models=models, limits=limits,
                          api_keys=_api_keys(args), api_key_files_handed=_handed_keys(args),
                          **config_fields(OPTIONS, args, "server"))
    try:
        policy_from_config(config)  # (the image URL options: refused at start, not per fetch)
    except ValueError as exc:
        raise SystemExit(f"trio-llm-server: {exc}") from None
    return config


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys of ``--api-key`` (without it, ``$TRIO_LLM_API_KEY``'s), each once. Each
    ``--api-key-file`` is read here too, only to refuse a bad one at start: a SystemExit
    with one line naming it (and the line: never a key). The app reads the files itself
    and again when they change (:mod:`server.http.key_files`). A frontend of
    ``--api-servers`` takes its supervisor's ``--api-key`` keys (``FRONTEND_KEYS_ENV``) and
    reads the files in its app: the supervisor checked them at its start. A frontend
    restarted while one is refused takes the supervisor's keys in force (:func:`_handed_keys`)."""
    if args.frontend_dir is not None:
        return tuple(filter(None, os.environ.get(FRONTEND_KEYS_ENV, "").split("\n")))
    keys = split_commas(args.api_key) or split_commas([os.environ.get(API_KEY_ENV, "")])
    for path in args.api_key_file or ():
        prog = f"trio-llm-server: --api-key-file {path}"
        try:
            parse_key_file(_read_config_file(path, prog))
        except ValueError as exc:
            raise SystemExit(f"{prog}: {exc}") from None
    return tuple(dict.fromkeys(keys))


def _handed_keys(args: argparse.Namespace) -> tuple[str, ...] | None:
    """A restarted frontend of ``--api-servers``: the key files' keys in force at its
    supervisor (``FRONTEND_FILE_KEYS_ENV``), its keys while a file is refused. None on a
    first start and for a server on its own: a refused file stops them."""
    if args.frontend_dir is None or FRONTEND_FILE_KEYS_ENV not in os.environ:
        return None
    return tuple(filter(None, os.environ[FRONTEND_FILE_KEYS_ENV].split("\n")))


def _warn_of_key_files(args: argparse.Namespace) -> None:
    """One warning per ``--api-key-file`` that users other than its owner may read (or
    others change), as ssh warns of a private key's. Not from the frontends of
    ``--api-servers``: their supervisor warned."""
    if args.frontend_dir is not None:
        return
    for path in args.api_key_file or ():
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # (it was read a moment ago; gone now: the start says so)
        if loose_permissions(mode):
            logging.getLogger("server").warning(
                "--api-key-file %s: other users may read or change it (mode %04o); "
                "chmod 600 it", path, stat.S_IMODE(mode))


def _read_config_file(path: str, prog: str) -> str:
    """The text of a configuration file (:func:`~server.text_files.read_text_file`, at most
    MAX_FILE_BYTES); SystemExit with one line naming the file otherwise."""
    try:
        return read_text_file(path, MAX_FILE_BYTES)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None


def _models_from_file(args: argparse.Namespace) -> tuple[ModelConfig, ...]:
    """Each model of ``--model-config``: its options parsed over the command line's (its
    pool options the defaults; its model options refused there), checked as the command
    line's are; SystemExit with one line naming the file, the model and the option."""
    prog = f"trio-llm-server: {args.model_config}"
    parser = build_parser()
    given = ["--" + d.replace("_", "-") for d in (*_MODEL_DESTS, "served_model_name")
             if getattr(args, d) != _DEFAULTS[d]]
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
        entries = model_argvs(text, OPTIONS)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    models = []
    for i, (name, argv) in enumerate(entries):
        where = f"{prog}: models[{i}] ({name})"
        ns = argparse.Namespace(**vars(args))
        for dest in (*_MODEL_DESTS, "served_model_name", "model_tag"):
            delattr(ns, dest)  # (the parser's defaults, then the entry's)
        try:
            parser.parse_args(argv, namespace=ns)
        except ValueError as exc:
            raise SystemExit(f"{where}: {exc}") from None
        if ns.worker_address and not any(o.startswith("--max-restarts=") for o in argv):
            ns.max_restarts = _DEFAULTS["max_restarts"]  # (a spawned pool's default)
        resolve_model_args(ns, where)
        models.append(ModelConfig(_engine_config(ns, where),
                                  **config_fields(OPTIONS, ns, "model")))
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
        startup_timeout=startup,
        engine_options=options,
        **config_fields(OPTIONS, args, "engine"),
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
        given = [f"--{n}" for n in ("host", "port") if getattr(args, n) != _DEFAULTS[n]]
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
    if args.state_dir is not None and args.state_url is not None:
        raise SystemExit("trio-llm-server: --state-dir: not with --state-url (the state lives "
                         "in one place: SQLite in the directory, or PostgreSQL)")
    if not args.state_store and (args.state_dir is not None or args.state_url is not None):
        flag = "--state-dir" if args.state_dir is not None else "--state-url"
        raise SystemExit(f"trio-llm-server: {flag}: not with --no-state-store")
    if (args.frontend_dir is None) != (args.frontend_index is None):
        raise SystemExit("trio-llm-server: --frontend-dir and --frontend-index go together")


#: Options about spawned workers only, besides the engine's own (ENGINE_DESTS).
_SPAWNED_ONLY = ("max_restarts",)


def _remote_default(dest: str):
    """An option's value when not given to a server of remote workers (its engine: sim,
    the engine chosen when no model is named; the workers' own is theirs)."""
    return "sim" if dest == "engine" else _DEFAULTS[dest]


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
        for name in ("dns_server", "dns_min_interval", "dns_max_interval", "dns_drain_grace"):
            if getattr(args, name) != _DEFAULTS[name]:
                raise SystemExit(f"{prog}: --{name.replace('_', '-')} is an option of workers "
                                 "found by DNS: give --worker-address dns:... or srv:...")
        return ()
    given = [
        "--" + dest.replace("_", "-")
        for dest in ENGINE_DESTS + _SPAWNED_ONLY
        if dest != "sim_faults" and getattr(args, dest) != _remote_default(dest)
    ]
    if given:
        raise SystemExit(
            f"{prog}: {', '.join(given)}: not with --worker-address: these "
            "configure the engine or spawned workers, and the engine runs in the remote "
            "workers (give its options to 'python -m server.workers --listen')"
        )
    try:
        return tuple(parse_worker_address(a) for a in split_commas(args.worker_address))
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
    _warn_of_key_files(args)
    if args.api_servers > 1:
        from .supervisor import supervise

        raise SystemExit(supervise(args, config))
    if args.disable_log_requests:
        logging.getLogger("server.request").setLevel(logging.WARNING)
    from .http.app import create_app
    from .http.key_files import KeyFileError
    from .http.serve import serve
    from .connections.accept import ListenError
    from .connections.private_api import HTTPPathError
    from .manager.worker import WorkerStartupError
    from .state import StateStoreError

    try:
        app = create_app(config)
    except KeyFileError as refused:  # (a file broken since the check; a first start)
        raise SystemExit(f"trio-llm-server: {refused}") from None
    if app.api_keys is not None:
        logging.getLogger("server").info(
            "API keys required (%d key(s)); /health, /ready and /metrics are open",
            len(app.api_keys),
        )
    # The CLI owns the process: it takes the signals, tunes and watches the collector, and
    # listens at once (answering 503 until the workers are up, for readiness probes).
    run = functools.partial(
        serve, config, app=app, handle_signals=True, tune_gc=True, gc_metrics=True,
        wait_ready=False, exit_when_stuck=True,
    )
    failures: list[BaseException] = []
    try:
        trio.run(run)
    except* (WorkerStartupError, ListenError, HTTPPathError,
             StateStoreError) as group:  # (grouped by the nurseries)
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
