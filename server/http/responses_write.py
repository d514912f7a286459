"""``POST /v1/responses`` on the generation path: the route object that
:func:`server.http.generate.handle_generate` calls to parse a body and write the answer
(with :mod:`server.http.answer`, the response side every generation route shares).

The request's life is the chat route's (generate.py's theory of operation): one nursery,
the disconnect monitor, the stream's shielded aclose; a rejection before the first output
is a status code. Only the shape differs: a Response object
(:mod:`server.openai.responses_events`), or its event stream. After the first byte an engine
failure or a server-side abort (timeout, shutdown) ends the stream with
``response.failed`` (its ``error`` says why); a failure while a queued stream sends
heartbeats, before ``response.created``, is chat's ``data: {"error": ...}`` (the openai SDK
raises an ``APIError``).
"""

from __future__ import annotations

import logging
import time

from ..errors import EngineError
from .answer import failure, started, stream_started, tokens_arrived, whole_failure
from ..openai.encode import dumps
from .post import off_loop
from ..openai.responses import ResponsesRequest, parse_responses
from ..openai.responses_events import ResponseEvents, new_response, response_usage

__all__ = ["ROUTE", "PATH"]

log = logging.getLogger("server.http")

PATH = "/v1/responses"


class ResponsesRoute:
    """What handle_generate needs of a route: parse a body, write the answer."""

    id_prefix = "resp_"

    @staticmethod
    def parse(body: bytes, config, model: str | None, engine_info: dict) -> ResponsesRequest:
        """Sans-IO (a big body is parsed in a worker thread: post.off_loop)."""
        return parse_responses(body, config.limits, model, engine_info,
                               config.tool_call_parser)

    @staticmethod
    async def write(app, answer, stream, req: ResponsesRequest, response_id: str,
                    model: str) -> None:
        config = app.server_config
        events = ResponseEvents(
            new_response(response_id, int(time.time()), model, req.echo),
            reasoning_parser=config.reasoning_parser, tools=req.chat.tools,
            thinking=req.chat.thinking,
        )
        if req.stream:
            observe_itl = app.metrics.of(answer.record.model).itl.observe
            await _write_stream(answer, stream, events, observe_itl, config.queued_heartbeat)
        else:
            await _write_full(answer, stream, events)


ROUTE = ResponsesRoute()


def _usage(per_choice: list[int], out) -> dict:
    """The usage of the route's one choice (one prompt, n = 1), ended by ``out``."""
    return response_usage(per_choice[0], out.completion_tokens, out.cached_tokens)


async def _write_stream(answer, stream, events: ResponseEvents, observe_itl, heartbeat) -> None:
    per_choice = await stream_started(answer, stream, heartbeat)
    if per_choice is None:
        return
    send = answer.send
    record = answer.record
    last = 0.0
    try:
        await send({"type": "http.response.body", "body": events.start(), "more_body": True})
        while outs := await stream.next_batch():
            if outs[0].num_tokens:
                last = tokens_arrived(record, observe_itl, last)
            for o in outs:
                ended = o.finish_reason is not None
                body = events.feed(o.text, last=ended and o.finish_reason != "error")
                exc = failure(stream, o)
                if exc is not None:
                    record.failed(exc)
                    await answer.last(body + events.fail(exc))
                    return
                if ended:
                    body += events.end(o.finish_reason, _usage(per_choice, o))
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        await answer.last(b"")
    except Exception:
        log.exception("internal error while streaming %s", events.response["id"])
        exc = EngineError("Internal server error while streaming.")
        record.failed(exc)
        await answer.last(events.fail(exc))


async def _write_full(answer, stream, events: ResponseEvents) -> None:
    per_choice = await started(answer, stream)
    if per_choice is None:
        return
    record = answer.record
    texts = []
    final = None
    async for out in stream:
        exc = whole_failure(record, stream, out)
        if exc is not None:
            await answer.error(exc)
            return
        texts.append(out.text)
        if out.finish_reason is not None:
            final = out
    if final is None:  # (the stream ended without finishing its choice: not expected)
        await answer.error(EngineError("The engine ended the request without an answer."))
        return
    text = "".join(texts)
    await answer.json(await off_loop(len(text), _full_body, events, text, final.finish_reason,
                                     _usage(per_choice, final)))


def _full_body(events: ResponseEvents, text: str, finish_reason: str, usage: dict) -> bytes:
    """The Response object of the whole text (sans-IO: a big one is built in a worker
    thread, see :func:`server.http.post.off_loop`)."""
    events.feed(text, last=True)
    events.end(finish_reason, usage)
    return dumps(events.response)
