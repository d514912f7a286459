"""OpenAI's logprobs objects from the engine's entries. Sans-IO.

An engine sends, for a request that asked, one entry per token:
``[text, logprob, [[alt_text, alt_logprob], ...]]`` (the alternatives: the most likely
tokens, best first; see :class:`server.outputs.RequestOutput`). This module shapes them:

- completions (OpenAI's legacy shape, which lm-evaluation-harness reads)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
     "text_offset": [...]}

  ``top_logprobs`` holds the chosen token, first, and the alternatives (as vLLM does);
  ``text_offset`` is each token's character offset in the choice's text (the echoed prompt
  included), continued across the chunks of a stream;
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}]}``.

With vLLM's ``return_tokens_as_token_ids`` every token (chosen or alternative) is spelled
``token_id:N`` instead of its text (its ``bytes`` are those of that spelling, as vLLM's),
from the ids that the transformers and vllm engines put in their entries; ``text_offset``
still counts the text.

Only requests that asked pay for any of this: the others never reach this module.
"""

from __future__ import annotations

__all__ = ["LogprobsFormatter", "prompt_logprobs"]


class LogprobsFormatter:
    """The logprobs objects of one choice, in order (it keeps the text offset)."""

    __slots__ = ("chat", "offset", "as_ids")

    def __init__(self, chat: bool, as_ids: bool = False) -> None:
        self.chat = chat
        self.offset = 0
        #: ``return_tokens_as_token_ids``: tokens spelled ``token_id:N``.
        self.as_ids = as_ids

    def format(self, entries: list | None, prompt: list | None = None) -> dict | None:
        """The logprobs object of the next tokens (``prompt``: the echoed prompt's entries,
        before them); None when there is nothing to say."""
        if self.chat:
            if entries is None:
                return None
            if self.as_ids:
                entries = [_as_ids(e) for e in entries]
            return {"content": [_chat_entry(e) for e in entries]}
        if not entries and not prompt:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in (prompt or []) + (entries or []):
            text, logprob, alts = entry[0], entry[1], entry[2]
            spelled = text
            if self.as_ids:
                spelled, _, alts = _as_ids(entry)
            out["tokens"].append(spelled)
            out["token_logprobs"].append(logprob)
            if logprob is None:
                out["top_logprobs"].append(None)
            else:
                # the chosen token's first, then the alternatives (as vLLM orders them:
                # clients read the first key as the chosen token's spelling)
                top = {spelled: logprob}
                top.update((alt[0], alt[1]) for alt in alts)
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def prompt_logprobs(entries: list | None) -> list | None:
    """vLLM's ``prompt_logprobs`` of a prompt's entries (with their ids: see
    :func:`server.worker_protocol.wire._logprob_entry`): the first token's null, then for
    each token ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt's token
    first, then its most likely alternatives (ranked 1, 2, ...)."""
    if entries is None:
        return None
    out: list = []
    for entry in entries:
        if entry[1] is None:
            out.append(None)
            continue
        text, logprob, alts, token, rank = entry
        position = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": text}}
        for place, (alt, lp, alt_id) in enumerate(alts, 1):
            position.setdefault(str(alt_id), {"logprob": lp, "rank": place,
                                              "decoded_token": alt})
        out.append(position)
    return out


def _as_ids(entry: list) -> list:
    """An entry with its tokens spelled ``token_id:N`` (an entry without ids, from an
    engine that sends none, stays as it is: the schema refuses the field for it)."""
    if len(entry) < 5:
        return entry
    alts = [[f"token_id:{alt[2]}", alt[1]] for alt in entry[2]]
    return [f"token_id:{entry[3]}", entry[1], alts]


def _chat_entry(entry: list) -> dict:
    text, logprob, alts = entry[0], entry[1], entry[2]
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": alt[0], "logprob": alt[1], "bytes": list(alt[0].encode("utf-8"))}
            for alt in alts
        ],
    }
