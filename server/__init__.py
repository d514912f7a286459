"""trio-llm-server: an OpenAI-compatible LLM serving frontend on Trio.

The embeddable API::

    import server

    async with server.open_engine(server.EngineConfig(workers=2)) as engine:
        async with engine.generate("Hello", server.SamplingParams(max_tokens=8)) as stream:
            async for out in stream:
                ...

The HTTP server: :func:`create_app` (the ASGI app) and :func:`serve` (hypercorn, signals,
graceful drain).

The names below are imported on first use, so that a worker process (which imports
``server.workers`` and never needs Trio or HTTP) starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "EngineConfig": ".config",
    "ServerConfig": ".config",
    "ModelConfig": ".config",
    "Limits": ".config",
    "SamplingParams": ".params",
    "RequestOutput": ".outputs",
    "RequestStream": ".manager.stream",
    "Engine": ".manager.engine",
    "EngineStatistics": ".manager.engine",
    "WorkerStatistics": ".manager.engine",
    "open_engine": ".manager.engine",
    "run_engine": ".manager.engine",
    "WorkerStartupError": ".manager.worker",
    "create_app": ".http.app",
    "serve": ".http.serve",
    "ServerError": ".errors",
    "ClientError": ".errors",
    "NotFound": ".errors",
    "MethodNotAllowed": ".errors",
    "PayloadTooLarge": ".errors",
    "BodyTimeout": ".errors",
    "Unauthorized": ".errors",
    "EngineError": ".errors",
    "WorkerDied": ".errors",
    "RequestTimeout": ".errors",
    "ServiceUnavailable": ".errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from .config import EngineConfig, Limits, ModelConfig, ServerConfig
    from .errors import (
        BodyTimeout,
        ClientError,
        EngineError,
        MethodNotAllowed,
        NotFound,
        PayloadTooLarge,
        RequestTimeout,
        ServerError,
        ServiceUnavailable,
        Unauthorized,
        WorkerDied,
    )
    from .http.app import create_app
    from .http.serve import serve
    from .manager.engine import Engine, EngineStatistics, WorkerStatistics, open_engine, run_engine
    from .manager.stream import RequestStream
    from .manager.worker import WorkerStartupError
    from .outputs import RequestOutput
    from .params import SamplingParams
