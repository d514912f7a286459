"""What the supervisor of ``--api-servers N`` runs. Sans-IO.

``plan(args, parser, ...)`` splits the server's command line in two: the engine options go
to each worker (``python -m server.workers --listen unix:PATH ...``), the serving options to
each frontend (``python -m server --listen-fd FD --worker-address unix:PATH ...``). The split
is each option's ``child`` in its table (server.cli_options): the engine's options go to the
worker, the rest to the frontend, except those only the supervisor honours.
``--served-model-name`` and ``--sim-faults`` go to both (the served name; whether a
request's ``fault`` field is accepted). The API keys (``--api-key``'s, the variable's) go
to no child's command line: a command line is visible to every user of the host (``ps``).
The supervisor hands them to its frontends in their environment
(:data:`~server.cli_options.FRONTEND_KEYS_ENV`), visible only to their owner. A key file
goes as its absolute path: each frontend reads it, and re-reads it when it changes.

When a child that died is restarted is :class:`server.restarts.Restarts`' decision.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from .cli_options import OPTIONS
from .engine_args import resolve_model_args
from .option_table import Option, option_argv

__all__ = ["Plan", "SUPERVISOR_DESTS", "options_argv", "plan"]

#: Options the supervisor itself honours; they reach no child as given.
SUPERVISOR_DESTS = frozenset(o.dest for o in OPTIONS if o.child in ("supervisor", "remote"))


def options_argv(options: Iterable[Option], args: argparse.Namespace) -> list[str]:
    """The command-line options that give ``args``' values of ``options`` (only those that
    differ from their defaults), as their parser would read them back."""
    return [word for o in options if not o.positional and getattr(args, o.dest) != o.default
            for word in option_argv(o, getattr(args, o.dest))]


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
    remote = bool(getattr(args, "worker_address", None))
    frontend = ("frontend", "both", "remote") if remote else ("frontend", "both")
    return Plan(
        worker=[python, "-m", "server.workers",
                *options_argv((o for o in OPTIONS if o.child in ("worker", "both")), args)],
        frontend=[python, "-m", "server",
                  *options_argv((o for o in OPTIONS if o.child in frontend), args)],
    )

