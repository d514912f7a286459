"""The frontend's table of LoRA adapters: what each name means, on every worker of the pool.

Example (the HTTP layer's use; ``engine.adapters`` is one of these)::

    await engine.adapters.load("sql", "sql-v2")    # on every live worker, or on none
    engine.adapters.served("sql")                  # True: requests may name it now
    await engine.adapters.unload("sql")            # no new request resolves it

Theory of operation
-------------------
Adapters come two ways. *Start-up* adapters (``--lora-modules``) are each worker's own
options: every worker loads them before its HELLO, whose ``info["lora"]["adapters"]``
lists them. *Run-time* adapters are loaded by a client (``POST /v1/load_lora_adapter``)
and exist only because this table says so: :meth:`AdapterRegistry.load` sends a
``load_lora`` op (a CALL round trip, answered between engine steps) to every live
worker at once; if any refuses, the others unload it again and the client gets that
worker's error. A name is served (requests may name it) only once every worker has it.

A worker that starts later (a restart, a reconnection to a listening worker) gets the
table replayed before anything else. :meth:`AdapterRegistry.replay` is that list of ops:
unloads of start-up adapters unloaded at run time, then loads of run-time ones. The
worker's session queues them ahead of any request, so the worker applies them, in order,
before it reads a SUBMIT that may need them. A replayed load that fails there (its files removed
meanwhile) is logged; requests for that adapter routed to that worker get its 404.

Unloading removes the name first (new requests get a 404 here), then sends
``unload_lora`` to every live worker; a worker keeps an adapter its running requests use
until they end (server.workers.lora). Several frontends sharing listening workers share
their adapters: a name one frontend loaded is the worker's, for all of them.
"""

from __future__ import annotations

import logging
from typing import Sequence

import trio

from ..errors import ClientError, EngineError, NotFound, ServerError, ServiceUnavailable

__all__ = ["AdapterRegistry"]

log = logging.getLogger("server.worker")


class AdapterRegistry:
    """The LoRA adapters of an engine's workers (see the module docstring)."""

    def __init__(self, workers: Sequence) -> None:
        self._workers = workers
        #: Run-time adapters: name -> the lora_path the client gave (loaded or loading).
        self._added: dict[str, str] = {}
        #: Of those, the ones still loading (not served yet).
        self._loading: set[str] = set()
        #: Start-up adapters unloaded at run time.
        self._removed: set[str] = set()

    def _lora_info(self) -> dict:
        for w in self._workers:
            lora = w.info.get("lora")
            if lora:
                return lora
        return {}

    def enabled(self) -> bool:
        """Whether the workers serve adapters (vLLM or the sim with --enable-lora)."""
        return bool(self._lora_info())

    def runtime(self) -> bool:
        """Whether the workers load adapters at run time (--allow-runtime-lora)."""
        return bool(self._lora_info().get("runtime"))

    def names(self) -> dict[str, str]:
        """Served adapters: name -> path (a start-up adapter's real path, a run-time
        one's lora_path as the client gave it)."""
        static = self._lora_info().get("adapters") or {}
        out = {n: p for n, p in static.items() if n not in self._removed}
        out.update((n, p) for n, p in self._added.items() if n not in self._loading)
        return out

    def served(self, name: str) -> bool:
        """Whether requests may name adapter ``name`` now."""
        if name in self._added:
            return name not in self._loading
        return name not in self._removed and name in (
            self._lora_info().get("adapters") or {})

    def replay(self) -> list[dict]:
        """The ops that bring a freshly started worker to this table (in order)."""
        static = self._lora_info().get("adapters") or {}
        ops: list[dict] = [{"op": "unload_lora", "name": n} for n in self._removed
                           if n in static]
        ops += [{"op": "load_lora", "name": n, "path": p} for n, p in self._added.items()]
        return ops

    async def load(self, name: str, path: str, *, base: str) -> None:
        """Load ``path`` as adapter ``name`` on every live worker (a worker that starts
        meanwhile gets it by :meth:`replay`); raises the first worker's refusal, after
        unloading it from the others. ``base``: the base model's name (not an adapter's)."""
        self._check_runtime()
        if name == base:
            raise ClientError(f"The lora adapter '{name}' conflicts with a served base "
                              "model.", param="lora_name")
        if name in self._added or self.served(name):
            raise ClientError(f"The lora adapter '{name}' has already been loaded.",
                              param="lora_name")
        workers = [w for w in self._workers if w.alive]
        if not workers:
            raise ServiceUnavailable("no engine worker is available", code="no_worker")
        self._added[name] = path
        self._loading.add(name)
        loaded: list = []
        failures: list[ServerError] = []
        try:
            await _each(workers, {"op": "load_lora", "name": name, "path": path},
                        loaded, failures)
        except BaseException:  # cancelled: not served; a later replay does not load it
            del self._added[name]
            raise
        finally:
            self._loading.discard(name)
        if failures:
            del self._added[name]
            await _each(loaded, {"op": "unload_lora", "name": name}, [], [])
            raise failures[0]

    async def unload(self, name: str) -> None:
        """Stop serving adapter ``name`` (404 if it is not served) and unload it from
        every live worker."""
        self._check_runtime()
        if name in self._loading:
            raise ClientError(f"The lora adapter '{name}' is being loaded.",
                              param="lora_name")
        if not self.served(name):
            raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        if self._added.pop(name, None) is None:
            self._removed.add(name)
        failures: list[BaseException] = []
        await _each([w for w in self._workers if w.alive],
                    {"op": "unload_lora", "name": name}, [], failures)
        for exc in failures:  # the name is gone here: the worker's copy serves no one
            log.warning("LoRA adapter %r: a worker could not unload it: %s", name, exc)

    def _check_runtime(self) -> None:
        if not self.enabled():
            raise ClientError("LoRA adapters are not enabled on this server (they need "
                              "--enable-lora, with the vllm or sim engine)",
                              code="lora_not_enabled")
        if not self.runtime():
            raise NotFound("Loading and unloading LoRA adapters at run time is off on this "
                           "server (start it with --allow-runtime-lora and --lora-dir DIR).")


async def _each(workers: list, op: dict, done: list, failures: list) -> None:
    """Send ``op`` to each of ``workers`` at once: the ones that did it go to ``done``,
    refusals to ``failures``; a worker that went away meanwhile is neither (its successor
    gets the table replayed)."""

    async def one(w) -> None:
        try:
            await w.call(op)
        except ServerError as exc:
            if isinstance(exc, EngineError) and not w.alive:
                return  # it went away
            failures.append(exc)
        else:
            done.append(w)

    async with trio.open_nursery() as nursery:
        for w in workers:
            nursery.start_soon(one, w)
