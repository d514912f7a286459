"""The option table (server.cli_options.OPTIONS) is what the parser, the configuration and
the supervisor's child command lines are made of (server.option_table)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from server.cli import build_parser, config_from_args
from server.cli_options import OPTIONS
from server.engine_args import ENGINE_OPTIONS, add_engine_arguments, engine_options, json_object
from server.option_table import Option, option_argv
from server.option_units import duration, size
from server.supervisor_plan import plan


def _group_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    return next(g.title for g in parser._action_groups if action in g._group_actions)


def _other_value(option: Option):
    """A value of ``option`` other than its default, one its parser reads back."""
    if option.kind == "switch":
        return True
    if option.kind == "bool":
        return False  # (--no-X)
    if option.kind in ("append", "extend"):
        return ["a=1", "b=2"]
    if option.choices:
        return next(c for c in reversed(option.choices) if c != option.default)
    if option.type in (int, duration, size):
        return (option.default or 0) + 2
    if option.type is json_object:
        return {"image": 3}
    if option.flag == "--state-url":
        return "postgresql://host/db"
    if option.type is float:
        return 0.5 if option.bounds and option.bounds.high == 1 else (option.default or 0) + 2.5
    return "text"


def _worker_parser():
    from server.workers.listen import build_parser as worker_parser

    return worker_parser()


@pytest.mark.parametrize("program", ["server", "listening worker"])
def test_the_parser_is_the_table(program):
    from server.workers.listen import LISTEN_OPTIONS

    if program == "server":
        parser, options = build_parser(), OPTIONS
    else:
        parser = _worker_parser()
        options = (*LISTEN_OPTIONS, *(o for o in ENGINE_OPTIONS if not o.spawned_only))
    actions = {a.dest: a for a in parser._actions}
    for option in options:
        action = actions.pop(option.dest)
        flags = () if option.positional else option.flags
        if option.kind == "bool":
            flags = (*flags, "--no-" + option.flag[2:])
        assert tuple(action.option_strings) == flags, option.flag
        assert action.default == option.default, option.flag
        assert action.choices == (list(option.choices) if option.choices else None)
        assert action.metavar == option.metavar and action.nargs == (
            0 if option.kind in ("switch", "bool") else
            "+" if option.kind == "extend" else option.nargs), option.flag
        assert action.help == (argparse.SUPPRESS if option.internal else option.help)
        assert _group_of(parser, action) == option.group, option.flag
        assert getattr(action.type, "bounds", None) == option.bounds, option.flag
        assert action.required == option.required, option.flag
    assert set(actions) == {"help"}  # (nothing but the table)


def test_a_listening_worker_takes_the_engine_options_but_the_spawned_ones():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, spawned=False)
    assert [a.dest for a in parser._actions if a.dest != "help"] == [
        o.dest for o in ENGINE_OPTIONS if not o.spawned_only]


def test_no_internal_flag_in_help_but_each_is_accepted():
    parser = build_parser()
    text = parser.format_help()
    internal = [o for o in OPTIONS if o.internal]
    assert {o.flag for o in internal} == {"--health-listen-fd", "--frontend-dir",
                                          "--frontend-index"}
    for option in internal:
        assert option.flag not in text
        value = _other_value(option)
        assert getattr(parser.parse_args(option_argv(option, value)), option.dest) == value


@pytest.mark.parametrize("option", [o for o in OPTIONS if not o.positional],
                         ids=lambda o: o.flag)
def test_each_value_is_written_back_as_the_parser_reads_it(option):
    value = _other_value(option)
    args = build_parser().parse_args(option_argv(option, value))
    expected = [value] if option.nargs == "+" and option.kind == "value" else value
    assert getattr(args, option.dest) == expected


def test_a_child_command_line_round_trips_to_the_same_config():
    parser = build_parser()
    given = [o for o in OPTIONS if o.child in ("frontend", "both", "worker")
             and not o.positional and o.group != "vllm engine" and o.dest not in (
                 "model_config", "engine", "model", "model_path", "revision", "device",
                 "dtype", "grammar_max_bytes", "grammar_timeout", "num_threads",
                 "sim_prefix_block_size", "state_dir", "state_store", "api_key_file",
                 "allowed_local_media_path")]
    # (files; another engine's; with the cache; not with --state-url)
    argv = ["--api-servers", "2", "--engine", "sim"]
    for option in given:
        argv += option_argv(option, _other_value(option))
    args = parser.parse_args(argv)
    config = config_from_args(args)
    children = plan(parser, args, python="py")

    front = children.frontend_argv(0, 5, "/d", ["unix:/d/w0"])
    again = config_from_args(parser.parse_args(front[3:]))
    # The frontend's configuration is the supervisor's, but for what it sets per frontend
    # and the engine, which runs in the workers.
    assert again.listen_fd == 5 and again.frontend_dir == "/d"
    assert replace(again, engine=config.engine, listen_fd=None, frontend_dir=None) == config
    pool = ("routing", "routing_balance", "max_migrations", "drain_timeout",
            "stream_interval", "heartbeat_timeout", "model")
    assert [getattr(again.engine, f) for f in pool] == [getattr(config.engine, f) for f in pool]

    worker = _worker_parser().parse_args(children.worker_argv("/d/w.sock")[3:])
    assert engine_options(worker, "w") == config.engine.engine_options
