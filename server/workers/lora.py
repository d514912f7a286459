"""LoRA adapters in a worker: the table of adapters an engine serves, sans-IO.

Example (what the vllm and sim engines do with ``--enable-lora --lora-modules
sql=/loras/sql --allow-runtime-lora --lora-dir /loras``)::

    table = AdapterTable(lora_dir="/loras", allow_runtime=True)
    table.add("sql", "/loras/sql")                   # at start: (1, "/loras/sql", True)
    table.add("math", table.runtime_path("math"))    # a load at run time (inside lora_dir)
    table.use(7, "sql")                              # request 7 runs with it: (1, path)
    table.remove("sql")                              # unloaded: [] (request 7 still holds it)
    table.release(7)                                 # -> [1]: now remove it from the engine

When and why: adapters are loaded at start (``--lora-modules``, the operator's choice) and,
only where ``--allow-runtime-lora`` says so, at run time by a client (``POST
/v1/load_lora_adapter``). Loading reads files the client names, so a run-time path must
resolve (symlinks followed) inside ``--lora-dir``; nothing else is read. An engine's
library (vLLM) loads an adapter again from its path when a request names it, so the table
is the only place requests get adapters from: a name not in it is a 404.

An adapter unloaded while requests still run with it stays in the engine until the last of
them ends (:meth:`AdapterTable.release` says when to remove it): the engine never holds an
adapter no name points to, and no running request loses its adapter.

The wire ops (CALL requests, answered by RESULT; see docs/protocol.md)::

    {"op": "load_lora", "name": str, "path": str}  -> {"name", "path", "loaded": bool}
    {"op": "unload_lora", "name": str}             -> {"name"}
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

from .base import Rejected

__all__ = ["AdapterTable", "LORA_OPS", "lora_request", "parse_lora_modules"]

#: The CALL ops of this module.
LORA_OPS = frozenset({"load_lora", "unload_lora"})

#: A served name: what a client gives as ``model`` (no control characters, bounded).
_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,256}")


def parse_lora_modules(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``--lora-modules`` as vLLM takes it: ``name=path`` or JSON ``{"name", "path",
    "base_model_name"}`` items -> ``{name: path}``. ``base_model_name`` is kept as
    ``{name: [path, base]}`` for the engine to check against its served name. ValueError
    names a bad item or a name given twice."""
    out: dict = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except ValueError:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON") from None
            extra = sorted(set(spec) - {"name", "path", "base_model_name"})
            if extra:
                raise ValueError(f"--lora-modules: unknown key(s) {', '.join(extra)} in "
                                 f"{item!r} (name, path, base_model_name)")
            name, path = spec.get("name"), spec.get("path")
            base = spec.get("base_model_name")
        else:
            name, sep, path = item.partition("=")
            base = None
            if not sep:
                raise ValueError(f"--lora-modules needs name=path, not {item!r}")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(
                path, str) or not path:
            raise ValueError(f"--lora-modules: {item!r} needs a name and a path")
        if name in out:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        out[name] = path if base is None else [path, base]
    return out


class AdapterTable:
    """The adapters an engine serves (see the module docstring). ``lora_dir``: where
    run-time loads may read (required with ``allow_runtime``)."""

    def __init__(self, *, lora_dir: str | None = None, allow_runtime: bool = False) -> None:
        if allow_runtime and not lora_dir:
            raise ValueError("loading LoRA adapters at run time needs a directory they are "
                             "read from (--lora-dir)")
        if lora_dir and not os.path.isdir(lora_dir):
            raise ValueError(f"the LoRA directory {lora_dir} does not exist")
        self.allow_runtime = allow_runtime
        self.lora_dir = os.path.realpath(lora_dir) if lora_dir else None
        #: name -> (int id, path)
        self._by_name: dict[str, tuple[int, str]] = {}
        #: int id -> requests running with it
        self._users: dict[int, set[int]] = {}
        #: rid -> int id
        self._rids: dict[int, int] = {}
        #: ids unloaded by name, still in use: removed from the engine when released
        self._retired: set[int] = set()
        self._next_id = 1

    def names(self) -> dict[str, str]:
        """name -> path of every adapter served."""
        return {name: path for name, (_, path) in self._by_name.items()}

    def runtime_path(self, path: object) -> str:
        """The real path of a run-time load's ``path`` (relative ones are taken in
        ``lora_dir``); :class:`Rejected` unless runtime loading is on and it resolves
        inside ``lora_dir`` to a directory."""
        if not self.allow_runtime or self.lora_dir is None:
            raise Rejected("loading LoRA adapters at run time is off on this server (start "
                           "it with --allow-runtime-lora and --lora-dir DIR)")
        if not isinstance(path, str) or not path or "\0" in path:
            raise Rejected("lora_path must be a non-empty string", param="lora_path")
        real = os.path.realpath(os.path.join(self.lora_dir, path))
        if os.path.commonpath([real, self.lora_dir]) != self.lora_dir or real == self.lora_dir:
            raise Rejected(f"lora_path {path!r} is outside this server's LoRA directory "
                           "(--lora-dir): only adapters in it can be loaded at run time",
                           param="lora_path")
        if not os.path.isdir(real):
            raise Rejected(f"lora_path {path!r}: no such adapter directory", "not_found",
                           param="lora_path")
        return real

    def add(self, name: object, path: str) -> tuple[int, str, bool]:
        """Serve ``path`` as ``name``: ``(int id, path, new)``; the same name and path
        again is not new (idempotent: a replayed load), a name serving another path is
        :class:`Rejected` (vLLM's 400)."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise Rejected("lora_name must be a string of 1 to 256 printable characters",
                           param="lora_name")
        held = self._by_name.get(name)
        if held is not None:
            if held[1] == path:
                return held[0], path, False
            raise Rejected(f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")
        lora_id = self._next_id
        self._next_id += 1
        self._by_name[name] = (lora_id, path)
        return lora_id, path, True

    def discard(self, name: str) -> None:
        """Forget ``name`` added just now (the engine could not load it)."""
        self._by_name.pop(name, None)

    def remove(self, name: object) -> list[int]:
        """Stop serving ``name``: the ids to remove from the engine now (none while
        requests still use it: :meth:`release` returns it then). Unknown: 404."""
        held = self._by_name.pop(name, None) if isinstance(name, str) else None
        if held is None:
            raise Rejected(f"The lora adapter '{name}' cannot be found.", "not_found",
                           param="lora_name")
        lora_id = held[0]
        if self._users.get(lora_id):
            self._retired.add(lora_id)
            return []
        return [lora_id]

    def use(self, rid: int, name: str) -> tuple[int, str]:
        """Request ``rid`` runs with adapter ``name``: its ``(int id, path)``; a name not
        served is a 404 (``model_not_found``)."""
        held = self._by_name.get(name)
        if held is None:
            raise Rejected(f"The model '{name}' does not exist.", "model_not_found",
                           param="model")
        self._rids[rid] = held[0]
        self._users.setdefault(held[0], set()).add(rid)
        return held

    def release(self, rid: int) -> list[int]:
        """Request ``rid`` ended: the ids to remove from the engine now (an adapter
        unloaded meanwhile whose last request this was)."""
        lora_id = self._rids.pop(rid, None)
        if lora_id is None:
            return []
        users = self._users[lora_id]
        users.discard(rid)
        if users:
            return []
        del self._users[lora_id]
        if lora_id in self._retired:
            self._retired.discard(lora_id)
            return [lora_id]
        return []

    def in_use(self) -> dict[str, int]:
        """name -> running requests, for statistics (unloaded ones under ``""``)."""
        names = {lora_id: name for name, (lora_id, _) in self._by_name.items()}
        return {names.get(i, ""): len(users) for i, users in self._users.items()}


def lora_request(engine, request: dict) -> list:
    """``[result, None]`` or ``[None, err]`` for a ``load_lora`` or
    ``unload_lora`` request to ``engine`` (which has ``load_lora(name, path)`` and
    ``unload_lora(name)`` when it serves adapters)."""
    op = request.get("op")
    call: Callable | None = getattr(engine, op, None) if op in LORA_OPS else None
    if call is None or not engine.info.get("lora"):
        name = engine.info.get("engine", "this")
        return [None, ["invalid_request",
                       f"LoRA adapters are not enabled on this server (the {name} engine; "
                       "adapters need --enable-lora, with the vllm or sim engine)"]]
    try:
        if op == "load_lora":
            return [call(request.get("name"), request.get("path")), None]
        return [call(request.get("name")), None]
    except Rejected as exc:
        return [None, exc.err(request)]
    except Exception as exc:
        return [None, ["engine_error", f"the engine could not {op}: {exc!r:.200}"]]
