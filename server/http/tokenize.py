"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes, answered by a worker.

Example::

    POST /tokenize    {"prompt": "Hello world"}
    -> {"count": 2, "max_model_len": 4096, "tokens": [9707, 1879], "token_strs": null}
    POST /tokenize    {"messages": [{"role": "user", "content": "Hi"}]}   (as for generation)
    POST /detokenize  {"tokens": [9707, 1879]}
    -> {"prompt": "Hello world"}

The frontend never loads a tokenizer: the request goes to the least loaded worker (a
CALL round trip, answered between engine steps) whose tokenizer is the one generation
uses, so the ids are exactly those a generation request's prompt becomes. An engine without
a tokenizer (the sim engine) answers 400. Parsing is sans-IO (:func:`parse_tokenize`,
:func:`parse_detokenize`); :func:`handle_tokenize` is the thin ASGI shell.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ClientError, NotFound, clip
from ..params import is_token_ids
from .asgi import send_error, send_json
from ..openai.encode import dumps, dumps_sliced
from ..openai.fields import is_neutral
from .post import BIG_BODY, off_loop, read_json_post, refusal
from ..openai.schema import decode_json, messages_of, template_kwargs_of, template_options
from ..openai.tools import render_tools
from ..worker_protocol.wire import release_sliced

if TYPE_CHECKING:
    from ..observability.record import RequestRecord

__all__ = ["handle_tokenize", "parse_tokenize", "parse_detokenize", "serve_worker_op"]

#: vLLM's tokenize fields this server does not honour -> the values that mean "not used":
#: a template from the request (Jinja the worker would run; generation refuses it too), and
#: the multimodal processors' options (text models only).
_REFUSED: dict[str, tuple] = {
    "chat_template": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
}


def _model(data: dict, served_model: str) -> None:
    model = data.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ClientError("'model' must be a string.", param="model")
    if model != served_model:
        raise NotFound(
            f"The model '{clip(model)}' does not exist.", param="model", code="model_not_found"
        )


def parse_tokenize(body: bytes, served_model: str) -> dict:
    """The CALL request of a ``/tokenize`` body (400/404 on bad input)."""
    data = decode_json(body)
    _model(data, served_model)
    for name, neutral in _REFUSED.items():
        if not is_neutral(data.get(name), neutral):
            raise ClientError(
                f"'{name}' is not supported by this server's /tokenize.", param=name,
                code="unsupported_parameter",
            )
    special = data.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise ClientError("'add_special_tokens' must be a boolean.", param="add_special_tokens")
    strs = data.get("return_token_strs")
    if strs is not None and not isinstance(strs, bool):
        raise ClientError("'return_token_strs' must be a boolean.", param="return_token_strs")
    if ("prompt" in data) == ("messages" in data):
        raise ClientError("Give either 'prompt' or 'messages'.", param="prompt")
    if "prompt" in data:
        for name in ("tools", "chat_template_kwargs", "add_generation_prompt",
                     "continue_final_message"):
            if data.get(name) not in (None, [], {}):
                raise ClientError(f"'{name}' goes with 'messages': a prompt is not rendered "
                                  "with the chat template.", param=name)
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise ClientError("'prompt' must be a string.", param="prompt")
        request = {"op": "tokenize", "prompt": prompt,
                   "add_special_tokens": True if special is None else special}
        if strs:
            request["token_strs"] = True
        return request
    # Rendered as a chat completion with the same fields would be: its tools (and tool
    # calls and results in the history), its template variables and options; vLLM's
    # add_special_tokens (default false here) adds the tokenizer's own (a BOS) to it.
    messages = messages_of(data, tools_ok=True)
    request = {"op": "tokenize", "prompt": {"messages": messages,
                                             **template_options(data, messages)}}
    if special:
        request["add_special_tokens"] = True
    if strs:
        request["token_strs"] = True
    tools = render_tools(data)
    if tools:
        request["tools"] = tools
    template_kwargs = template_kwargs_of(data)
    if template_kwargs is not None:
        request["template_kwargs"] = template_kwargs
    return request


def parse_detokenize(body: bytes, served_model: str) -> dict:
    """The CALL request of a ``/detokenize`` body (400/404 on bad input)."""
    data = decode_json(body)
    _model(data, served_model)
    tokens = data.get("tokens")
    if not is_token_ids(tokens):
        raise ClientError("'tokens' must be a list of token ids.", param="tokens")
    return {"op": "detokenize", "tokens": tokens}


async def serve_worker_op(app, scope: dict, receive, send, headers: list, parse, answer, *,
                          call=None, content_type: bytes = b"application/json",
                          record: RequestRecord | None = None) -> None:
    """Serve one request answered by a worker round trip (/tokenize, /detokenize,
    /v1/embeddings); never raises into the ASGI server (but Cancelled). ``parse(body,
    model, info) -> (request, context)`` is sans-IO and raises the client's errors;
    ``answer(context, result) -> bytes`` makes the JSON body from the worker's result. Both
    run off the event loop when their input is big. ``call(engine, request)``: what
    answers instead of one worker's round trip (the LoRA endpoints: every worker's).
    ``record``: filled in for the request's log line (/v1/embeddings), which the caller
    writes."""
    try:
        body = await read_json_post(app, scope, receive)
        if body is None:
            if record is not None:
                record.client_disconnected = True
            return  # the client went away
        engine = (await app.models.pool_for(body)).require_engine()
        if record is not None:
            record.model = engine.model_name
        request, context = await off_loop(len(body), parse, body, engine.model_name,
                                          engine.info)
        if record is not None:
            record.dispatched(False, 1)
        result = await (engine.tokenize(request) if call is None else call(engine, request))
        if record is not None and isinstance(result, dict):
            record.finish_reasons = ["stop"]
            record.prompt_tokens = int(result.get("prompt_tokens") or 0)
        size = _result_size(result)
        # (a worker's fresh result, held nowhere else, is emptied once answered)
        fresh = call is None and size >= BIG_BODY
        data = await off_loop(size, _answer_releasing, answer, context, result, fresh)
    except Exception as exc:
        error, extra = await refusal(exc, scope, receive, app.server_config,
                                     f"in {scope['path']}")
        if record is not None:
            record.failed(error)
            record.status = error.status
        await send_error(send, error, headers + extra)
        return
    if record is not None:
        record.status = 200
    await send_json(send, 200, data, headers, content_type=content_type)


def _answer_releasing(answer, context, result, fresh: bool) -> bytes:
    """``answer(context, result)``; then, for a ``fresh`` result (a big one, which this
    thread holds beside the loop's task only), its long lists emptied a slice per call
    (``wire.release_sliced``): freeing the 3.5M ids of a /tokenize is one call of 70-110
    ms, which would stop every stream wherever it ran, the loop's task dropping it or this
    thread."""
    try:
        return answer(context, result)
    finally:
        if fresh:
            release_sliced(result)


def _result_size(result) -> int:
    """About the bytes of the JSON answer to a worker's ``result`` (to tell a big one:
    embeddings' floats, /tokenize's ids, /detokenize's text)."""
    if not isinstance(result, dict):
        return 0
    size = sum(len(v) for v in result.get("data", ())) * 3
    for name in ("tokens", "token_strs", "prompt"):
        value = result.get(name)
        if isinstance(value, (list, str)):
            size += len(value) * 8
    return size


def _tokenize_answer(op: str, result: dict) -> bytes:
    """The answer's JSON; a big one in a worker thread (:func:`dumps_sliced`: 3.5M ids are
    encoded a slice per call, so the event loop gets the GIL between them)."""
    if op == "tokenize":
        tokens = result["tokens"]
        return dumps_sliced({"count": len(tokens), "max_model_len": result["max_model_len"],
                             "tokens": tokens, "token_strs": result.get("token_strs")})
    return dumps({"prompt": result["prompt"]})


def _parse_tokenize(body: bytes, model: str, info: dict) -> tuple[dict, str]:
    return parse_tokenize(body, model), "tokenize"


def _parse_detokenize(body: bytes, model: str, info: dict) -> tuple[dict, str]:
    return parse_detokenize(body, model), "detokenize"


async def handle_tokenize(app, path: str, scope: dict, receive, send, headers: list,
                          request_id: str, *, op: str) -> None:
    """Serve one /tokenize or /detokenize request (``op``; a route of
    :mod:`server.http.routes`); never raises into the ASGI server (but Cancelled)."""
    parse = _parse_tokenize if op == "tokenize" else _parse_detokenize
    await serve_worker_op(app, scope, receive, send, headers, parse, _tokenize_answer)
