"""Sampling parameters: what a client asks of one generation. Plain data, no I/O.

Example::

    params = SamplingParams(max_tokens=32, temperature=0.7, stop=["\\n\\n"], seed=1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .worker_protocol.wire import ERROR_PARAM_KEY

__all__ = ["MAX_TOKEN_ID", "SamplingParams", "context_error", "is_token_ids", "truncated"]

#: The largest token id a request may carry: int32's, what engines index vocabularies with.
#: The frontend refuses a larger one before it reaches a worker (every route, and the
#: worker again for embeddings); the worker then checks each id against its model's
#: vocabulary, the bound that matters (a 400 too).
MAX_TOKEN_ID = 2**31 - 1


def is_token_ids(value: object) -> bool:
    """Whether ``value`` is a list of token ids: ints (not bools) from 0 to
    :data:`MAX_TOKEN_ID` (an empty list is; callers that need one refuse it themselves)."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    )


def _wrap64(seed: int) -> int:
    """A seed folded into the signed 64-bit range (what the wire can carry)."""
    return (seed + 2**63) % 2**64 - 2**63


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings, passed to the engine worker unchanged.

    ``n`` is handled by the request manager (it submits ``n`` sub-requests, sample ``i`` with
    ``seed + i`` when a seed is given). ``extra`` carries engine-specific fields, such as the
    sim engine's ``fault`` (fault injection, honoured only when the worker enables it).
    """

    #: None means "as many as fit in the model's context" (the chat default, as in vLLM).
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.n < 1:
            raise ValueError("n must be at least 1")

    def to_wire(self, sample_index: int = 0) -> dict:
        """The dict sent to the worker for sample ``sample_index`` of this request (asking
        that a refusal name the field at fault: ``wire.ERROR_PARAM_KEY``)."""
        wire = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": None if self.seed is None else _wrap64(self.seed + sample_index),
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            ERROR_PARAM_KEY: True,
        }
        if self.extra:
            wire.update(self.extra)
        return wire


def truncated(ids, params: dict, max_model_len: int | None):
    """The part of a prompt of token ``ids`` that an engine runs under vLLM's
    ``truncate_prompt_tokens: k`` (in the wire ``params``) with ``truncation_side``: more
    than ``k`` ids keep their last ``k`` (``"left"``, vLLM's default for generation) or
    their first (``"right"``); ``-1`` is the context (``max_model_len``) less one token
    for the output. The workers cut by it (server.workers.base.truncate_prompt, which
    refuses ``k`` past the context first), and the router names a token-id prompt's
    blocks by it, as the engine will cache them. ``ids`` whole when no cut applies (or
    ``-1`` with the context unknown)."""
    k = params.get("truncate_prompt_tokens")
    if k is None:
        return ids
    if k < 0:
        if max_model_len is None:
            return ids
        k = max_model_len - 1
    if len(ids) <= k:
        return ids
    return ids[:k] if params.get("truncation_side") == "right" else ids[len(ids) - k:]


def context_error(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> str | None:
    """Why a prompt of ``prompt_tokens`` tokens and ``max_tokens`` to generate cannot fit
    the model's context, in OpenAI's words (None: it fits). The workers refuse with it
    (after tokenizing), and the frontend too, before a token-id prompt reaches them."""
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            return (
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt has {prompt_tokens} tokens. Please reduce the length of the prompt."
            )
        return None
    if prompt_tokens + max_tokens > max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
            "max_tokens."
        )
    return None
