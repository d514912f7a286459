"""``POST /v1/completions`` and ``POST /v1/chat/completions`` on raw ASGI.

Theory of operation
-------------------
One request, one nursery::

    handle_generate (the writer)
    ├── API key, method, content type   -> 401, 405, 415 (after the body: see discard_body)
    ├── read and validate the body      -> 4xx before anything is sent
    ├── dispatch to the engine          -> 503 if no worker can take it, or over an
    │                                   explicit admission limit (else it queues there)
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

Observability: the request's :class:`~server.observability.RequestRecord` (made by the app,
which records and logs it when this returns) gets the dispatch time, the status and errors
answered, a client disconnect, the time of the first output, and at the end how each choice
ended. Every response start carries the app's extra headers (``X-Request-Id``, CORS). The
only work per streamed write is a clock read and one lock-free histogram observation
(inter-token latency); body messages go straight to the ASGI server's ``send``.
"""

from __future__ import annotations

import dataclasses

import logging
import math
import time

import trio

from ..errors import (
    ClientError,
    EngineError,
    RequestTimeout,
    ServerError,
    ServiceUnavailable,
)
from ..manager.deadlines import QUEUE_TIMEOUT, queue_timeout_error
from ..observability.logs import request_id_from_header
from ..observability.record import RequestRecord
from ..openai import schema
from .adapters import resolve_model
from .asgi import (
    header,
    send_error,
    send_json,
    watch_disconnect,
)
from ..openai.encode import DONE, ChunkEncoder, completion_body, error_event, usage
from ..openai.events import RichEvents
from ..openai.logprobs import LogprobsFormatter
from ..openai.logprobs import prompt_logprobs as vllm_prompt_logprobs
from ..openai.reasoning import split_text
from ..openai.token_ids import IdsOfChoices, StreamIds
from ..openai.tool_parsers import parse_text as parse_tool_text
from .post import off_loop, read_json_post, refusal
from ..connections.http11 import DIRECT_BODY, DirectBody
from ..connections.sink import TextSink

__all__ = ["handle_generate"]

log = logging.getLogger("server.http")

_now = time.perf_counter


def tokens_arrived(record, observe_itl, last: float) -> float:
    """A batch with tokens went out: the request's first token, or an inter-token gap.
    Returns the time to pass as ``last`` next (streamed routes, once per batch)."""
    now = _now()
    if last:
        observe_itl(now - last)
    else:
        record.first_token = now
    return now

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _Answer:
    """The parts of answering that are not per event: each sets the record's status, adds the
    extra headers, and marks the response complete before its last byte (the ASGI server
    reports the end of the connection after it, which must not count as a disconnect)."""

    __slots__ = ("send", "headers", "record")

    def __init__(self, send, headers: list, record: RequestRecord) -> None:
        self.send = send
        self.headers = headers
        self.record = record

    async def error(self, exc: ServerError, headers: list | None = None) -> None:
        record = self.record
        record.failed(exc)
        record.status = exc.status
        record.response_complete = True
        await send_error(self.send, exc, self.headers + headers if headers else self.headers)

    async def json(self, body: bytes) -> None:
        self.record.status = 200
        self.record.response_complete = True
        await send_json(self.send, 200, body, self.headers)

    async def start_stream(self) -> None:
        self.record.status = 200
        headers = _SSE_HEADERS + self.headers
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})

    async def fail_stream(self, exc: ServerError, before: bytes = b"") -> None:
        """End a started stream with ``exc`` as an error event and ``data: [DONE]``
        (after ``before``, the text merged in before the failure)."""
        self.record.failed(exc)
        await self.last(before + error_event(exc) + DONE)

    async def last(self, body: bytes) -> None:
        self.record.response_complete = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


async def handle_generate(
    app, scope: dict, receive, send, *, chat: bool, record: RequestRecord, headers: list,
    route=None,
) -> None:
    """Serve one generation request; never raises into the ASGI server (but Cancelled).

    ``record`` is filled in as the request goes (the caller records it when this returns);
    ``headers`` go on the response, whatever it is. ``route``: another route's shapes on
    this request's life (``parse`` and ``write``; server.http.responses_write), or None.
    """
    config = app.server_config
    answer = _Answer(send, headers, record)
    try:
        body = await read_json_post(app, scope, receive)
        if body is None:
            record.client_disconnected = True
            return
        engine = (await app.models.pool_for(body)).require_engine()
        record.model = engine.model_name
        if route is not None:
            req = await off_loop(len(body), route.parse, body, config, None, engine.info)
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
        if None in req.echoed:
            req = await echo_texts(engine, req)
        stream = engine.generate_many(
            req.prompts, req.params, timeout=config.request_timeout, errors_as_outputs=True,
            adapter=adapter, queue_timeout=app.models.of_engine(engine).max_queue_time,
        )
        record.dispatched(req.stream, stream.choices)
    except Exception as exc:
        await answer.error(*await refusal(exc, scope, receive, config,
                                          "before the response started"))
        return
    # The client's X-Request-Id, else the body's request_id (vLLM's order), else ours.
    base = record.request_id
    if req.request_id is not None and not request_id_from_header(header(scope, b"x-request-id"))[1]:
        base = req.request_id
    prefix = route.id_prefix if route is not None else "chatcmpl-" if chat else "cmpl-"
    response_id = prefix + base
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, record)
            try:
                async with stream:
                    if route is not None:
                        await route.write(app, answer, stream, req, response_id,
                                          model_name)
                    elif req.stream:
                        per_choice = await _stream_started(answer, stream,
                                                           config.queued_heartbeat)
                        if per_choice is not None:
                            await _StreamWriter(
                                answer, stream, req, response_id, model_name,
                                per_choice, observe_itl=app.metrics.of(record.model).itl.observe,
                                reasoning_parser=config.reasoning_parser,
                                direct=scope["extensions"].get(DIRECT_BODY),
                            ).write()
                    else:
                        await _write_full(
                            answer, stream, req, response_id, model_name,
                            config.reasoning_parser,
                        )
            finally:
                nursery.cancel_scope.cancel()
    finally:
        record.ended(stream, req.params.n, req.params.max_tokens)


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


async def _watch_disconnect(receive, scope: trio.CancelScope, record: RequestRecord) -> None:
    await watch_disconnect(receive, scope, lambda: record.response_complete)
    if not record.response_complete:  # else: the usual end of the connection after the answer
        record.client_disconnected = True


async def _started(answer: _Answer, stream) -> list[int] | None:
    """Prompt token counts once the engine has started; else answer with a status."""
    try:
        return await stream.wait_started()
    except ServerError as exc:
        await answer.error(exc)
        return None


#: What a stream still queued sends every heartbeat: an SSE comment, which clients ignore.
WAITING = b": waiting for the engine\n\n"


async def _stream_started(answer: _Answer, stream, heartbeat: float | None) -> list[int] | None:
    """Start a streaming response once the engine has started (prompt token counts), or
    answer with a status. A request still queued after ``heartbeat`` seconds starts its
    response anyway and sends :data:`WAITING` every ``heartbeat`` seconds, so that proxies
    with read timeouts keep it; a failure after that is an error event (docs/api.md)."""
    try:
        per_choice = await stream.wait_started(heartbeat or math.inf)
    except ServerError as exc:
        await answer.error(exc)
        return None
    if per_choice is not None:
        await answer.start_stream()
        return per_choice
    await answer.start_stream()
    send = answer.send
    while per_choice is None:
        try:
            await send({"type": "http.response.body", "body": WAITING, "more_body": True})
            per_choice = await stream.wait_started(heartbeat)
        except ServerError as exc:
            await answer.fail_stream(exc)
            return None
        except Exception:  # a bug of ours: the stream started, so it ends as a stream
            log.exception("internal error while a stream waited for the engine")
            await answer.fail_stream(
                EngineError("Internal server error while waiting for the engine.")
            )
            return None
    return per_choice


def _abort_error(cause: str) -> ServerError:
    """What a non-streaming request aborted by the server is answered with."""
    if cause == "timeout":
        return RequestTimeout("The request took longer than the server's request timeout.")
    if cause == QUEUE_TIMEOUT:
        return queue_timeout_error()
    if cause == "shutdown":
        return ServiceUnavailable("The server is shutting down.", code="shutting_down")
    return EngineError(f"The server aborted the request ({cause}).")


def failure(stream, out) -> ServerError | None:
    """Why an answer fails at ``out``, or None: the engine's error that ended its choice,
    or a server-side abort (a timeout, the shutdown: :func:`_abort_error`). A client's own
    abort is not a failure."""
    if out.finish_reason == "error":
        return out.exception()
    if out.finish_reason == "abort" and stream.abort_cause is not None:
        return _abort_error(stream.abort_cause)
    return None


def whole_failure(record: RequestRecord, stream, out) -> ServerError | None:
    """:func:`failure`, for an answer written whole at the end: notes the request's first
    token on the way (no inter-token latency: nothing is written until the end)."""
    if record.first_token is None and out.num_tokens:
        record.first_token = _now()
    return failure(stream, out)


class _Usage:
    """A request's token usage, counted as its choices end: prompt tokens once per prompt
    (not once per sample), completion tokens of every choice, and the prefix-cache hits of
    each prompt's first sample (counted once per prompt, as its prompt tokens are). Shared
    by the streamed and whole answers."""

    __slots__ = ("n", "prompt_tokens", "completion_tokens", "_cached")

    def __init__(self, per_choice: list[int], n: int) -> None:
        self.n = n
        self.prompt_tokens = sum(per_choice[::n])
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}

    def ended(self, out) -> None:
        """``out`` ended its choice."""
        self.completion_tokens += out.completion_tokens
        if out.cached_tokens is not None:
            self._cached[out.index] = out.cached_tokens

    @property
    def cached_tokens(self) -> int | None:
        """Prefix-cache hits; None when the engine reports none."""
        if not self._cached:
            return None
        n = self.n
        return sum(v for index, v in self._cached.items() if index % n == 0)


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
        self, answer: _Answer, stream, req, response_id: str, model: str, per_choice: list[int],
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
        self.usage = _Usage(per_choice, n)
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
        answer = self.answer
        stream = self.stream
        first = self._first()
        try:
            if first:
                await answer.send(
                    {"type": "http.response.body", "body": b"".join(first), "more_body": True}
                )
            while outs := await stream.next_batch():
                if not await self._batch(outs):
                    return
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


async def _write_full(
    answer: _Answer, stream, req, response_id: str, model: str,
    reasoning_parser: str | None = None,
) -> None:
    per_choice = await _started(answer, stream)
    if per_choice is None:
        return
    record = answer.record
    k = len(per_choice)
    n = req.params.n
    texts: list[list[str]] = [[] for _ in range(k)]
    if req.echo and not req.chat:  # (chat: after the parsers, in _full_body)
        for index in range(k):
            texts[index].append(req.echoed[index // n])
    reasons: list[str | None] = [None] * k
    counted = _Usage(per_choice, n)
    entries: list[list] = [[] for _ in range(k)]  # logprobs, for requests that asked
    prompts: list = [None] * k
    ids: IdsOfChoices | None = IdsOfChoices(k) if req.return_token_ids else None
    async for out in stream:
        exc = whole_failure(record, stream, out)
        if exc is not None:
            await answer.error(exc)
            return
        texts[out.index].append(out.text)
        if out.logprobs is not None:
            entries[out.index].extend(out.logprobs)
        if out.prompt_logprobs is not None:
            prompts[out.index] = out.prompt_logprobs
        if ids is not None:
            ids.add(out)
        if out.finish_reason is not None:
            reasons[out.index] = out.finish_reason
            counted.ended(out)
    joined = ["".join(t) for t in texts]
    tokens = sum(map(len, entries)) + sum(len(p) for p in prompts if p)  # (prompt: echo)
    values = tokens * ((req.logprobs or 0) + 1)
    size = sum(map(len, joined)) + values * _BYTES_PER_LOGPROB
    body = await off_loop(
        size, _full_body, req, response_id, model, reasoning_parser, joined, reasons, entries,
        prompts, counted.prompt_tokens, counted.completion_tokens, counted.cached_tokens, ids,
    )
    await answer.json(body)


#: About what one logprob (a token and its value) adds to a chat answer, to tell a big one.
_BYTES_PER_LOGPROB = 70


def _full_body(
    req, response_id: str, model: str, reasoning_parser: str | None, joined: list[str],
    reasons: list, entries: list[list], prompts: list, prompt_tokens: int,
    completion_tokens: int, cached_tokens: int | None, ids: IdsOfChoices | None = None,
) -> bytes:
    """The body of a non-streaming answer. Sans-IO: a big one (many logprobs) is built in
    a worker thread (see :func:`server.http.post.off_loop`)."""
    k = len(joined)
    logprobs = None
    if req.logprobs is not None:
        logprobs = [
            LogprobsFormatter(req.chat, req.tokens_as_ids).format(
                entries[i], prompts[i] if req.echo else None)
            for i in range(k)
        ]
    reasoning = None
    if req.chat and reasoning_parser is not None:
        reasoning = []
        for i, text in enumerate(joined):
            thought, joined[i] = split_text(reasoning_parser, text, req.thinking)
            reasoning.append(thought if req.include_reasoning else None)
    tool_calls = None
    if req.tools is not None and req.tools.parse is not None:
        tool_calls = [
            _tool_calls(req.tools, joined, reasons, i) for i in range(k)
        ]
    if req.chat and req.echo:  # vLLM's chat echo: before the answer's content
        n = req.params.n
        joined = [req.echoed[i // n] + (text or "") for i, text in enumerate(joined)]
    return completion_body(
        chat=req.chat,
        response_id=response_id,
        created=int(time.time()),
        model=model,
        texts=joined,
        finish_reasons=reasons,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        logprobs=logprobs,
        reasoning=reasoning,
        tool_calls=tool_calls,
        token_ids=None if ids is None else ids.tokens,
        prompt_token_ids=None if ids is None else ids.prompts,
        prompt_logprobs=None if req.prompt_logprobs is None else [
            vllm_prompt_logprobs(p) for p in prompts],
    )


def _tool_calls(tools, texts: list, reasons: list, i: int) -> list:
    """Choice ``i``'s tool calls; its text becomes the content around them (None when
    there is none), and a ``stop`` with calls becomes ``tool_calls``."""
    texts[i], calls = parse_tool_text(tools.parse, texts[i], parallel=tools.parallel)
    if calls and reasons[i] == "stop":
        reasons[i] = "tool_calls"
    return calls
