"""The worker's side of ``/v1/embeddings``: an ``embed`` CALL request, checked, answered.

Example (the frame the frontend sends, and the answer)::

    [CALL, 7, {"op": "embed", "input": ["a cat", [5, 6]], "dimensions": None}]
    -> [RESULT, 7, {"data": [b"<float32 LE>", b"..."], "prompt_tokens": 5}, None]

When and why: an embedding is one forward pass and no state, so it rides the CALL round
trip (answered at once, between engine steps) instead of SUBMIT/STEP; an old worker answers
an ``embed`` op with a clear error, so the frame stays backward compatible. The engine's
part is one method, ``embed(inputs, options) -> (vectors, prompt_tokens)``, called once for
the whole batch of inputs. Vectors travel as little-endian float32 bytes: a quarter of
msgpack's float64 lists, and exactly what OpenAI's ``encoding_format: base64`` encodes.
Sans-IO.
"""

from __future__ import annotations

import sys
from array import array

from ..params import is_token_ids
from .base import Rejected, refuse_fault

__all__ = ["embed_request", "check_embed_request", "token_rows", "matryoshka",
           "MAX_INPUTS"]

#: Most inputs in one request (OpenAI's limit).
MAX_INPUTS = 2048


def check_embed_request(request: dict, info: dict) -> tuple[list, dict]:
    """(inputs, options) of a well-formed request for an engine whose HELLO info is
    ``info``; :class:`Rejected` otherwise (the frontend checks the same first: this is the
    worker not trusting its peer). A ``fault`` (the sim's test hook) is passed on: the
    caller refused it first for an engine that does not take it (:func:`refuse_fault`)."""
    embedding = info.get("embedding")
    if not isinstance(embedding, dict):
        raise Rejected(f"model {info.get('model')!r} is not an embedding model: the "
                       f"{info.get('engine', 'this')} engine serves it for generation only",
                       param="model")
    inputs = request.get("input")
    if (not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_INPUTS
            or not all(isinstance(i, str) or is_token_ids(i) for i in inputs)):
        raise Rejected(f"input must be 1 to {MAX_INPUTS} strings or lists of token ids",
                       param="input")
    dimensions = request.get("dimensions")
    if dimensions is not None:
        allowed = embedding.get("dimensions")
        if (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                or not 0 < dimensions <= embedding["size"]):
            raise Rejected(f"dimensions must be between 1 and {embedding['size']}",
                           param="dimensions")
        if dimensions != embedding["size"] and not (
                allowed is True or (isinstance(allowed, list) and dimensions in allowed)):
            raise Rejected(f"model {info.get('model')!r} does not support dimensions "
                           f"{dimensions}", param="dimensions")
    options: dict = {"dimensions": dimensions}
    fault = request.get("fault")
    if fault is not None:
        if not isinstance(fault, dict):
            raise Rejected("'fault' must be an object", param="fault")
        options["fault"] = fault
    return inputs, options


def token_rows(inputs: list, tokenizer, *, vocab_size: int, max_model_len: int) -> list:
    """The token ids of each input, with a Hugging Face tokenizer (strings encoded with
    its special tokens, as sentence-transformers and vLLM do); :class:`Rejected` for an
    id outside the vocabulary, an input with no tokens or over the context."""
    rows = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            ids = list(tokenizer.encode(item))
        else:
            ids = list(item)
            if any(not 0 <= t < vocab_size for t in ids):
                raise Rejected(f"input[{i}]: token ids must be between 0 and {vocab_size - 1}",
                               param=f"input[{i}]")
        if not ids:
            raise Rejected(f"input[{i}] has no tokens", param=f"input[{i}]")
        if len(ids) > max_model_len:
            raise Rejected(f"input[{i}] has {len(ids)} tokens; this model's maximum "
                           f"context length is {max_model_len} tokens", param=f"input[{i}]")
        rows.append(ids)
    return rows


def matryoshka(config) -> list[int] | bool:
    """The dimensions the model may be cut to (vLLM reads the same config fields): a list,
    True for any, False for none."""
    dims = getattr(config, "matryoshka_dimensions", None)
    if isinstance(dims, list) and dims:
        return [int(d) for d in dims]
    return bool(getattr(config, "is_matryoshka", False))


def _packed(vector) -> bytes:
    data = array("f", vector)
    if sys.byteorder == "big":
        data.byteswap()
    return data.tobytes()


def embed_request(engine, request: dict) -> list:
    """``[result, None]`` or ``[None, err]`` for an ``embed`` request (one carrying a
    ``fault`` for an engine that does not take it: refused, 400)."""
    embed = getattr(engine, "embed", None)
    try:
        refuse_fault(engine, request.get("fault"))
        inputs, options = check_embed_request(
            request, engine.info if embed is not None else {**engine.info, "embedding": None})
        assert embed is not None  # (an engine without embed has no "embedding" info)
        vectors, prompt_tokens = embed(inputs, options)
        return [{"data": [_packed(v) for v in vectors], "prompt_tokens": int(prompt_tokens)},
                None]
    except Rejected as exc:
        return [None, exc.err(request)]
    except Exception as exc:
        return [None, ["engine_error", f"the engine could not embed: {exc!r:.200}"]]
