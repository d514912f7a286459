"""The small GET routes, answered by Quart: the probes, ``/metrics``, the model cards, and
what the server is and carries (``/version``, ``/load``, ``/tokenizer_info``).

Each takes the app first (:mod:`server.http.routes` registers it with the app bound) and
returns a Quart response; an error raised here is answered by the app's error handlers.
"""

from __future__ import annotations

from quart import Response, request

from .. import __version__
from ..observability.group import group_exposition
from ..openai.encode import dumps
from .adapters import adapter_cards
from .models import Pool

__all__ = ["health", "load", "metrics", "model", "model_card", "models", "ready",
           "tokenizer_info", "version"]


def _json(body, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(body), status=status, content_type="application/json",
                    headers=headers)


def _status_json(code: int, body: dict) -> Response:
    """A probe's answer, with ``Retry-After: 1`` on a 503."""
    return _json(body, code, {"Retry-After": "1"} if code == 503 else None)


async def health(app) -> Response:
    return _status_json(*app.probe_answer("/health"))


async def ready(app) -> Response:
    return _status_json(*app.probe_answer("/ready"))


async def metrics(app) -> Response:
    accept = request.headers.get("accept")
    group = app.server_config.frontend_dir
    if group is None:
        body, content_type = app.metrics.exposition(accept)
    else:  # one of several frontends (--api-servers): answer for all of them
        body, content_type = await group_exposition(
            group, app.server_config.frontend_index, app.metrics.local_exposition(), accept,
        )
    return Response(body, status=200, content_type=content_type)


async def tokenizer_info(app) -> Response:
    """A worker's tokenizer, as for /tokenize (server.http.tokenize); with
    ``--enable-tokenizer-info`` only."""
    return _json(await app.require_engine().tokenize({"op": "info"}))


async def load(app) -> Response:
    """vLLM's ``--enable-server-load-tracking`` route, always on here (the count is kept
    anyway): generation requests in flight on this frontend."""
    return _json({"server_load": sum(e.open_streams for e in app.models.engines())})


async def version(app) -> Response:
    """vLLM's route: ``version`` is vLLM's with the vllm engine (clients read it to know
    what vLLM serves), else this server's; both named besides."""
    engine_info = app.engine.info if app.engine is not None else {}
    body = {"version": engine_info.get("vllm_version") or __version__,
            "server_version": __version__, "engine": engine_info.get("engine")}
    if engine_info.get("vllm_version"):
        body["vllm_version"] = engine_info["vllm_version"]
    return _json(body)


async def models(app) -> Response:
    data = []
    for pool in app.models.pools:
        card = model_card(app, pool)
        data.append(card)
        if pool.engine is not None:  # its LoRA adapters, as vLLM lists them
            data += adapter_cards(pool.engine, card)
    return _json({"object": "list", "data": data})


async def model(app, model_id: str) -> Response:
    pool = app.models.resolve(model_id)  # (a 404 for a name nothing serves)
    card = model_card(app, pool)
    if card["id"] != model_id and pool.engine is not None:  # a LoRA adapter
        card = next(c for c in adapter_cards(pool.engine, card) if c["id"] == model_id)
    return _json(card)


def model_card(app, pool: Pool) -> dict:
    """A model's card, with vLLM's fields: ``root`` the model's path as configured (its
    name when it has none: the sim, remote workers), ``parent`` null (an adapter's card
    names its base model: :func:`~server.http.adapters.adapter_cards`), and
    ``permission``, which clients that read vLLM's cards expect."""
    created = int(app.started_at)
    card = {
        "id": pool.name,
        "object": "model",
        "created": created,
        "owned_by": "trio-llm-server",
        "root": pool.config.engine.engine_options.get("model_path") or pool.name,
        "parent": None,
        "permission": [{
            "id": f"modelperm-{pool.name}", "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False,
        }],
    }
    engine = pool.engine
    if engine is not None and engine.info.get("max_model_len"):
        card["max_model_len"] = engine.info["max_model_len"]
    return card
