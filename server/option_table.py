"""Command-line options as data: one :class:`Option` per option, and what is generated from
a table of them. Plain argparse; no trio, so that a worker starts fast.

Why: each option used to be written three times (an ``add_argument`` call, a field copied by
hand into the configuration, and the walks over argparse's private ``_actions`` that read a
``--model-config`` entry or wrote the supervisor's child command lines), and the copies
drifted. Now the table says once what an option is (:data:`server.cli_options.OPTIONS`,
:data:`server.engine_args.ENGINE_OPTIONS`), and these read it:

- :func:`add_options` builds the argparse parser (grouped help; an ``internal`` option is
  accepted but left out of ``--help``);
- :func:`config_fields` gives a configuration object's fields (``into``);
- :func:`option_argv` writes a value back as the flags that give it (the supervisor's
  children, server.supervisor_plan; a ``--model-config`` entry, server.model_config).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from .option_bounds import Bounds, checked

__all__ = ["Into", "Option", "add_options", "config_fields", "option_argv", "section"]

#: How an option is read: a value; a switch (``--x``, True); a switch with its negation
#: (``--x``/``--no-x``); repeatable (each a value); repeatable, several values each.
KINDS = ("value", "switch", "bool", "append", "extend")

#: Which process of ``--api-servers N`` an option goes to (server.supervisor_plan):
#: each frontend, each engine worker, both, only the supervisor, or (``remote``) each
#: frontend when the workers are remote (``--worker-address``), else the supervisor.
CHILDREN = ("frontend", "worker", "both", "supervisor", "remote")

#: What a model's entry of ``--model-config`` may hold (server.model_config): its own
#: option (``model``), a pool option whose command-line value is every model's default
#: (``pool``), or nothing (``none``).
ENTRIES = ("model", "pool", "none")


@dataclass(frozen=True)
class Into:
    """Where an option's value lands: ``path`` is ``"OBJECT.FIELD"`` (OBJECT: ``server``,
    ``limits``, ``engine`` or ``model``: :class:`server.config.ServerConfig`, ``Limits``,
    ``EngineConfig``, ``ModelConfig``), after ``convert`` if any."""

    path: str
    convert: Callable[[Any], Any] | None = None

    @property
    def target(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.path.split(".", 1)[1]


@dataclass(frozen=True)
class Option:
    """One command-line option. ``flags``: its spellings, the first the canonical one (a
    name without dashes: a positional). ``child`` and ``entry`` left None take their
    :func:`section`'s default."""

    flags: str | tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    kind: str = "value"
    nargs: str | None = None
    metavar: str | None = None
    required: bool = False
    #: Its range (a number out of it is argparse's one-line error naming the option).
    bounds: Bounds | None = None
    #: Set by one program for another (the supervisor for its frontends): out of --help.
    internal: bool = False
    group: str = ""
    #: Where its value goes (an :class:`Into`, or its path alone).
    into: tuple[Into | str, ...] = ()
    child: str | None = None
    entry: str | None = None
    #: The engine's own, only where the server spawns its workers (not a listening worker's).
    spawned_only: bool = False
    dest: str = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.flags, str):
            object.__setattr__(self, "flags", (self.flags,))
        long = [f for f in self.flags if f.startswith("--")] or list(self.flags)
        object.__setattr__(self, "dest", long[0].lstrip("-").replace("-", "_"))
        if self.kind not in KINDS:
            raise ValueError(f"{self.flags[0]}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def flag(self) -> str:
        return self.flags[0]

    @property
    def targets(self) -> tuple[Into, ...]:
        return tuple(Into(i) if isinstance(i, str) else i for i in self.into)

    @property
    def positional(self) -> bool:
        return not self.flag.startswith("-")

    def argparse_kwargs(self) -> dict[str, Any]:
        """What ``add_argument(*self.flags, ...)`` is given."""
        kwargs: dict[str, Any] = {
            "default": self.default,
            "help": argparse.SUPPRESS if self.internal else self.help,
        }
        if self.kind == "switch":
            kwargs["action"] = "store_true"
        elif self.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif self.kind in ("append", "extend"):
            kwargs["action"] = self.kind
        if self.type is not None:
            kwargs["type"] = checked(self.type, self.bounds) if self.bounds else self.type
        if self.choices is not None:
            kwargs["choices"] = list(self.choices)
        if self.nargs is not None:
            kwargs["nargs"] = self.nargs
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        if self.required:
            kwargs["required"] = True
        return kwargs


def section(group: str, *options: Option, **defaults: Any) -> tuple[Option, ...]:
    """``options`` in help group ``group``, each field of ``defaults`` (``child``,
    ``entry``) set where the option leaves it None."""
    return tuple(
        replace(o, group=group, **{k: v for k, v in defaults.items() if getattr(o, k) is None})
        for o in options
    )


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Add ``options`` to ``parser``, in their order, each in its help group (a group
    is made at its first option)."""
    groups: dict[str, Any] = {}
    for option in options:
        group = groups.get(option.group)
        if group is None:
            group = groups[option.group] = parser.add_argument_group(option.group)
        group.add_argument(*option.flags, **option.argparse_kwargs())


def config_fields(options: Iterable[Option], args: argparse.Namespace,
                  target: str) -> dict[str, Any]:
    """The fields of configuration object ``target`` (``server``, ``limits``, ``engine``,
    ``model``) that ``options`` fill, from the parsed ``args``."""
    out: dict[str, Any] = {}
    for option in options:
        for into in option.targets:
            if into.target == target:
                value = getattr(args, option.dest)
                out[into.field] = into.convert(value) if into.convert else value
    return out


def option_argv(option: Option, value: Any) -> list[str]:
    """The command-line words that give ``option`` the (parsed) ``value``, as its parser
    reads them back; [] for a switch that is off."""
    if option.kind in ("switch", "bool"):
        if value:
            return [option.flag]
        return ["--no-" + option.flag[2:]] if option.kind == "bool" else []
    if option.kind in ("append", "extend"):
        return [word for item in value for word in (option.flag, str(item))]
    if isinstance(value, dict):  # (a JSON object flag: --limit-mm-per-prompt)
        return [option.flag, json.dumps(value)]
    return [option.flag, str(value)]
