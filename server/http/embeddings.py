"""``POST /v1/embeddings``, in OpenAI's shape, answered by a worker in one batch.

Example::

    POST /v1/embeddings  {"model": "bge-small", "input": ["a cat", "a dog"]}
    -> {"object": "list", "model": "bge-small",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.01, ...]}, ...],
        "usage": {"prompt_tokens": 6, "total_tokens": 6}}

Every field of OpenAI's request is honoured (``input``, ``model``, ``encoding_format``,
``dimensions``, ``user``); vLLM's extensions are refused unless at their defaults, and any
other field is a 400 naming it (an embeddings client that sends a field it means has no
other way to learn it was dropped). Parsing is sans-IO (:func:`parse_embeddings`); the
whole request goes to the least loaded worker as one ``embed`` CALL round trip (see
:mod:`server.workers.embed`): one engine forward for all its inputs.
"""

from __future__ import annotations

import base64
import sys
import time
from array import array

from ..errors import ClientError, NotFound, clip
from ..observability import RequestRecord, log_request
from ..params import is_token_ids
from ..openai.encode import dumps_document
from ..openai.fields import check_route_fields
from ..openai.schema import decode_json
from .tokenize import serve_worker_op

__all__ = ["handle_embeddings", "parse_embeddings", "embeddings_answer", "HONOURED", "REFUSED",
           "MAX_INPUTS", "PATH"]

PATH = "/v1/embeddings"

#: The fields read here (OpenAI's request schema, all of it).
HONOURED = frozenset({"input", "model", "encoding_format", "dimensions", "user"})

#: vLLM's extensions, not honoured: field -> the values that mean "not used".
REFUSED: dict[str, tuple] = {
    "truncate_prompt_tokens": (None,),
    "add_special_tokens": (None, True),
    "normalize": (None, True),
    "embed_dtype": (None, "float32"),
    "priority": (None, 0),
    "request_id": (None,),
    "messages": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "cache_salt": (None,),
}

#: Most inputs in one request (OpenAI's limit; the worker checks the same).
MAX_INPUTS = 2048


def _inputs(data: dict) -> list:
    """The inputs as a list of strings and token-id lists (OpenAI's four shapes)."""
    value = data.get("input")
    if value is None:
        raise ClientError("'input' is required.", param="input")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]  # one input as token ids
    if not isinstance(value, list) or not value:
        raise ClientError("'input' must be a non-empty string, a list of strings, a list of "
                          "token ids or a list of lists of token ids.", param="input")
    if len(value) > MAX_INPUTS:
        raise ClientError(f"'input' may hold at most {MAX_INPUTS} inputs.", param="input")
    kind = str if isinstance(value[0], str) else list
    for i, item in enumerate(value):
        if not isinstance(item, kind) or (kind is list and not is_token_ids(item)):
            raise ClientError("'input' must be all strings or all lists of token ids "
                              "(integers from 0 to 2**31 - 1).", param=f"input[{i}]")
        if not item:
            raise ClientError("An input must not be empty.", param=f"input[{i}]")
    return value


def _dimensions(data: dict, model: str, embedding: dict) -> int | None:
    value = data.get("dimensions")
    if value is None:
        return None
    size = embedding.get("size")
    if not isinstance(size, int):
        raise ClientError("The engine did not say its embedding size.", param="dimensions")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ClientError("'dimensions' must be a positive integer.", param="dimensions")
    if value == size:
        return None  # the model's own size: nothing to cut
    allowed = embedding.get("dimensions")
    if isinstance(allowed, list):
        ok = value in allowed
        which = f"one of {sorted(allowed)}"
    else:
        ok = allowed is True and value < size
        which = f"1 to {size}" if allowed is True else f"only its own size, {size}"
    if not ok:
        raise ClientError(
            f"'dimensions' {value} is not supported by model '{clip(model)}' (it makes "
            f"{size}-dimensional embeddings and supports {which}).",
            param="dimensions", code="unsupported_parameter",
        )
    return value


def _not_an_embedding_model(model: str, info: dict) -> ClientError:
    engine = info.get("engine")
    why = ("it is a generation model" if engine != "vllm" else "the vllm engine serves "
           "embeddings with vLLM's pooling runner only (--engine-arg runner=pooling)")
    return ClientError(f"The model '{clip(model)}' does not serve /v1/embeddings: {why}.",
                       param="model", code="model_not_supported")


def parse_embeddings(body: bytes, served_model: str, info: dict) -> tuple[dict, tuple]:
    """(the worker's ``embed`` request, (encoding_format, model)) of a body; 400/404 on bad
    input. ``info``: the engine's HELLO info (its ``embedding`` entry, if it has one)."""
    data = decode_json(body)
    check_route_fields(data, HONOURED, REFUSED, "/v1/embeddings")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError("'model' must be a string.", param="model")
    if model is not None and model != served_model:
        raise NotFound(f"The model '{clip(model)}' does not exist.", param="model",
                       code="model_not_found")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise ClientError("'user' must be a string.", param="user")
    encoding = data.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise ClientError("'encoding_format' must be 'float' or 'base64'.",
                          param="encoding_format")
    inputs = _inputs(data)
    embedding = info.get("embedding")
    if not isinstance(embedding, dict):
        raise _not_an_embedding_model(served_model, info)
    dimensions = _dimensions(data, served_model, embedding)
    return ({"op": "embed", "input": inputs, "dimensions": dimensions},
            (encoding, served_model))


def _floats(data: bytes) -> list[float]:
    vector = array("f")
    vector.frombytes(data)
    if sys.byteorder == "big":
        vector.byteswap()
    return vector.tolist()


def embeddings_answer(context: tuple, result: dict) -> bytes:
    """The JSON body for the worker's result: each vector as floats or as base64 of its
    little-endian float32 bytes (what OpenAI's ``encoding_format: base64`` means)."""
    encoding, model = context
    if encoding == "base64":
        def encode(v):
            return base64.b64encode(v).decode("ascii")
    else:
        encode = _floats
    tokens = result["prompt_tokens"]
    return dumps_document({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                 for i, v in enumerate(result["data"])],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })


async def handle_embeddings(app, path: str, scope: dict, receive, send, headers: list,
                            request_id: str) -> None:
    """Serve one /v1/embeddings request (a route of :mod:`server.http.routes`); never
    raises into the ASGI server (but Cancelled). It is logged in one line, as a generation
    request is, but not counted in the generation metrics."""
    record = RequestRecord(request_id, path)
    try:
        await serve_worker_op(app, scope, receive, send, headers, parse_embeddings,
                              embeddings_answer, record=record)
    finally:
        record.finish = time.perf_counter()
        log_request(record)
