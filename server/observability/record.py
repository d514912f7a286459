"""The lifecycle of one generation request, as plain data. Sans-IO.

The HTTP layer fills a :class:`RequestRecord` in as the request goes (a few attribute writes,
never a lock or an allocation per token) and hands it, once, at the request's end, to
:meth:`server.observability.Metrics.observe` and :func:`server.observability.log_request`.

Timestamps are ``time.perf_counter()`` seconds (monotonic; Trio's clock is not used, so a test's
autojump clock cannot distort them), except :attr:`arrival_wall` (``time.time()``)::

    arrival      the ASGI app was called with the request (headers read, body not yet)
    dispatch     the engine took the request (``generate_many`` returned)
    accepted     the worker's first engine step that reported the request: the last of its
                 choices is in the engine's scheduler (see queue time in docs/metrics.md)
    first_token  the HTTP writer took the first output of the request
    finish       the response ended (last byte sent, or the client went away)

How a request ended is one :attr:`finish_reason` over all its choices, the worst of them:
``error`` > ``abort`` > ``length`` > ``stop``. :attr:`abort_cause` says why work was given up:
``client_disconnect``, ``timeout``, ``queue_timeout`` (not started within the queue-time
limit: answered 503), ``shutdown`` or ``worker_failure`` (a worker failure ends the request
with ``error``, the others with ``abort``).
"""

from __future__ import annotations

import functools
import time

from ..errors import ServerError
from ..outputs import FINISH_REASONS

__all__ = ["RequestRecord", "ABORT_CAUSES", "FINISHED_REASONS"]

_now = time.perf_counter

#: Label values of ``trio_llm:request_success_total{finished_reason}``, best first.
FINISHED_REASONS = FINISH_REASONS  # the order is the rank: the worst reason last
#: Label values of ``trio_llm:request_aborts_total{cause}``.
ABORT_CAUSES = ("client_disconnect", "timeout", "queue_timeout", "shutdown", "worker_failure")

_RANK = {reason: rank for rank, reason in enumerate(FINISHED_REASONS)}

#: The status logged for a request whose client went away before the response started
#: (nginx's "client closed request").
CLIENT_CLOSED = 499


class RequestRecord:
    """What happened to one request; see the module docstring for each time."""

    __slots__ = (
        "request_id",
        "route",
        "model",
        "arrival",
        "arrival_wall",
        "dispatch",
        "accepted",
        "first_token",
        "finish",
        "status",
        "response_complete",
        "stream",
        "choices",
        "prompt_tokens",
        "completion_tokens",
        "finish_reasons",
        "abort_cause",
        "error",
        "client_disconnected",
        "n",
        "max_tokens",
    )

    def __init__(self, request_id: str, route: str) -> None:
        self.request_id = request_id
        self.route = route
        #: The served model that took the request (None until its model is resolved).
        self.model: str | None = None
        self.arrival = _now()
        self.arrival_wall = time.time()
        self.dispatch: float | None = None
        self.accepted: float | None = None
        self.first_token: float | None = None
        self.finish: float | None = None
        #: The HTTP status sent (None until the response started).
        self.status: int | None = None
        #: The last byte of the response was handed to the ASGI server.
        self.response_complete = False
        self.stream: bool | None = None
        self.choices = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reasons: list[str | None] = []
        self.abort_cause: str | None = None
        #: ``(status, type, code, message)`` of the first error answered, or None.
        self.error: tuple[int, str, str | None, str] | None = None
        self.client_disconnected = False
        #: The request's ``n`` and ``max_tokens`` (None: as many as fit), once it ended.
        self.n = 1
        self.max_tokens: int | None = None

    # -- filled in by the HTTP layer ---------------------------------------------------------

    def dispatched(self, stream: bool, choices: int) -> None:
        """The engine took the request."""
        self.dispatch = _now()
        self.stream = stream
        self.choices = choices

    def failed(self, exc: ServerError) -> None:
        """The request was answered with ``exc`` (as a status or as an error event).

        Only the first error is kept: it is the cause; what follows is its consequence.
        """
        if self.error is None:
            self.error = (exc.status, exc.type, exc.code, exc.message)

    def ended(self, stream, n: int, max_tokens: int | None = None) -> None:
        """Read how each choice of ``stream`` ended, once it is closed.

        ``n`` is the request's samples per prompt: prompt tokens are counted once per prompt,
        as in the response's usage. Called after the stream's ``aclose``, so that choices the
        server or the client gave up on are final (``abort``, or ``error``).
        """
        self.n = n
        self.max_tokens = max_tokens
        states = stream.choice_states()
        self.finish_reasons = reasons = [c.finish_reason for c in states]
        self.completion_tokens = sum(c.completion_tokens for c in states)
        self.prompt_tokens = sum(c.prompt_tokens for c in states[:: max(n, 1)])
        accepted = [c.accepted_at for c in states]
        if accepted and None not in accepted:
            self.accepted = max(accepted)
        kinds = {c.error_kind for c in states}
        if "worker_died" in kinds:
            self.abort_cause = "worker_failure"
        elif "unavailable" in kinds:
            self.abort_cause = "shutdown"  # the engine stopped under the request
        elif "abort" in reasons:
            if stream.abort_cause is not None:
                self.abort_cause = stream.abort_cause
            elif self.client_disconnected:
                self.abort_cause = "client_disconnect"

    # -- read at the end ---------------------------------------------------------------------

    @property
    def finish_reason(self) -> str | None:
        """The worst finish reason of the request's choices; None if it never reached the
        engine. ``error`` also when the HTTP layer failed it (an internal error)."""
        if self.dispatch is None:
            return None
        worst = -1
        for reason in self.finish_reasons:
            # a choice that never ended (None) was cut off
            rank = _RANK["abort"] if reason is None else _RANK.get(reason, _RANK["abort"])
            if rank > worst:
                worst = rank
        if self.error is not None and self.error[0] == 500:
            worst = _RANK["error"]  # an engine failure, or an internal error of the writer
        return FINISHED_REASONS[worst] if worst >= 0 else None

    @property
    def rejected(self) -> bool:
        """Answered with a 4xx: the client's fault, counted apart from finished requests."""
        status = self.status
        return status is not None and 400 <= status < 500 and status != CLIENT_CLOSED

    @property
    def failed_by_server(self) -> bool:
        """The server is at fault: an engine failure or an internal error (a 500, or a stream
        that ended with an error event). Timeouts, overload and shutdown are not faults."""
        if self.error is not None and self.error[0] == 500:
            return True
        return self.finish_reason == "error" and not self.rejected

    @property
    def logged_status(self) -> int | None:
        """The status sent; 499 if the client went away before one was; None if the server
        was stopped before it answered."""
        if self.status is None and self.client_disconnected:
            return CLIENT_CLOSED
        return self.status

    def fields(self) -> dict:
        """The request's log fields, in a stable order (times in ms since arrival)."""
        arrival = self.arrival

        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - arrival) * 1000.0, 3)

        fields = {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "status": self.logged_status,
            "stream": self.stream,
            "finish_reason": self.finish_reason,
            "finish_reasons": self.finish_reasons,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "arrival": iso_utc(self.arrival_wall),
            "dispatch_ms": ms(self.dispatch),
            "accepted_ms": ms(self.accepted),
            "first_token_ms": ms(self.first_token),
            "finish_ms": ms(self.finish),
        }
        if self.abort_cause is not None:
            fields["abort_cause"] = self.abort_cause
        if self.client_disconnected:
            fields["client_disconnected"] = True
        if self.error is not None:
            status, type_, code, message = self.error
            fields["error_type"] = type_
            fields["error_code"] = code
            fields["error"] = message
        return fields


def iso_utc(created: float) -> str:
    """``2024-05-01T12:00:00.123Z`` (UTC, milliseconds) for a ``time.time()`` value. The
    part up to the second is formatted once a second (:func:`_utc_second`): every request's
    log line has two of these."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return f"{_utc_second(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=2)
def _utc_second(seconds: int) -> str:
    """``2024-05-01T12:00:00`` for ``seconds`` since the epoch (the last two are kept: a
    request's arrival and its line's time are often a second apart)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
