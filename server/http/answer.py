"""The response side of a generation request, shared by every generation route
(completions and chat in :mod:`server.http.generate`, :mod:`server.http.responses_write`,
:mod:`server.http.chat_batch`).

:class:`Answer` sends the response and keeps the request's record in step with it;
:func:`started` and :func:`stream_started` wait for the engine to take the request;
:func:`failure` says whether an output ends the answer in an error; :class:`Usage` counts
tokens as choices end; :func:`write_full` writes a completions or chat answer whole, after
the last output. A route's life around these (the nursery, the disconnect watch, the
stream's aclose) is generate.py's.
"""

from __future__ import annotations

import logging
import math
import time

from ..errors import EngineError, RequestTimeout, ServerError, ServiceUnavailable
from ..manager.deadlines import QUEUE_TIMEOUT, queue_timeout_error
from ..observability.record import RequestRecord
from ..openai.encode import DONE, completion_body, error_event
from ..openai.logprobs import LogprobsFormatter
from ..openai.logprobs import prompt_logprobs as vllm_prompt_logprobs
from ..openai.reasoning import split_text
from ..openai.token_ids import IdsOfChoices
from ..openai.tool_parsers import parse_text as parse_tool_text
from .asgi import send_error, send_json
from .post import off_loop

__all__ = [
    "WAITING", "Answer", "Usage", "abort_error", "failure", "started", "stream_started",
    "tokens_arrived", "whole_failure", "write_full",
]

log = logging.getLogger("server.http")

_now = time.perf_counter

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Answer:
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


def tokens_arrived(record, observe_itl, last: float) -> float:
    """A batch with tokens went out: the request's first token, or an inter-token gap.
    Returns the time to pass as ``last`` next (streamed routes, once per batch)."""
    now = _now()
    if last:
        observe_itl(now - last)
    else:
        record.first_token = now
    return now


async def started(answer: Answer, stream) -> list[int] | None:
    """Prompt token counts once the engine has started; else answer with a status."""
    try:
        return await stream.wait_started()
    except ServerError as exc:
        await answer.error(exc)
        return None


#: What a stream still queued sends every heartbeat: an SSE comment, which clients ignore.
WAITING = b": waiting for the engine\n\n"


async def stream_started(
    answer: Answer, stream, heartbeat: float | None, hold=None,
) -> list[int] | None:
    """Start a streaming response once the engine has started (prompt token counts), or
    answer with a status. A request still queued after ``heartbeat`` seconds starts its
    response anyway and sends :data:`WAITING` every ``heartbeat`` seconds, so that proxies
    with read timeouts keep it; a failure after that is an error event (docs/api.md).

    ``hold``: the connection's :class:`~server.connections.http11.DirectBody`, or None. Once
    the engine started, the first output is ready too (``wait_started``): the head is then
    held to go out with the first events, in one write; the caller releases it."""
    try:
        per_choice = await stream.wait_started(heartbeat or math.inf)
    except ServerError as exc:
        await answer.error(exc)
        return None
    if per_choice is not None:
        if hold is not None:
            hold.hold()
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


def abort_error(cause: str) -> ServerError:
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
    or a server-side abort (a timeout, the shutdown: :func:`abort_error`). A client's own
    abort is not a failure."""
    if out.finish_reason == "error":
        return out.exception()
    if out.finish_reason == "abort" and stream.abort_cause is not None:
        return abort_error(stream.abort_cause)
    return None


def whole_failure(record: RequestRecord, stream, out) -> ServerError | None:
    """:func:`failure`, for an answer written whole at the end: notes the request's first
    token on the way (no inter-token latency: nothing is written until the end)."""
    if record.first_token is None and out.num_tokens:
        record.first_token = _now()
    return failure(stream, out)


class Usage:
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


async def write_full(
    answer: Answer, stream, req, response_id: str, model: str,
    reasoning_parser: str | None = None,
) -> None:
    """A completions or chat answer (``req``'s shape), written whole once every choice
    ended; an error or a server-side abort before then is answered with its status."""
    per_choice = await started(answer, stream)
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
    counted = Usage(per_choice, n)
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
