"""LoRA adapters over HTTP: a request's ``model`` resolved, and vLLM's two endpoints.

Example (a server started with ``--enable-lora --allow-runtime-lora --lora-dir /loras``)::

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "sql-v2"}
    -> 200 Success: LoRA adapter 'sql' added successfully.
    POST /v1/completions          {"model": "sql", "prompt": "SELECT"}   (runs with it)
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}
    -> 200 Success: LoRA adapter 'sql' removed successfully.

:func:`resolve_model` is the one place a request's ``model`` becomes what runs it: the
engine, and the adapter's name (None for the base model); anything else is a 404
``model_not_found``. The endpoints' bodies, answers and statuses are vLLM's (a name loaded
already: 400; unloading an unknown one: 404); with run-time loading off they answer 404
saying how to turn it on. The table itself is the manager's
(:mod:`server.manager.adapters`). Parsing is sans-IO; the shell is
:func:`~server.http.tokenize.serve_worker_op`.
"""

from __future__ import annotations

from ..errors import ClientError, ModelNotFound, clip
from ..openai.fields import check_route_fields
from ..openai.schema import decode_json
from .tokenize import serve_worker_op

__all__ = ["adapter_cards", "handle_lora", "parse_load", "parse_unload", "resolve_model"]

#: vLLM's fields of these bodies that this server does not honour -> the values that mean
#: "not used".
_NEUTRAL: dict[str, tuple] = {"load_inplace": (None, False), "is_3d_lora_weight": (None, False),
                              "lora_int_id": (None,)}


def resolve_model(app, model: str | None):
    """``(engine, adapter)`` for a request's ``model`` field: the engine that serves it
    and the LoRA adapter's name, or None for the base model (also when ``model`` is
    absent). A name neither is a 404, ``model_not_found``."""
    pool = app.models.resolve(model)  # (the model's pool, or the pool an adapter is on)
    engine = pool.require_engine()
    if model is None or model == engine.model_name:
        return engine, None
    if engine.adapters.served(model):
        return engine, model
    raise ModelNotFound(f"The model '{clip(model)}' does not exist.", param="model")


def adapter_cards(engine, base_card: dict) -> list[dict]:
    """``/v1/models`` entries of the served adapters, as vLLM lists them: ``root`` the
    adapter's path, ``parent`` the base model."""
    return [{**base_card, "id": name, "root": path, "parent": base_card["id"]}
            for name, path in engine.adapters.names().items()]


def _fields(data: dict, names: tuple[str, ...], route: str) -> list[str]:
    check_route_fields(data, frozenset(names), _NEUTRAL, route)
    values = []
    for name in names:
        value = data.get(name)
        if not isinstance(value, str) or not value:
            raise ClientError(f"'{name}' must be a non-empty string.", param=name)
        values.append(value)
    return values


def parse_load(body: bytes, model: str, info: dict) -> tuple[dict, str]:
    """``(request, name)`` of a ``/v1/load_lora_adapter`` body."""
    data = decode_json(body)
    if not isinstance(data, dict) or not data.get("lora_name") or not data.get("lora_path"):
        raise ClientError("Both 'lora_name' and 'lora_path' must be provided.",
                          param="lora_name")
    name, path = _fields(data, ("lora_name", "lora_path"), "/v1/load_lora_adapter")
    return {"op": "load_lora", "name": name, "path": path}, name


def parse_unload(body: bytes, model: str, info: dict) -> tuple[dict, str]:
    """``(request, name)`` of a ``/v1/unload_lora_adapter`` body."""
    data = decode_json(body)
    if not isinstance(data, dict) or not data.get("lora_name"):
        raise ClientError("'lora_name' needs to be provided to unload a LoRA adapter.",
                          param="lora_name")
    (name,) = _fields(data, ("lora_name",), "/v1/unload_lora_adapter")
    return {"op": "unload_lora", "name": name}, name


async def _load(engine, request: dict) -> str:
    await engine.adapters.load(request["name"], request["path"], base=engine.model_name)
    return "added"


async def _unload(engine, request: dict) -> str:
    await engine.adapters.unload(request["name"])
    return "removed"


def _answer(name: str, done: str) -> bytes:
    return f"Success: LoRA adapter '{name}' {done} successfully.".encode()


async def handle_lora(app, path: str, scope: dict, receive, send, headers: list,
                      request_id: str, *, op: str) -> None:
    """Serve one /v1/load_lora_adapter or /v1/unload_lora_adapter request (``op``: load or
    unload; a route of :mod:`server.http.routes`) on every worker of the pool (see
    server.manager.adapters)."""
    parse, call = (parse_load, _load) if op == "load" else (parse_unload, _unload)
    await serve_worker_op(app, scope, receive, send, headers, parse, _answer, call=call,
                          content_type=b"text/plain; charset=utf-8")
