"""The model table: which worker pool serves a request's ``model``.

A server serves one model (``ServerConfig.engine``) or several (``ServerConfig.models``),
each its own :class:`Pool`: an engine with its workers (spawned or remote) and its own
admission limits. :meth:`ModelTable.resolve` is the one place a request's ``model`` is
resolved to a pool: for the generation routes, ``/tokenize``, ``/detokenize`` and
``/v1/embeddings`` through :meth:`ModelTable.pool_for` (off the event loop for a big body),
for ``GET /v1/models/{id}`` directly. Names that map to a pool in another way (an adapter
over a base model) join the table here.

With one model nothing is looked up: the request's ``model``, when given, is checked by the
body's parser against the served name, as it always was (a 404 ``model_not_found``
otherwise). With several, only the ``model`` field is decoded first (msgspec skips the rest
of the body without building it); a request without one goes to the first model, as
vLLM's does to its first served name.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from ..config import ModelConfig, ServerConfig
from ..errors import ClientError, NotFound, ServiceUnavailable, clip
from ..manager.engine import Engine
from .post import off_loop

__all__ = ["ModelTable", "Pool", "requested_model"]


class _Model(msgspec.Struct):
    model: Any = None


_decode_model = msgspec.json.Decoder(_Model).decode


def requested_model(body: bytes) -> object:
    """The ``model`` field of a JSON body; None when it has none, or is not a JSON object
    (its parser then says what is wrong with it)."""
    try:
        return _decode_model(body).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class Pool:
    """One model's worker pool: its engine (None while it starts or after it stopped) and
    its admission limits (``max_requests``, ``max_sequences``, ``max_queue_time``: see
    ModelConfig)."""

    __slots__ = ("config", "engine", "owned", "max_requests", "max_sequences",
                 "max_queue_time")

    def __init__(self, config: ModelConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine
        #: Whether the app starts and stops this pool's engine (not an embedder's).
        self.owned = engine is None
        self.max_requests = config.max_concurrent_requests
        self.max_sequences = config.max_concurrent_sequences
        #: Seconds a request may wait to start (None: no limit).
        self.max_queue_time = config.max_queue_time or None

    @property
    def name(self) -> str:
        """The served model name: the configured one, else what the workers report."""
        if self.engine is not None:
            return self.engine.model_name
        return self.config.engine.model or self.config.engine.engine

    def require_engine(self) -> Engine:
        """The engine, or ServiceUnavailable while it is not running."""
        engine = self.engine
        if engine is None:
            raise ServiceUnavailable("The engine is not running (starting or stopping).",
                                     code="no_engine")
        return engine

    def healthy(self) -> bool:
        """Up: accepting, with at least one worker that answered a ping recently."""
        return self.engine is not None and self.engine.healthy()

    def workers(self) -> tuple[int, int]:
        """(workers answering pings, workers of the pool), for the probes; (0, 0) while
        the engine is not running."""
        engine = self.engine
        if engine is None:
            return 0, 0
        return engine.workers_answering(), engine.members


class ModelTable:
    """The pools of a server, by served name; the first is the default (a request with no
    ``model``, ``/tokenizer_info``, ``/version``)."""

    __slots__ = ("pools", "default", "_by_name")

    def __init__(self, config: ServerConfig, engines: Sequence[Engine] = ()) -> None:
        if engines:  # an embedder's engines, already running
            if config.models:
                raise ValueError("create_app: 'engines' and config.models both give the "
                                 "models: give one")
            limits = config.pools()[0]
            self.pools = tuple(
                Pool(ModelConfig(e.config, limits.max_concurrent_requests,
                                 limits.max_concurrent_sequences, limits.max_queue_time), e)
                for e in engines
            )
        else:
            self.pools = tuple(Pool(m) for m in config.pools())
        self.default = self.pools[0]
        self._by_name: dict[str, Pool] = {}
        if len(self.pools) > 1:
            for i, pool in enumerate(self.pools):
                name = pool.config.engine.model
                if not name or name in self._by_name:
                    raise ValueError(f"engines[{i}]: each of several engines needs its own "
                                     "name (EngineConfig.model)")
                self._by_name[name] = pool

    @property
    def several(self) -> bool:
        return len(self.pools) > 1

    async def pool_for(self, body: bytes) -> Pool:
        """:meth:`for_body`, off the event loop for a big body (as its parse is)."""
        if not self._by_name:
            return self.default
        return await off_loop(len(body), self.for_body, body)

    def for_body(self, body: bytes) -> Pool:
        """The pool a request body's ``model`` names (see the module docstring): 404
        ``model_not_found`` for a name no pool serves, 400 for a model that is not a
        string."""
        if not self._by_name:
            return self.default  # one model: generate.resolve_model checks the name
        return self.resolve(requested_model(body))

    def resolve(self, model: object) -> Pool:
        """The pool serving ``model`` (None: the default one)."""
        if model is None:
            return self.default
        if not isinstance(model, str):
            raise ClientError("'model' must be a string.", param="model")
        pool = self._by_name.get(model) if self._by_name else (
            self.default if model == self.default.name else None)
        if pool is None:  # a LoRA adapter's name: the pool whose engine serves it
            pool = next((p for p in self.pools
                         if p.engine is not None and p.engine.adapters.served(model)), None)
        if pool is None:
            raise NotFound(f"The model '{clip(model)}' does not exist.", param="model",
                           code="model_not_found")
        return pool

    def of_engine(self, engine: Engine) -> Pool:
        """The pool whose engine ``engine`` is."""
        for pool in self.pools:
            if pool.engine is engine:
                return pool
        return self.default

    def engines(self) -> list[Engine]:
        """The engines running now."""
        return [p.engine for p in self.pools if p.engine is not None]
