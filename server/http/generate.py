"""The generation routes on raw ASGI: ``POST /v1/completions`` and
``/v1/chat/completions`` here, ``/v1/responses`` and ``/v1/chat/completions/batch`` through
their route objects (:mod:`server.http.responses_write`, :mod:`server.http.chat_batch`),
all answered with :mod:`server.http.answer`.

Theory of operation
-------------------
One request, one task::

    handle_generate (the writer)
    ├── API key, method, content type   -> 401, 405, 415 (after the body: see discard_body)
    ├── read and validate the body      -> 4xx before anything is sent
    ├── dispatch to the engine          -> 503 if no worker can take it, or over an
    │                                   explicit admission limit (else it queues there)
    ├── cancel scope                    cancelled when the client goes away: this
    │   │                               server's connection says so (DirectBody.
    │   │                               on_disconnect, when hypercorn ends the stream)
    │   └── write                       wait_started (-> 4xx/5xx with a status), then the
    │                                   stream: one send per batch of ready outputs
    └── the stream's aclose             shielded and bounded: aborts what is unfinished

Served through hypercorn's public ``serve()`` (no ``DirectBody``), the scope is a nursery's,
and a second task, ``watch_disconnect``, parked in ``receive``, cancels it instead.

Errors after the first byte never reach hypercorn: an engine failure ends the stream with an
``error`` event and ``data: [DONE]``; a server-side abort ends each open choice with
``finish_reason: "abort"`` and ``data: [DONE]``; a bug is logged and ends the stream the
same way as an engine failure.

Observability: the request's :class:`~server.observability.RequestRecord` (made by
:func:`serve_generation`, which records and logs it when this returns) gets the dispatch
time, the status and errors answered, a client disconnect, the time of the first output,
and at the end how each choice ended. Every response start carries the app's extra
headers (``X-Request-Id``, CORS). The only work per streamed write is a clock read and one
lock-free histogram observation (inter-token latency); body messages go straight to the
ASGI server's ``send``.
"""

from __future__ import annotations

import dataclasses

import logging
import time

import trio

from ..errors import ClientError, EngineError, ServerError
from ..observability import log_request
from ..observability.logs import request_id_from_header
from ..observability.record import RequestRecord
from ..openai import schema
from .adapters import resolve_model
from .images import fetch_images, has_images
from .answer import Answer, Usage, stream_started, tokens_arrived, write_full
from .asgi import CLOSE, header, send_error, watch_disconnect
from ..openai.encode import DONE, ChunkEncoder, usage
from ..openai.events import RichEvents
from ..openai.token_ids import StreamIds
from .orca import REQUEST_HEADER as ORCA_FORMAT
from .orca import load_report, named_metrics
from .post import off_loop, read_json_post, refusal
from ..connections.http11 import DIRECT_BODY, DirectBody
from ..connections.sink import TextSink

__all__ = ["echo_texts", "handle_generate", "serve_generation"]

log = logging.getLogger("server.http")

_now = time.perf_counter


async def serve_generation(
    app, path: str, scope: dict, receive, send, headers: list, request_id: str, *,
    chat: bool, route=None,
) -> None:
    """A generation route's entry (:mod:`server.http.routes`), serving the request as one to
    ``path`` (``/invocations`` dispatches to one): the ORCA load report when a
    load balancer asks for one, then :func:`handle_generate` with the request's
    :class:`RequestRecord`, recorded in the metrics, logged and traced however it ends."""
    orca = header(scope, ORCA_FORMAT)
    if orca is not None and app.authorized(scope):
        # a load balancer asks for a load report (server.http.orca)
        try:  # (every model's pool: the report comes before the body names one)
            engines = app.models.engines()
            latest = [w.report.latest or {} for e in engines for w in e.workers if w.alive]
            kv_usage = [r["kv_cache_usage"] for r in latest if "kv_cache_usage" in r]
            metrics = named_metrics([e.statistics() for e in engines], kv_usage)
            headers = [*headers, load_report(orca, metrics)]
        except ServerError as exc:
            await send_error(send, exc, [*headers, CLOSE])
            return
    record = RequestRecord(request_id, path)
    try:
        await handle_generate(app, scope, receive, send, chat=chat, record=record,
                              headers=headers, route=route)
    finally:
        record.finish = _now()
        app.metrics.of(record.model).observe(record)
        log_request(record)
        if app.tracing is not None:
            app.tracing.export(record, record.model or app.models.default.name,
                               header(scope, b"traceparent"))


async def handle_generate(
    app, scope: dict, receive, send, *, chat: bool, record: RequestRecord, headers: list,
    route=None,
) -> None:
    """Serve one generation request; never raises into the ASGI server (but Cancelled).

    ``record`` is filled in as the request goes (the caller records it when this returns);
    ``headers`` go on the response, whatever it is. ``route``: another route's shapes on
    this request's life (``parse``, async: it may read the state store, and ``write``;
    server.http.responses_write), or None.
    """
    config = app.server_config
    answer = Answer(send, headers, record)
    queued = None
    try:
        body = await read_json_post(app, scope, receive)
        if body is None:
            record.client_disconnected = True
            return
        engine = (await app.models.pool_for(body)).require_engine()
        record.model = engine.model_name
        if route is not None:
            req = await route.parse(app, scope, body, engine.info)
        elif chat:
            req = await off_loop(len(body), schema.parse_chat, body, config.limits,
                                 None, engine.info, config.tool_call_parser)
        else:
            req = await off_loop(len(body), schema.parse_completion, body, config.limits,
                                 None, engine.info)
        engine, adapter = resolve_model(app, req.model)
        model_name = adapter or engine.model_name  # the name responses carry
        refused = app.admission_error(engine, len(req.prompts) * req.params.n)
        if refused is not None:
            raise refused
        if has_images(req.prompts):  # (before the engine is asked anything)
            if not await _fetch_images_watched(app, req.prompts, receive, record):
                return  # the client went away: its fetches were cancelled
        if None in req.echoed:
            req = await echo_texts(engine, req)
        response_id = _response_id(record, req, scope, route, chat)
        if getattr(req, "background", False):  # (run by the app's service: responses_write)
            queued = await route.start_background(app, req, engine, adapter, response_id,
                                                  model_name)
        else:
            stream = engine.generate_many(
                req.prompts, req.params, timeout=config.request_timeout,
                errors_as_outputs=True, adapter=adapter,
                queue_timeout=app.models.of_engine(engine).max_queue_time,
            )
            record.dispatched(req.stream, stream.choices)
    except Exception as exc:
        await answer.error(*await refusal(exc, scope, receive, config,
                                          "before the response started"))
        return
    if queued is not None:
        await route.answer_background(app, answer, receive, req, queued)
        return
    direct = scope["extensions"].get(DIRECT_BODY)
    try:
        if direct is not None:  # this server's connection says when the client goes away
            with trio.CancelScope() as cancel_scope:
                direct.on_disconnect(_cancel_on_disconnect(cancel_scope, record))
                try:
                    await _answer(app, answer, stream, req, response_id, model_name, route,
                                  direct)
                finally:
                    direct.on_disconnect(None)
        else:  # (hypercorn's public serve(): a monitor parked in receive)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, record)
                try:
                    await _answer(app, answer, stream, req, response_id, model_name, route,
                                  None)
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        record.ended(stream, req.params.n, req.params.max_tokens)


async def _answer(app, answer: Answer, stream, req, response_id: str, model_name: str, route,
                  direct: DirectBody | None) -> None:
    """Answer a dispatched request (the route's shape, a stream, or a whole answer), then
    close its stream; cancelled when the client goes away."""
    config = app.server_config
    async with stream:
        if route is not None:
            await route.write(app, answer, stream, req, response_id, model_name, direct)
        elif req.stream:
            try:
                per_choice = await stream_started(answer, stream, config.queued_heartbeat,
                                                  direct)
                if per_choice is not None:
                    await _StreamWriter(
                        answer, stream, req, response_id, model_name, per_choice,
                        observe_itl=app.metrics.of(answer.record.model).itl.observe,
                        reasoning_parser=config.reasoning_parser, direct=direct,
                    ).write()
            finally:
                if direct is not None:  # what a stream cut short still held
                    await direct.release()
        else:
            await write_full(
                answer, stream, req, response_id, model_name, config.reasoning_parser,
            )


def _cancel_on_disconnect(cancel_scope: trio.CancelScope, record: RequestRecord):
    """What :meth:`DirectBody.on_disconnect` calls for a request: a client gone before
    the answer's last byte cancels it (after it, the end of the connection is the usual
    one: Connection: close, HTTP/1.0)."""
    def disconnected() -> None:
        if not record.response_complete:
            record.client_disconnected = True
            cancel_scope.cancel()
    return disconnected


def _response_id(record: RequestRecord, req, scope: dict, route, chat: bool) -> str:
    """The client's X-Request-Id, else the body's request_id (vLLM's order), else ours;
    after the route's prefix."""
    base = record.request_id
    if req.request_id is not None and not request_id_from_header(header(scope, b"x-request-id"))[1]:
        base = req.request_id
    prefix = route.id_prefix if route is not None else "chatcmpl-" if chat else "cmpl-"
    return prefix + base


async def echo_texts(engine, req):
    """``req`` with the text of its token-id prompts to echo (lm-eval's ``local-completions``
    sends token ids with ``echo`` for every loglikelihood request): each decoded by a
    worker's tokenizer (a /detokenize round trip), special tokens included, as the engine
    reads the ids."""
    echoed = list(req.echoed)
    for i, prompt in enumerate(req.prompts):
        if echoed[i] is None:
            try:
                answer = await engine.tokenize({"op": "detokenize", "tokens": prompt})
            except ClientError as exc:  # (the sim engine has no tokenizer)
                raise ClientError(f"'echo' of a token-id prompt needs its text: {exc.message}",
                                  param="echo", code=exc.code) from None
            echoed[i] = answer["prompt"]
    return dataclasses.replace(req, echoed=tuple(echoed))


async def _fetch_images_watched(app, prompts: list, receive, record: RequestRecord) -> bool:
    """Fetch the request's images (server.http.images) with the cancellation monitor
    beside: a client that goes away cancels its fetches at once, rather than holding a
    fetch slot up to --media-fetch-timeout for each of its images. False when it went
    away; a fetch's error is raised as itself (not in a group)."""
    failed: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, record)
        try:
            await fetch_images(app.media, prompts)
        except Exception as exc:
            failed = exc
        finally:
            nursery.cancel_scope.cancel()  # (the monitor, parked in receive: nothing lost)
    if failed is not None:
        raise failed
    return not record.client_disconnected


async def _watch_disconnect(receive, scope: trio.CancelScope, record: RequestRecord) -> None:
    await watch_disconnect(receive, scope, lambda: record.response_complete)
    if not record.response_complete:  # else: the usual end of the connection after the answer
        record.client_disconnected = True


class _StreamWriter:
    """One streamed completions or chat answer, after the engine started it: the first
    chunks (roles, echo), one send per batch of ready outputs, usage (in a last chunk, or
    on every chunk with ``continuous_usage_stats``), and the end (``data: [DONE]``, or an
    error event). A plain stream's text events are written by the router once the first
    went out (:mod:`server.connections.sink`); this still writes the first, the last, errors and
    the rest."""

    __slots__ = (
        "answer", "stream", "req", "response_id", "enc", "choices", "rich", "observe_itl",
        "direct", "usage", "so_far", "sink", "plain", "last", "ids",
    )

    def __init__(
        self, answer: Answer, stream, req, response_id: str, model: str, per_choice: list[int],
        *, observe_itl, reasoning_parser: str | None, direct: DirectBody | None,
    ) -> None:
        self.answer = answer
        self.stream = stream
        self.req = req
        self.response_id = response_id
        self.enc = enc = ChunkEncoder(chat=req.chat, response_id=response_id,
                                      created=int(time.time()), model=model)
        self.observe_itl = observe_itl
        self.direct = direct
        self.choices = choices = len(per_choice)
        n = req.params.n
        self.rich = None  # logprobs, a reasoning split or tools: richer events (else plain text)
        if RichEvents.wanted(chat=req.chat, logprobs=req.logprobs is not None,
                             reasoning_parser=reasoning_parser, tools=req.tools):
            # With echo and logprobs, the prompt goes out with its logprobs, in the first event.
            echoed = [req.echoed[i // n] for i in range(choices)] if req.echo and not req.chat \
                else None
            self.rich = RichEvents(enc, choices=choices, chat=req.chat,
                                   logprobs=req.logprobs is not None,
                                   reasoning_parser=reasoning_parser, prompts=echoed,
                                   tools=req.tools, include_reasoning=req.include_reasoning,
                                   tokens_as_ids=req.tokens_as_ids,
                                   thinking=req.thinking)
        self.usage = Usage(per_choice, n)
        #: Completion tokens per choice so far (continuous usage only).
        self.so_far = [0] * choices if req.continuous_usage else None
        self.sink: TextSink | None = None
        #: Whether the router may write its text events, once the first went out (one try;
        #: only for a chunked body, HTTP/1.1).
        self.plain = direct is not None and self.rich is None and not req.continuous_usage \
            and choices == 1 and not req.return_token_ids
        #: vLLM's return_token_ids (only requests that asked).
        self.ids = StreamIds(choices, req.chat) if req.return_token_ids else None
        self.last = 0.0  # when the previous write with new tokens happened

    def _first(self) -> list[bytes]:
        """The chunks before the first output: each chat choice's role (and vLLM's chat
        echo, its own chunk after the role), or a plain completion's echo."""
        req = self.req
        enc = self.enc
        n = req.params.n
        first = []
        ids = self.ids
        states = self.stream.choice_states() if ids is not None else ()
        for index in range(self.choices):
            mine = []
            if req.chat:
                mine.append(enc.role(index))
                if req.echo and req.echoed[0]:
                    mine.append(enc.delta(index, req.echoed[0]))
            elif req.echo and self.rich is None:
                mine.append(enc.delta(index, req.echoed[index // n]))
            if mine and ids is not None:  # the prompt's ids, on the choice's first chunk
                mine[0] = ids.first(mine[0], index, states[index].prompt_ids)
            first += mine
        if self.so_far is not None:
            first = [enc.with_usage(c, usage(self.usage.prompt_tokens, 0)) for c in first]
        return first

    async def write(self) -> None:
        """Write the stream. What is ready at the same moment goes out in one write (the
        connection holds it: ``DirectBody.hold``): the head (held by ``stream_started``),
        the first chunks and the first batch; and each batch with the end of the stream
        when the batch ended it. It is released before waiting for the next batch."""
        answer = self.answer
        stream = self.stream
        direct = self.direct
        first = self._first()
        try:
            if first:
                await answer.send(
                    {"type": "http.response.body", "body": b"".join(first), "more_body": True}
                )
            while outs := await stream.next_batch():
                if direct is not None:
                    direct.hold()
                if not await self._batch(outs):
                    return
                if direct is not None and not stream.ending:
                    await direct.release()
            stream.set_sink(None)
            tail = DONE
            if self.req.include_usage:
                u = self.usage
                tail = self.enc.usage(u.prompt_tokens, u.completion_tokens,
                                      u.cached_tokens) + DONE
            await answer.last(tail)
        except Exception:
            stream.set_sink(None)
            log.exception("internal error while streaming %s", self.response_id)
            await answer.fail_stream(EngineError("Internal server error while streaming."))

    async def _batch(self, outs: list) -> bool:
        """Write one batch of outputs; False when it ended the stream with an error."""
        sink = self.sink
        if sink is not None:
            if sink.torn:
                rest, sink.torn = sink.torn, b""
                await self.direct.send_torn(rest)  # type: ignore[union-attr]
            self.last = sink.last
        if outs[0].num_tokens:
            self.last = tokens_arrived(self.answer.record, self.observe_itl, self.last)
        enc = self.enc
        rich = self.rich
        ids = self.ids
        parts = []
        for o in outs:
            if o.finish_reason == "error":
                if o.text:  # text merged in before the failure still goes out
                    parts.append(enc.delta(o.index, o.text))
                await self.answer.fail_stream(o.exception(), b"".join(parts))
                return False
            if o.finish_reason is not None:
                self.usage.ended(o)
            if rich is None:
                if (sink is not None and not o.text and not o.num_tokens
                        and o.finish_reason is None):
                    continue  # the sink wrote its text (and sent the rest above)
                event: bytes | None = enc.delta(o.index, o.text, o.finish_reason)
            else:
                event = rich.event(o)
            if ids is not None:
                event = ids.event(event, o)
            if event is not None:
                parts.append(event)
        so_far = self.so_far
        if so_far is not None:
            for o in outs:
                so_far[o.index] = o.completion_tokens
            now_usage = usage(self.usage.prompt_tokens, sum(so_far))
            parts = [enc.with_usage(part, now_usage) for part in parts]
        if parts:  # (none when a reasoning split holds a partial tag back)
            await self.answer.send(
                {"type": "http.response.body", "body": b"".join(parts), "more_body": True}
            )
        if sink is not None:
            sink.last = self.last
        elif self.plain and self.last:
            self._hand_over()
        return True

    def _hand_over(self) -> None:
        """Let the router write this plain stream's text events from now on (one try)."""
        self.plain = False
        direct = self.direct
        if direct is not None and direct.usable():
            sink = TextSink(direct, self.enc, self.observe_itl, self.last)
            if self.stream.set_sink(sink):
                self.sink = sink
