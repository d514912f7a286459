"""LoRA adapters on the vllm engine: the adapter table (:mod:`server.workers.lora`) in
vLLM's terms.

Example (inside :class:`~server.engines.vllm.engine.VLLMEngine`, engine built with
``enable_lora=True``)::

    adapters = VLLMAdapters(llm_engine, {"sql": "/loras/sql"}, lora_dir="/loras",
                            allow_runtime=True, served_model="base")
    adapters.load_lora("math", "math")        # /v1/load_lora_adapter: {"name", "path", ...}
    lora = adapters.use(7, "sql")             # vllm.lora.request.LoRARequest for request 7
    llm_engine.add_request("7", prompt, sampling, lora_request=lora)
    adapters.release(7)                       # when request 7 ends (finished or aborted)

Every adapter is a ``LoRARequest(name, int id, path)``; vLLM batches requests of several
adapters and of the base model in one step (up to ``max_loras`` adapters in a batch, its
scheduler's business). ``add_lora`` loads an adapter into vLLM's cache (reading its
``adapter_config.json`` and weights) on the loop's thread, between steps; vLLM would also
load a request's adapter from its path on first use, which is why requests get their
``LoRARequest`` from the table only.
"""

from __future__ import annotations

from ...workers.base import Rejected, one_line
from ...workers.lora import AdapterTable

__all__ = ["VLLMAdapters"]


class VLLMAdapters:
    """The adapters of one vLLM engine (see the module docstring). ``modules``: the
    start-up adapters, name -> path or ``[path, base_model_name]``
    (:func:`~server.workers.lora.parse_lora_modules`)."""

    def __init__(self, llm_engine, modules: dict, *, lora_dir: str | None,
                 allow_runtime: bool, served_model: str, client_errors: tuple) -> None:
        from vllm.lora.request import LoRARequest

        self._llm = llm_engine
        self._LoRARequest = LoRARequest
        self._client_errors = client_errors
        self.table = AdapterTable(lora_dir=lora_dir, allow_runtime=allow_runtime)
        for name, spec in modules.items():
            path, base = (spec, None) if isinstance(spec, str) else spec
            if base is not None and base != served_model:
                raise ValueError(f"--lora-modules {name}: base_model_name {base!r} is not "
                                 f"the served model {served_model!r}")
            try:
                self._load(name, path)
            except Rejected as exc:
                raise ValueError(f"--lora-modules {name}: {exc.message}") from None

    def describe(self, lora_config) -> dict:
        """The HELLO's ``lora``: served adapters (name -> path), vLLM's limits, and
        whether adapters may be loaded at run time."""
        return {"adapters": self.table.names(), "max_loras": lora_config.max_loras,
                "max_lora_rank": lora_config.max_lora_rank,
                "runtime": self.table.allow_runtime}

    # -- the wire ops (server.workers.lora.lora_request) ------------------------------------

    def load_lora(self, name: object, path: object) -> dict:
        real = self.table.runtime_path(path)
        return {"name": name, "path": path, "loaded": self._load(name, real)}

    def unload_lora(self, name: object) -> dict:
        if not self.table.allow_runtime:
            raise Rejected("unloading LoRA adapters at run time is off on this server "
                           "(start it with --allow-runtime-lora and --lora-dir DIR)")
        self._remove(self.table.remove(name))
        return {"name": name}

    # -- requests ---------------------------------------------------------------------------

    def use(self, rid: int, name: str):
        """The ``LoRARequest`` of request ``rid`` running with adapter ``name`` (404 for
        a name not served); :meth:`release` when it ends."""
        lora_id, path = self.table.use(rid, name)
        return self._LoRARequest(name, lora_id, path)

    def release(self, rid: int) -> None:
        self._remove(self.table.release(rid))

    # -- internals --------------------------------------------------------------------------

    def _load(self, name: object, path: str) -> bool:
        lora_id, real, new = self.table.add(name, path)
        if not new:
            return False
        assert isinstance(name, str)
        try:
            ok = self._llm.add_lora(self._LoRARequest(name, lora_id, real))
        except self._client_errors as exc:  # a bad adapter (its files, its rank): 400
            self.table.discard(name)
            raise Rejected(f"cannot load LoRA adapter {name!r}: {one_line(exc)}",
                           param="lora_path") from None
        except Exception:
            self.table.discard(name)
            raise
        if not ok:
            self.table.discard(name)
            raise Rejected(f"vLLM could not load LoRA adapter {name!r}", "engine_error")
        return True

    def _remove(self, ids: list[int]) -> None:
        for lora_id in ids:
            self._llm.remove_lora(lora_id)
