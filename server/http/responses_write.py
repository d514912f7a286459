"""``POST /v1/responses`` on the generation path: the route object that
:func:`server.http.generate.handle_generate` calls to parse a body and write the answer
(with :mod:`server.http.answer`, the response side every generation route shares).

The request's life is the chat route's (generate.py's theory of operation): one task in a
cancel scope that the client's going away cancels, the stream's shielded aclose; a
rejection before the first output is a status code. Only the shape differs: a Response object
(:mod:`server.openai.responses_events`), or its event stream. After the first byte an engine
failure or a server-side abort (timeout, shutdown) ends the stream with
``response.failed`` (its ``error`` says why); a failure while a queued stream sends
heartbeats, before ``response.created``, is chat's ``data: {"error": ...}`` (the openai SDK
raises an ``APIError``). Once a stream's first tokens went out, the deltas that follow
are written by the worker's router, as chat's text is (:class:`ResponseSink`); the task
still writes the rest, and what the sink could not.

With a state store, parsing reads the earlier turn a ``previous_response_id`` names (and
the images it kept: their URLs are not fetched again), and a request with ``store`` keeps
its answer when it ends, before the last byte (:mod:`server.http.responses_store`). A
``background`` request is not run here: the app's service runs it
(:mod:`server.http.responses_background`), and the request answers the queued object, or
follows its events for ``stream``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from functools import partial

import trio

from ..connections.http11 import DirectBody
from ..connections.sink import ResponseSink
from ..errors import EngineError, ServiceUnavailable
from .answer import failure, started, stream_started, tokens_arrived, whole_failure
from ..openai.encode import dumps
from .asgi import header, watch_disconnect
from .owners import request_owner
from .post import off_loop
from ..openai.responses import ResponsesRequest, read_responses, translate_responses
from ..openai.responses_events import ResponseEvents, new_response, response_usage
from .responses_images import images_record, with_kept
from .responses_store import (KIND, images_before, keep_response, previous_context,
                              state_store)

__all__ = ["ROUTE", "PATH"]

log = logging.getLogger("server.http")

PATH = "/v1/responses"


class ResponsesRoute:
    """What handle_generate needs of a route: parse a body, write the answer."""

    id_prefix = "resp_"

    @staticmethod
    async def parse(app, scope: dict, body: bytes, engine_info: dict) -> ResponsesRequest:
        """The request (a big body is parsed in a worker thread: post.off_loop), with the
        earlier turns' items when it names a ``previous_response_id``."""
        config = app.server_config
        store = state_store(app)
        data = await off_loop(len(body), read_responses, body, store is not None)
        owner = request_owner(app, header(scope, b"authorization"))
        context: list = []
        kept: list = []
        size = len(body)
        previous = data.get("previous_response_id")
        if previous is not None:
            assert store is not None  # (else read_responses refused it)
            context, more, kept = await previous_context(store, owner, previous)
            size += more
        req = await off_loop(size, translate_responses, data, config.limits, None,
                             engine_info, config.tool_call_parser, context)
        with_kept(req.prompts, context, kept)  # (the earlier turns' images: not fetched)
        return dataclasses.replace(req, owner=owner)

    @staticmethod
    async def write(app, answer, stream, req: ResponsesRequest, response_id: str,
                    model: str, direct: DirectBody | None = None) -> None:
        """The answer: a Response object, or its events (``direct``: the connection's
        writes without a task, for the router's sink; None where it has none)."""
        config = app.server_config
        events = ResponseEvents(
            new_response(response_id, int(time.time()), model, req.echo),
            reasoning_parser=config.reasoning_parser, tools=req.chat.tools,
            thinking=req.chat.thinking,
        )
        keep = None
        store = state_store(app)
        if req.store and store is not None:  # (store is true only with one: read_responses)
            keep = partial(keep_response, store, req)
        if req.stream:
            observe_itl = app.metrics.of(answer.record.model).itl.observe
            await _write_stream(answer, stream, events, observe_itl, config.queued_heartbeat,
                                keep, direct)
        else:
            await _write_full(answer, stream, events, keep)


    @staticmethod
    async def start_background(app, req: ResponsesRequest, engine, adapter, response_id: str,
                               model: str) -> bytes:
        """Store a ``background`` request's response and start it in the app's service
        (server.http.responses_background): the queued Response object. The images it
        keeps go in first (the service writes the response)."""
        background = app.background
        if background is None:  # (read_responses refused it without a store: shutting down)
            raise ServiceUnavailable("The server is shutting down.", code="shutting_down")
        images = images_record(req.items, req.prompts, req.owner, response_id, int(time.time()))
        return await images_before(background.store, images, partial(
            background.start, req, engine, adapter, response_id, model))

    @staticmethod
    async def answer_background(app, answer, receive, req: ResponsesRequest,
                                queued: bytes) -> None:
        """The queued Response object; for ``stream`` its events as they are made (the
        client going away ends the stream, not the response)."""
        if not req.stream:
            await answer.json(queued)
            return
        background = app.background
        record = None
        if background is not None:
            record = await background.store.get(KIND, req.owner, json.loads(queued)["id"])
        await answer.start_stream()
        if record is not None:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope)
                    async for events in background.follow(  # type: ignore[union-attr]
                            record, -1):
                        await answer.send({"type": "http.response.body", "body": events,
                                           "more_body": True})
                    nursery.cancel_scope.cancel()
            except Exception:  # (the store failed: the response runs on; GET resumes it)
                log.exception("following background response %s failed", record.id)
        await answer.last(b"")


ROUTE = ResponsesRoute()


def _usage(per_choice: list[int], out) -> dict:
    """The usage of the route's one choice (one prompt, n = 1), ended by ``out``."""
    return response_usage(per_choice[0], out.completion_tokens, out.cached_tokens)


async def _kept(keep, events: ResponseEvents, sent: list[bytes] | None, body: bytes) -> bytes:
    """Store the response that ``body`` (its last events) ended, with the events ``sent``
    before them (``keep``: None when it is not stored); the stream's ``error`` event when
    the store refused it, else nothing."""
    if keep is None or sent is None:
        return b""
    error = await keep(events.response, b"".join(sent) + body)
    return b"" if error is None else events.error(error)


async def _write_stream(answer, stream, events: ResponseEvents, observe_itl, heartbeat,
                        keep=None, direct: DirectBody | None = None) -> None:
    """The event stream. Once its first tokens went out, the deltas that follow are written
    by the worker's router (a :class:`ResponseSink`, on a connection that offers ``direct``
    writes); this task wakes for the rest: items that close or open, the end, failures."""
    per_choice = await stream_started(answer, stream, heartbeat)
    if per_choice is None:
        return
    send = answer.send
    record = answer.record
    last = 0.0
    sent: list[bytes] | None = [] if keep is not None else None  # the events, to store
    sink: ResponseSink | None = None
    try:
        first = events.start()
        if sent is not None:
            sent.append(first)
        await send({"type": "http.response.body", "body": first, "more_body": True})
        while outs := await stream.next_batch():
            held = b""
            if sink is not None:  # what the sink left to this task goes first
                if sink.failed:
                    raise RuntimeError("the stream's events failed in its sink")
                if sink.torn:
                    rest, sink.torn = sink.torn, b""
                    await direct.send_torn(rest)  # type: ignore[union-attr]
                held, sink.held = sink.held, b""
                last = sink.last
            if outs[0].num_tokens:
                last = tokens_arrived(record, observe_itl, last)
            for o in outs:
                ended = o.finish_reason is not None
                body = held + events.feed(o.text, last=ended and o.finish_reason != "error")
                held = b""
                exc = failure(stream, o)
                if exc is not None:
                    record.failed(exc)
                    body += events.fail(exc)
                    await answer.last(body + await _kept(keep, events, sent, body))
                    return
                if ended:
                    body += events.end(o.finish_reason, _usage(per_choice, o))
                    body += await _kept(keep, events, sent, body)
                if body:
                    if sent is not None:
                        sent.append(body)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            if sink is not None:
                sink.last = last
            elif direct is not None and last:
                sink = _hand_over(stream, direct, events, observe_itl, last, sent)
                if sink is None:
                    direct = None  # (one try)
        stream.set_sink(None)
        await answer.last(b"")
    except Exception:
        stream.set_sink(None)
        log.exception("internal error while streaming %s", events.response["id"])
        exc = EngineError("Internal server error while streaming.")
        record.failed(exc)
        await answer.last(events.fail(exc))


def _hand_over(stream, direct: DirectBody, events: ResponseEvents, observe_itl, last: float,
               sent: list[bytes] | None) -> ResponseSink | None:
    """Let the router write this stream's deltas from now on; None when it cannot (a body
    that is not chunked: this task goes on writing them)."""
    if not direct.usable():
        return None
    sink = ResponseSink(direct, events, observe_itl, last, sent)
    return sink if stream.set_sink(sink) else None


async def _write_full(answer, stream, events: ResponseEvents, keep=None) -> None:
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
    body, events_bytes = await off_loop(len(text), _full_body, events, text,
                                        final.finish_reason, _usage(per_choice, final))
    if keep is not None:
        error = await keep(events.response, events_bytes)
        if error is not None:
            await answer.error(error)
            return
    await answer.json(body)


def _full_body(events: ResponseEvents, text: str, finish_reason: str,
               usage: dict) -> tuple[bytes, bytes]:
    """The Response object of the whole text, and the events a stream of it would have
    had (what a stored response replays). Sans-IO: a big one is built in a worker thread,
    see :func:`server.http.post.off_loop`."""
    stream = events.start() + events.feed(text, last=True) + events.end(finish_reason, usage)
    return dumps(events.response), stream
