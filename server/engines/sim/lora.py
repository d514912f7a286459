"""Simulated LoRA adapters on the sim engine: the adapter table (:mod:`server.workers.lora`)
with no weights behind it. Sans-IO.

Example (inside :class:`~server.engines.sim.engine.SimEngine`, built with
``enable_lora=True``)::

    adapters = SimAdapters({"sql": "/loras/sql"}, max_loras=2, lora_dir="/loras",
                           allow_runtime=True, served_model="sim")
    adapters.load_lora("math", "math")        # /v1/load_lora_adapter: {"name", "path", ...}
    lora_id = adapters.use(7, "sql")          # request 7 runs with it (404 if not served)
    adapters.release(7)                       # when request 7 ends (finished or aborted)

When and why: an operator or a test exercises adapter routing, loading at run time, replay
to a fresh worker and unloading without vLLM. The options, the wire ops and the checks are
the vllm engine's. An adapter is a directory that must exist, as vLLM reads its files: a
replayed load whose directory was removed meanwhile is refused, as on vLLM. Nothing in it is
read. An adapter changes the answer visibly: its text opens with the tag :func:`tag` (the
adapter's name in brackets). At most ``max_loras`` adapters run in one batch, as vLLM's
scheduler allows; a request of another adapter waits, and later ones may pass it.
"""

from __future__ import annotations

import os

from ...workers.base import Rejected
from ...workers.lora import AdapterTable

__all__ = ["SimAdapters", "tag"]


def tag(name: str) -> str:
    """The text an answer through adapter ``name`` opens with (before its first word)."""
    return f" [{name}]"


class SimAdapters:
    """The adapters of one sim engine (see the module docstring). ``modules``: the
    start-up adapters, name -> path or ``[path, base_model_name]``
    (:func:`~server.workers.lora.parse_lora_modules`)."""

    def __init__(self, modules: dict, *, max_loras: int, lora_dir: str | None,
                 allow_runtime: bool, served_model: str) -> None:
        if max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        self.max_loras = max_loras
        self.table = AdapterTable(lora_dir=lora_dir, allow_runtime=allow_runtime)
        for name, spec in modules.items():
            path, base = (spec, None) if isinstance(spec, str) else spec
            if base not in (None, served_model):
                raise ValueError(f"--lora-modules {name}: base_model_name {base!r} is not "
                                 f"the served model {served_model!r}")
            if not os.path.isdir(path):
                raise ValueError(f"--lora-modules {name}: no adapter directory {path}")
            self.table.add(name, os.path.realpath(path))  # (names: parse_lora_modules)

    def describe(self) -> dict:
        """The HELLO's ``lora``: served adapters (name -> path), the batch's limit, and
        whether adapters may be loaded at run time."""
        return {"adapters": self.table.names(), "max_loras": self.max_loras,
                "runtime": self.table.allow_runtime}

    # -- the wire ops (server.workers.lora.lora_request) ------------------------------------

    def load_lora(self, name: object, path: object) -> dict:
        real = self.table.runtime_path(path)  # (a directory that is not there: a 404)
        return {"name": name, "path": path, "loaded": self.table.add(name, real)[2]}

    def unload_lora(self, name: object) -> dict:
        if not self.table.allow_runtime:
            raise Rejected("unloading LoRA adapters at run time is off on this server "
                           "(start it with --allow-runtime-lora and --lora-dir DIR)")
        self.table.remove(name)  # (no weights to free: the ids it returns mean nothing here)
        return {"name": name}

    # -- requests ---------------------------------------------------------------------------

    def use(self, rid: int, name: str) -> int:
        """The adapter id of request ``rid`` running with adapter ``name`` (a 404 for a
        name not served); :meth:`release` when it ends."""
        return self.table.use(rid, name)[0]

    def release(self, rid: int) -> None:
        self.table.release(rid)
