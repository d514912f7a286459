"""vLLM's ``return_token_ids``: the prompt's and each choice's token ids in an answer. Sans-IO.

Only a request that asked pays for any of this (the worker sends ids only then: see
:attr:`server.openai.schema.GenerateRequest.return_token_ids`). The fields, where vLLM
0.32 puts them:

- a whole answer: each choice's ``token_ids`` (every token it generated, a stop's and the
  EOS token's included), a completion choice's ``prompt_token_ids``, a chat answer's
  ``prompt_token_ids`` on the response (its one prompt's). Not asked: they are null
  (:func:`server.openai.encode.completion_body`), as in vLLM's answers;
- a stream: each chunk of a choice carries ``token_ids``, the ids of that chunk's tokens
  (a list, possibly empty); the choice's first chunk carries ``prompt_token_ids`` (a
  completion's in the choice, a chat's on the chunk, beside ``choices``). Not asked: absent.

The streamed fields are spliced into chunks the encoder already made (one JSON object per
``data:`` line, whose last bytes are ``}]}\\n\\n``: JSON strings escape newlines, so the
first such run ends the chunk's first choice); the encoder's fast paths stay as they are.
"""

from __future__ import annotations

from .encode import dumps

__all__ = ["IdsOfChoices", "StreamIds", "with_ids"]

_END = b"}]}\n\n"


class IdsOfChoices:
    """The ids of a whole answer's choices, gathered from their outputs."""

    __slots__ = ("tokens", "prompts")

    def __init__(self, choices: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(choices)]
        self.prompts: list[list[int] | None] = [None] * choices

    def add(self, out) -> None:
        """An output (:class:`server.outputs.RequestOutput`) of a request that asked."""
        if out.token_ids:
            self.tokens[out.index].extend(out.token_ids)
        if out.prompt_token_ids is not None:
            self.prompts[out.index] = out.prompt_token_ids


def with_ids(chunk: bytes, token_ids: list | None, prompt_ids: list | None = None,
             chat: bool = False) -> bytes:
    """``chunk`` (one or more SSE events of one choice) with ``token_ids`` in its first
    event's choice, and ``prompt_ids`` (when not None) in the choice (completions) or on
    the event (chat)."""
    at = chunk.find(_END)
    if at < 0:
        return chunk
    head, tail = chunk[:at], chunk[at + len(_END):]
    if token_ids is not None:
        head += b',"token_ids":' + dumps(token_ids)
    if prompt_ids is None:
        return head + _END + tail
    if chat:
        return head + b'}],"prompt_token_ids":' + dumps(prompt_ids) + b"}\n\n" + tail
    return head + b',"prompt_token_ids":' + dumps(prompt_ids) + _END + tail


class StreamIds:
    """The ids of one streamed answer: each choice's prompt ids on its first event, each
    event's token ids; the ids of an output whose event is held back (a reasoning split or
    a tool call parser waiting for more text) go out with the choice's next event."""

    __slots__ = ("chat", "prompt_sent", "held")

    def __init__(self, choices: int, chat: bool) -> None:
        self.chat = chat
        self.prompt_sent = [False] * choices
        self.held: list[list[int]] = [[] for _ in range(choices)]

    def first(self, chunk: bytes, index: int, prompt_ids: list | None) -> bytes:
        """A chunk written before the choice's outputs (a chat role, an echo): the prompt's
        ids go on it (chat: without ``token_ids``, as vLLM's role chunk)."""
        if self.prompt_sent[index] or prompt_ids is None:
            return chunk
        self.prompt_sent[index] = True
        return with_ids(chunk, None if self.chat else [], prompt_ids, self.chat)

    def event(self, chunk: bytes | None, out) -> bytes | None:
        """``out``'s event (None: held back) with its ids."""
        index = out.index
        ids = out.token_ids or []
        held = self.held[index]
        if chunk is None:
            held.extend(ids)
            return None
        if held:
            ids = held + ids
            self.held[index] = []
        prompt = None
        if not self.prompt_sent[index] and out.prompt_token_ids is not None:
            self.prompt_sent[index] = True
            prompt = out.prompt_token_ids
        return with_ids(chunk, ids, prompt, self.chat)
