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

A model's keys are the server's options of one model (``entry="model"`` in their table,
server.cli_options: the engine, its workers, remote workers) and of its pool
(``entry="pool"``: routing, admission limits, restarts), any of an option's spellings, dashes
or underscores, without ``--``. A pool option given on the command line
is every model's default; a model option there is refused (which model would it be?).
Values: a string or number (``--key=VALUE``), a boolean for a switch, a list for a
repeatable option, a mapping for ``engine-arg`` (``KEY=VALUE`` each, non-strings as JSON).
Anything else is refused, naming the model and the key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import yaml

from .option_table import Option, option_argv

__all__ = ["MAX_FILE_BYTES", "MAX_VALUES", "model_argvs"]

#: The largest --model-config file read (a configuration of many models is a few KiB).
MAX_FILE_BYTES = 1 << 20


def model_argvs(text: str, options: Sequence[Option]) -> list[tuple[str, list[str]]]:
    """Each model's (name, options as a command line of the parser of ``options``) of a
    --model-config file's text, in the file's order. ValueError naming the field for what
    is wrong."""
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
    allowed = [o for kind in ("model", "pool") for o in options if o.entry == kind]
    spellings = {  # every spelling of an allowed option (--max-num-seqs is --max-batch)
        flag[2:].replace("-", "_"): o for o in allowed for flag in o.flags
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
            option = spellings.get(str(key).replace("-", "_"))
            if option is None:
                keys = ", ".join(o.dest.replace("_", "-") for o in allowed)
                raise ValueError(f"{where}.{key}: not an option of a model (its keys: name, "
                                 f"{keys})")
            argv.extend(_options(option, value, f"{where}.{key}"))
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


def _options(option: Option, value: object, where: str) -> list[str]:
    """The command-line words of an entry's ``value`` of ``option``: a boolean for a
    switch, a list (or one value) for a repeatable option, a mapping for ``engine-arg``."""
    if option.kind in ("switch", "bool"):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: true or false")
        return option_argv(option, value)
    if option.kind in ("append", "extend"):
        if isinstance(value, dict) and option.dest == "engine_arg":
            return [f"{option.flag}={k}={v if isinstance(v, str) else json.dumps(v)}"
                    for k, v in value.items()]
        items = value if isinstance(value, list) else [value]
        return [f"{option.flag}={_scalar(v, where)}" for v in items]
    return [f"{option.flag}={_scalar(value, where)}"]


def _scalar(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: a string or a number")
    return str(value)
