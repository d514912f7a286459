"""Every endpoint of the API port, in one table: its path, its methods, and what serves it.

Two kinds of route, told apart by ``raw``:

* **Raw routes** (every POST: generation, embeddings, tokenize, LoRA, ``/invocations``) are
  served on raw ASGI by the app's own dispatch (:meth:`LLMServerApp.serve_route
  <server.http.app.LLMServerApp.serve_route>`), one dictionary look-up before Quart would
  see the request. Their body messages go straight to the ASGI server's ``send``. Through
  Quart's response machinery each SSE event costs about twice the CPU (measured when the
  routes were written, commit ``f8a7207``). And every request Quart routes leaves werkzeug
  router objects in reference cycles for the collector (docs/changelog.md, 2026-12-03,
  "Isolation: The largest gaps were the detokenizer's and the collector's"). Each one refuses other
  methods itself (405 with ``Allow: POST``, :mod:`server.http.post`), so ``methods`` is for
  the reader.
* **Quart routes** (the small GETs: probes, metrics, model cards) are registered with Quart
  from this table, behind the app's request id, CORS and API-key checks.

Either way the serving function gets the app first: a raw route's is
``serve(app, path, scope, receive, send, headers, request_id)`` (``path``: the route's, also
when ``/invocations`` dispatched the request to it; ``headers``: the response's extra ones),
a Quart route's ``serve(app, **url_values)``. A route with ``enabled`` exists only for the
configurations it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from ..config import ServerConfig
from . import info
from .adapters import handle_lora
from .batches import cancel_batch, retrieve_batch, serve_batches
from .chat_batch import ROUTE as CHAT_BATCH
from .embeddings import handle_embeddings
from .files import delete_file, file_content, retrieve_file, serve_files
from .generate import serve_generation
from .invocations import handle_invocations
from .responses_read import cancel_response, delete_response, input_items, retrieve_response
from .responses_write import ROUTE as RESPONSES
from .tokenize import handle_tokenize

__all__ = ["Route", "TABLE", "quart_routes", "raw_routes"]


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: ``path`` (Quart's rule syntax for a Quart route), its ``methods``,
    the function that ``serve``\\ s it, whether it is ``raw`` (module docstring), and
    ``enabled(config)``, when only some configurations have it."""

    path: str
    serve: Callable
    methods: tuple[str, ...] = ("POST",)
    raw: bool = True
    enabled: Callable[[ServerConfig], bool] | None = None

    def on(self, config: ServerConfig) -> bool:
        """Whether a server of ``config`` serves this route."""
        return self.enabled is None or self.enabled(config)


def _get(path: str, serve: Callable, enabled=None) -> Route:
    return Route(path, serve, ("GET",), raw=False, enabled=enabled)


TABLE: tuple[Route, ...] = (
    # generation (server.http.generate, answer, responses_write, chat_batch)
    Route("/v1/completions", partial(serve_generation, chat=False)),
    Route("/v1/chat/completions", partial(serve_generation, chat=True)),
    Route("/v1/chat/completions/batch", partial(serve_generation, chat=True, route=CHAT_BATCH)),
    Route("/v1/responses", partial(serve_generation, chat=True, route=RESPONSES)),
    # answered by a worker round trip (server.http.tokenize's serve_worker_op)
    Route("/v1/embeddings", handle_embeddings),
    Route("/tokenize", partial(handle_tokenize, op="tokenize")),
    Route("/detokenize", partial(handle_tokenize, op="detokenize")),
    Route("/v1/load_lora_adapter", partial(handle_lora, op="load")),
    Route("/v1/unload_lora_adapter", partial(handle_lora, op="unload")),
    # SageMaker's: one of the routes above, by the body (server.http.invocations)
    Route("/invocations", handle_invocations),
    # the Files API (server.http.files): the upload streams (raw), for GET too (the list)
    Route("/v1/files", serve_files, ("GET", "POST")),
    Route("/v1/files/<file_id>", retrieve_file, ("GET",), raw=False),
    Route("/v1/files/<file_id>/content", file_content, ("GET",), raw=False),
    Route("/v1/files/<file_id>", delete_file, ("DELETE",), raw=False),
    # the Batch API (server.http.batches; server.batches runs them)
    Route("/v1/batches", serve_batches, ("GET", "POST")),
    Route("/v1/batches/<batch_id>", retrieve_batch, ("GET",), raw=False),
    Route("/v1/batches/<batch_id>/cancel", cancel_batch, ("POST",), raw=False),
    # stored responses (server.http.responses_read)
    Route("/v1/responses/<response_id>", retrieve_response, ("GET",), raw=False),
    Route("/v1/responses/<response_id>/input_items", input_items, ("GET",), raw=False),
    Route("/v1/responses/<response_id>", delete_response, ("DELETE",), raw=False),
    Route("/v1/responses/<response_id>/cancel", cancel_response, ("POST",), raw=False),
    # the small GETs, served by Quart (server.http.info)
    _get("/health", info.health),
    _get("/ready", info.ready),
    _get("/metrics", info.metrics),
    _get("/tokenizer_info", info.tokenizer_info,
         enabled=lambda config: config.enable_tokenizer_info),
    _get("/load", info.load),
    _get("/version", info.version),
    _get("/v1/models", info.models),
    _get("/v1/models/<path:model_id>", info.model),
)


def raw_routes(config: ServerConfig) -> dict[str, Route]:
    """Path -> route, of the raw routes a server of ``config`` serves."""
    return {r.path: r for r in TABLE if r.raw and r.on(config)}


def quart_routes(config: ServerConfig) -> list[Route]:
    """The Quart routes a server of ``config`` serves."""
    return [r for r in TABLE if not r.raw and r.on(config)]
