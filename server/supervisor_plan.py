"""What the supervisor of ``--api-servers N`` runs. Sans-IO.

``plan(args, parser, ...)`` splits the server's command line in two: the engine options go
to each worker (``python -m server.workers --listen unix:PATH ...``), the serving options to
each frontend (``python -m server --listen-fd FD --worker-address unix:PATH ...``). The split
follows the option's home: an option of :func:`server.engine_args.add_engine_arguments`
(as a listening worker takes them) belongs to the worker, the rest to the frontend, except
those only the supervisor honours (``SUPERVISOR_DESTS``). ``--served-model-name`` and
``--sim-faults`` go to both (the served name; whether a request's ``fault`` field is accepted).

When a child that died is restarted is :class:`server.restarts.Restarts`' decision.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from .engine_args import add_engine_arguments, resolve_model_args

__all__ = ["Plan", "SUPERVISOR_DESTS", "options_argv", "plan"]

#: Options the supervisor itself honours; they reach no child as given.
SUPERVISOR_DESTS = frozenset({
    "help", "api_servers", "host", "port", "engine_workers", "worker_startup_timeout",
    "devices_per_worker", "max_restarts", "listen_fd", "frontend_dir", "frontend_index",
    "health_port", "health_listen_fd",
    "worker_address", "worker_secret_file", "worker_tls_ca",
})

#: Engine options a frontend needs too.
_BOTH = frozenset({"served_model_name", "sim_faults"})


def _engine_dests() -> frozenset[str]:
    p = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(p, spawned=False)
    return frozenset(a.dest for a in p._actions)


def options_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, dests) -> list[str]:
    """The command-line options that give ``args``' values of ``dests`` (only those that
    differ from ``parser``'s defaults), as ``parser`` would read them back."""
    out: list[str] = []
    for action in parser._actions:
        if action.dest not in dests or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(option if value else "--no-" + option[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(option)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                out += [option, str(item)]
        else:
            out += [option, str(value)]
    return out


@dataclass(frozen=True)
class Plan:
    """The children's command lines (less what is per child)."""

    #: ``python -m server.workers`` and the engine options (``--listen`` is per worker).
    worker: list[str]
    #: ``python -m server`` and the serving options (``--listen-fd``, ``--frontend-dir``,
    #: ``--frontend-index`` and ``--worker-address`` are per frontend).
    frontend: list[str]

    def worker_argv(self, path: str) -> list[str]:
        return [*self.worker, "--listen", f"unix:{path}"]

    def frontend_argv(self, index: int, fd: int, directory: str, workers: list[str],
                      health_fd: int | None = None) -> list[str]:
        """``workers``: the addresses the frontend connects to (``unix:PATH`` of the
        supervisor's own workers, or the remote workers given to it); ``health_fd``: its
        socket of the probe port (``--health-port``), if any."""
        argv = [*self.frontend, "--listen-fd", str(fd), "--frontend-dir", directory,
                "--frontend-index", str(index)]
        if health_fd is not None:
            argv += ["--health-listen-fd", str(health_fd)]
        for address in workers:
            argv += ["--worker-address", address]
        return argv


def plan(parser: argparse.ArgumentParser, args: argparse.Namespace,
         python: str = sys.executable) -> Plan:
    """Split ``args`` (the server's, parsed by ``parser``) into the children's options
    (the model's names folded first, in place: a MODEL or ``--model`` reaches the children
    as ``--model-path`` or ``--served-model-name``)."""
    resolve_model_args(args, parser.prog)
    engine = _engine_dests() - SUPERVISOR_DESTS
    every = {a.dest for a in parser._actions}
    frontend = (every - engine - SUPERVISOR_DESTS) | _BOTH
    if getattr(args, "worker_address", None):  # remote workers: how to reach them
        frontend |= {"worker_secret_file", "worker_tls_ca"}
    return Plan(
        worker=[python, "-m", "server.workers", *options_argv(parser, args, engine)],
        frontend=[python, "-m", "server", *options_argv(parser, args, frontend)],
    )
