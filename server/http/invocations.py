"""``POST /invocations``: SageMaker's one inference endpoint, dispatched by the body's shape.

Theory of operation: vLLM serves ``/invocations`` by trying its request types in a fixed
order, chat completions, completions, then embeddings (then its pooling kinds), and hands
the body to the first route whose request model validates it; a body none validates is a
400 "Cannot find suitable handler for request". This server dispatches in the same order by
the key that makes each request what it is (the field each of vLLM's request models
requires), then lets that route do everything else, so the answer is exactly the route's:

* ``messages`` -> ``/v1/chat/completions`` (streaming included),
* ``prompt`` (or ``prompt_embeds``, which completions refuses by name) -> ``/v1/completions``,
* ``input`` -> ``/v1/embeddings``.

A body with none of them, or with the keys of a kind vLLM serves and this server does not
(rerank's ``query`` and ``documents``; score's ``text_1``/``text_2``, ``data_1``/``data_2``,
``queries`` with ``documents`` or ``items``), is a 400 naming why. One difference from vLLM:
a body with ``messages`` that the chat route refuses gets the chat route's 400 (naming the
field), where vLLM tries the next kind and ends with its generic message.

:func:`invocation_route` is the sans-IO rule; :func:`handle_invocations` reads the body
(API key, method, content type and limits as every POST route: :mod:`server.http.post`),
picks the route and serves the request through the app's own dispatch, with the body
replayed to the route's ``receive`` (which then passes on to the connection's, for the
disconnect watch). The body's top-level keys are read without building the values; the
route then parses the body as it would its own.
"""

from __future__ import annotations

import msgspec

from ..errors import ClientError
from ..openai.schema import decode_json
from .asgi import send_error
from .post import off_loop, read_json_post, refusal

__all__ = ["PATH", "handle_invocations", "invocation_route"]

PATH = "/invocations"

#: The request kinds served here, in vLLM's order: (the key that marks one, its route).
_SERVED = (
    (("messages",), "/v1/chat/completions"),
    (("prompt", "prompt_embeds"), "/v1/completions"),
    (("input",), "/v1/embeddings"),
)
#: vLLM's kinds this server does not serve: (the keys that mark one, all of them, its name).
_NOT_SERVED = (
    (("query", "documents"), "rerank"),
    (("text_1", "text_2"), "score"),
    (("data_1", "data_2"), "score"),
    (("queries", "documents"), "score"),
    (("queries", "items"), "score"),
)
_EXPECTED = ("chat completions ('messages'), completions ('prompt') or embeddings "
             "('input')")

_decode_keys = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def _keys(body: bytes) -> set[str]:
    """The body's top-level keys (its values are scanned, not built); a ClientError, in
    the routes' words, when it is not a JSON object."""
    try:  # (a key given as null is absent, as a client that sends every field means it)
        return {key for key, raw in _decode_keys(body).items() if bytes(raw) != b"null"}
    except (msgspec.DecodeError, RecursionError):
        # Not an object, or JSON msgspec refuses (NaN, 1e400) or bad: the routes' parse
        # says what is wrong, or takes it (then its fields decide, as on the route).
        return {key for key, value in decode_json(body).items() if value is not None}


def invocation_route(body: bytes) -> str:
    """The route that serves an ``/invocations`` body (module docstring); a 400 naming why
    for a body that is none of them."""
    keys = _keys(body)
    for marks, route in _SERVED:
        if keys.intersection(marks):
            return route
    for marks, kind in _NOT_SERVED:
        if keys.issuperset(marks):
            raise ClientError(
                f"This body is a {kind} request (it has {' and '.join(map(repr, marks))}); "
                f"this server does not serve {kind}. /invocations serves {_EXPECTED}.",
                code="unsupported_request_type",
            )
    raise ClientError(
        f"Cannot find suitable handler for request. Expected one of: {_EXPECTED}.",
        code="unsupported_request_type",
    )


async def handle_invocations(
    app, path: str, scope: dict, receive, send, headers: list, request_id: str
) -> None:
    """Serve one ``/invocations`` request (a route of :mod:`server.http.routes`); never
    raises into the ASGI server (but Cancelled). The request is then served as one to
    the route its body picks would be (``app.serve_route``)."""
    try:
        body = await read_json_post(app, scope, receive)
        if body is None:
            return  # the client went away
        route = await off_loop(len(body), invocation_route, body)
    except Exception as exc:
        error, extra = await refusal(exc, scope, receive, app.server_config, f"in {PATH}")
        await send_error(send, error, headers + extra)
        return
    await app.serve_route(route, scope, _replay(body, receive), send, headers, request_id)


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` whole first, then whatever ``receive`` gives."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
