"""``POST /v1/completions`` and ``POST /v1/chat/completions`` on raw ASGI.

Theory of operation
-------------------
One request, one nursery::

    handle_generate (the writer)
    ├── read and validate the body      -> 4xx before anything is sent
    ├── dispatch to the engine          -> 503 if no worker can take it
    ├── nursery
    │   ├── watch_disconnect            the cancellation monitor: cancels the nursery when
    │   │                               the client goes away
    │   └── (this task) write           wait_started (-> 4xx/5xx with a status), then the
    │                                   stream: one send per batch of ready outputs
    └── the stream's aclose             shielded and bounded: aborts what is unfinished

Errors after the first byte never reach hypercorn: an engine failure ends the stream with an
``error`` event and ``data: [DONE]``; a server-side abort ends each open choice with
``finish_reason: "abort"`` and ``data: [DONE]``; a bug is logged and ends the stream the
same way as an engine failure.
"""

from __future__ import annotations

import logging
import time
import uuid

import trio

from ..errors import EngineError, RequestTimeout, ServerError, ServiceUnavailable
from . import schema
from .asgi import read_body, send_error, send_json, watch_disconnect
from .encode import DONE, ChunkEncoder, completion_body, error_event

__all__ = ["handle_generate"]

log = logging.getLogger("server.http")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


async def handle_generate(app, scope: dict, receive, send, *, chat: bool) -> None:
    """Serve one generation request; never raises into the ASGI server (but Cancelled)."""
    config = app.server_config
    try:
        body = await read_body(scope, receive, config.max_body_bytes)
        if body is None:
            return
        engine = app.require_engine()
        parse = schema.parse_chat if chat else schema.parse_completion
        req = parse(body, config.limits, engine.model_name)
        limit = config.max_concurrent_requests
        if limit is not None and engine.open_streams >= limit:
            raise ServiceUnavailable(
                f"The server is at its limit of {limit} concurrent requests; retry later.",
                code="server_overloaded",
            )
        stream = engine.generate_many(req.prompts, req.params, timeout=config.request_timeout)
    except ServerError as exc:
        await send_error(send, exc)
        return
    except Exception:
        log.exception("internal error before the response started")
        await send_error(send, ServerError("Internal server error."))
        return
    response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope)
        try:
            async with stream:
                if req.stream:
                    await _write_stream(send, stream, req, response_id, engine.model_name)
                else:
                    await _write_full(send, stream, req, response_id, engine.model_name)
        finally:
            nursery.cancel_scope.cancel()


async def _started(send, stream) -> list[int] | None:
    """Prompt token counts once the engine has started; else answer with a status."""
    try:
        return await stream.wait_started()
    except ServerError as exc:
        await send_error(send, exc)
        return None


def _abort_error(cause: str) -> ServerError:
    """What a non-streaming request aborted by the server is answered with."""
    if cause == "timeout":
        return RequestTimeout("The request took longer than the server's request timeout.")
    return ServiceUnavailable("The server is shutting down.", code="shutting_down")


def _prompt_tokens(per_choice: list[int], n: int) -> int:
    """Usage counts each prompt once, not once per sample."""
    return sum(per_choice[::n])


async def _write_stream(send, stream, req, response_id: str, model: str) -> None:
    per_choice = await _started(send, stream)
    if per_choice is None:
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    enc = ChunkEncoder(chat=req.chat, response_id=response_id, created=int(time.time()), model=model)
    n = req.params.n
    first = []
    for index in range(len(per_choice)):
        if req.chat:
            first.append(enc.role(index))
        elif req.echo:
            first.append(enc.delta(index, req.prompts[index // n]))
    completion_tokens = 0
    try:
        if first:
            await send({"type": "http.response.body", "body": b"".join(first), "more_body": True})
        async for out in stream:
            outs = stream.take_ready_nowait()
            if outs:
                outs.insert(0, out)
            else:
                outs = (out,)
            parts = []
            for o in outs:
                if o.finish_reason == "error":
                    if o.text:  # text merged in before the failure still goes out
                        parts.append(enc.delta(o.index, o.text))
                    parts.append(error_event(o.exception()))
                    parts.append(DONE)
                    await send({"type": "http.response.body", "body": b"".join(parts), "more_body": False})
                    return
                if o.finish_reason is not None:
                    completion_tokens += o.completion_tokens
                parts.append(enc.delta(o.index, o.text, o.finish_reason))
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        tail = DONE
        if req.include_usage:
            tail = enc.usage(_prompt_tokens(per_choice, n), completion_tokens) + DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})
    except Exception:
        log.exception("internal error while streaming %s", response_id)
        end = error_event(EngineError("Internal server error while streaming.")) + DONE
        await send({"type": "http.response.body", "body": end, "more_body": False})


async def _write_full(send, stream, req, response_id: str, model: str) -> None:
    per_choice = await _started(send, stream)
    if per_choice is None:
        return
    k = len(per_choice)
    n = req.params.n
    texts: list[list[str]] = [[] for _ in range(k)]
    if req.echo:
        for index in range(k):
            texts[index].append(req.prompts[index // n])
    reasons: list[str | None] = [None] * k
    completion_tokens = 0
    async for out in stream:
        if out.finish_reason == "error":
            await send_error(send, out.exception())
            return
        if out.finish_reason == "abort" and stream.abort_cause is not None:
            await send_error(send, _abort_error(stream.abort_cause))
            return
        texts[out.index].append(out.text)
        if out.finish_reason is not None:
            reasons[out.index] = out.finish_reason
            completion_tokens += out.completion_tokens
    body = completion_body(
        chat=req.chat,
        response_id=response_id,
        created=int(time.time()),
        model=model,
        texts=["".join(t) for t in texts],
        finish_reasons=reasons,
        prompt_tokens=_prompt_tokens(per_choice, n),
        completion_tokens=completion_tokens,
    )
    await send_json(send, 200, body)
