"""``--model-config FILE``: the models of a server that serves several, read from YAML (or
JSON, which YAML reads too). Sans-IO: the file's text in, each model's command-line options
out, which the CLI parses and checks as it does its own (server.cli).

The file::

    models:
      - name: small                # the name clients give (required, distinct)
        engine: sim
        sim-itl-ms: 4
        engine-workers: 2
        max-concurrent-requests: 64
        max-queue-time: 30
      - name: large
        engine: vllm
        model: /models/Qwen3-8B
        engine-arg: {enforce_eager: true}
      - name: remote
        worker-address: [10.0.0.5:9000, 10.0.0.6:9000]

A model's keys are the server's options of one model (:data:`MODEL_DESTS`: the engine, its
workers, remote workers) and of its pool (:data:`POOL_DESTS`: routing, admission limits,
restarts), dashes or underscores, without ``--``. A pool option given on the command line
is every model's default; a model option there is refused (which model would it be?).
Values: a string or number (``--key=VALUE``), a boolean for a switch, a list for a
repeatable option, a mapping for ``engine-arg`` (``KEY=VALUE`` each, non-strings as JSON).
Anything else is refused, naming the model and the key.
"""

from __future__ import annotations

import argparse
import json

import yaml

from .engine_args import ENGINE_DESTS

__all__ = ["MAX_FILE_BYTES", "MAX_VALUES", "MODEL_DESTS", "POOL_DESTS", "model_argvs"]

#: The largest --model-config file read (a configuration of many models is a few KiB).
MAX_FILE_BYTES = 1 << 20

#: The options that say what a model is and where it runs: a model's own, never the
#: command line's with --model-config.
MODEL_DESTS = (
    *(d for d in ENGINE_DESTS if d != "sim_faults"),
    "model", "worker_address", "worker_secret_file", "worker_tls_ca",
)
#: The options of a model's pool: the command line's value is each model's default.
POOL_DESTS = (
    "routing", "routing_balance", "max_restarts", "heartbeat_timeout",
    "max_concurrent_requests", "max_concurrent_sequences", "max_queue_time", "sim_faults",
)


def model_argvs(text: str, parser: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    """Each model's (name, options as a command line for ``parser``) of a --model-config
    file's text, in the file's order. ValueError naming the field for what is wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML or JSON: {exc}") from None
    _check_expansion(data)
    if not isinstance(data, dict) or set(data) != {"models"}:
        raise ValueError("the file must be a mapping with one key, 'models': a list of "
                         "models")
    models = data["models"]
    if not isinstance(models, list) or not models:
        raise ValueError("'models' must be a list of one model or more")
    allowed = set(MODEL_DESTS + POOL_DESTS)
    actions = {  # every spelling of an allowed option (--max-num-seqs is --max-batch)
        flag[2:].replace("-", "_"): a for a in parser._actions if a.dest in allowed
        for flag in a.option_strings if flag.startswith("--") and not flag.startswith("--no-")
    }
    out: list[tuple[str, list[str]]] = []
    for i, entry in enumerate(models):
        where = f"models[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: a model is a mapping of its options")
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.name: each model needs its name (a string), the "
                             "one clients give")
        if name in (n for n, _ in out):
            raise ValueError(f"{where}.name: '{name}' is served twice")
        argv = [f"--served-model-name={name}"]
        for key, value in entry.items():
            if key == "name":
                continue
            action = actions.get(str(key).replace("-", "_"))
            if action is None:
                keys = ", ".join(d.replace("_", "-") for d in MODEL_DESTS + POOL_DESTS)
                raise ValueError(f"{where}.{key}: not an option of a model (its keys: name, "
                                 f"{keys})")
            argv.extend(_options(action, value, f"{where}.{key}"))
        out.append((name, argv))
    return out


#: The most values (scalars, lists, mappings, counted as if every alias were written out)
#: a file may hold: far more than any real configuration, far less than a YAML alias bomb
#: (a 400-byte file of nested aliases expands to ~10^8 values: reading it spun for minutes).
MAX_VALUES = 100_000


def _check_expansion(data: object) -> None:
    """ValueError when ``data``, with its YAML aliases written out, holds more than
    :data:`MAX_VALUES` values (counted up to that bound, never further)."""
    count, todo = 0, [data]
    while todo:
        item = todo.pop()
        count += 1
        if count > MAX_VALUES:
            raise ValueError(f"the file holds more than {MAX_VALUES} values once its YAML "
                             "aliases are expanded (an alias bomb?)")
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)


def _options(action: argparse.Action, value: object, where: str) -> list[str]:
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"{where}: true or false")
        if value:
            return [flag]
        negative = action.option_strings[1:]  # --no-X of a BooleanOptionalAction
        return list(negative[:1])
    if isinstance(action, argparse._AppendAction):  # repeatable
        if isinstance(value, dict) and action.dest == "engine_arg":
            return [f"{flag}={k}={v if isinstance(v, str) else json.dumps(v)}"
                    for k, v in value.items()]
        items = value if isinstance(value, list) else [value]
        return [f"{flag}={_scalar(v, where)}" for v in items]
    return [f"{flag}={_scalar(value, where)}"]


def _scalar(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: a string or a number")
    return str(value)
