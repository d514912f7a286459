"""trio-llm-server: an OpenAI-compatible LLM serving frontend on Trio.

The embeddable API::

    import server

    async with server.open_engine(server.EngineConfig(workers=2)) as engine:
        async with engine.generate("Hello", server.SamplingParams(max_tokens=8)) as stream:
            async for out in stream:
                ...

The HTTP server is :func:`server.create_app` (an ASGI app) and :func:`server.serve`.
"""

from .config import EngineConfig
from .errors import (
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
from .manager.engine import Engine, EngineStatistics, WorkerStatistics, open_engine, run_engine
from .manager.stream import RequestStream
from .manager.worker import WorkerStartupError
from .outputs import RequestOutput
from .params import SamplingParams

__all__ = [
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "RequestStream",
    "Engine",
    "EngineStatistics",
    "WorkerStatistics",
    "open_engine",
    "run_engine",
    "ServerError",
    "ClientError",
    "NotFound",
    "MethodNotAllowed",
    "PayloadTooLarge",
    "Unauthorized",
    "EngineError",
    "WorkerDied",
    "WorkerStartupError",
    "ServiceUnavailable",
    "RequestTimeout",
]

__version__ = "0.1.0"
