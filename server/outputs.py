"""What a generation stream yields: :class:`RequestOutput`, a plain value.

End of stream is a value too: the last output of a choice has ``finish_reason`` set. Errors
that end a stream travel as a value (``error_kind``, ``error`` and ``error_param``), never as a stored
exception, so a finished request holds no traceback and no reference cycle.
"""

from __future__ import annotations

from .errors import ServerError, error_from_wire

__all__ = ["RequestOutput", "FINISH_REASONS"]

#: ``stop`` (stop string or end of sequence), ``length`` (max_tokens), ``abort`` (the server
#: or the client gave up on it), ``error`` (the engine failed it).
FINISH_REASONS = ("stop", "length", "abort", "error")


class RequestOutput:
    """New output of one choice since the consumer last looked.

    When the consumer is slower than the engine, everything that arrived in between is merged
    into one output: ``text`` is the concatenated delta and ``num_tokens`` the number of new
    tokens. ``completion_tokens`` is the running total.
    """

    __slots__ = (
        "index",
        "text",
        "num_tokens",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "error_kind",
        "error",
        "error_param",
        "cached_tokens",
        "logprobs",
        "prompt_logprobs",
        "token_ids",
        "prompt_token_ids",
    )

    def __init__(
        self,
        index: int,
        text: str,
        num_tokens: int,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str | None = None,
        error_kind: str | None = None,
        error: str | None = None,
        cached_tokens: int | None = None,
        error_param: str | None = None,
    ) -> None:
        self.index = index
        self.text = text
        self.num_tokens = num_tokens
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.finish_reason = finish_reason
        self.error_kind = error_kind
        self.error = error
        #: The client's field the worker's refusal named (None: none).
        self.error_param = error_param
        #: Prompt tokens found in the engine's prefix cache, when the engine reports it
        #: (vLLM); None otherwise.
        self.cached_tokens = cached_tokens
        #: Only for requests that asked for logprobs: one entry per new token,
        #: ``[token_text, logprob, [[alt_text, alt_logprob], ...]]`` (the alternatives: the
        #: most likely tokens, best first); else None.
        self.logprobs: list | None = None
        #: With ``echo`` and logprobs, on the first output: one entry per prompt token (the
        #: first one's logprob is None).
        self.prompt_logprobs: list | None = None
        #: Only for requests that asked for token ids (``return_token_ids``): the ids of
        #: the tokens this output adds (its text's, and a stop's or EOS that has none),
        #: and, on a choice's first output, the prompt's ids; else None.
        self.token_ids: list | None = None
        self.prompt_token_ids: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def exception(self) -> ServerError | None:
        """A fresh exception describing the error that ended this choice, or None."""
        if self.error_kind is None:
            return None
        return error_from_wire(self.error_kind, self.error or "engine error", self.error_param)

    def __repr__(self) -> str:
        extra = f", finish_reason={self.finish_reason!r}" if self.finish_reason else ""
        if self.error:
            extra += f", error={self.error!r}"
        return (
            f"RequestOutput(index={self.index}, text={self.text!r}, "
            f"num_tokens={self.num_tokens}, completion_tokens={self.completion_tokens}{extra})"
        )
