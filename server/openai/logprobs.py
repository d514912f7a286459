"""OpenAI's logprobs objects from the engine's entries. Sans-IO.

An engine sends, for a request that asked, one entry per token:
``[text, logprob, [[alt_text, alt_logprob], ...]]`` (the alternatives: the most likely
tokens, best first; see :class:`server.outputs.RequestOutput`). This module shapes them:

- completions (OpenAI's legacy shape, which lm-evaluation-harness reads)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
     "text_offset": [...]}

  ``top_logprobs`` holds the alternatives and the chosen token (as vLLM does);
  ``text_offset`` is each token's character offset in the choice's text (the echoed prompt
  included), continued across the chunks of a stream;
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}]}``.

Only requests that asked pay for any of this: the others never reach this module.
"""

from __future__ import annotations

__all__ = ["LogprobsFormatter"]


class LogprobsFormatter:
    """The logprobs objects of one choice, in order (it keeps the text offset)."""

    __slots__ = ("chat", "offset")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.offset = 0

    def format(self, entries: list | None, prompt: list | None = None) -> dict | None:
        """The logprobs object of the next tokens (``prompt``: the echoed prompt's entries,
        before them); None when there is nothing to say."""
        if self.chat:
            if entries is None:
                return None
            return {"content": [_chat_entry(e) for e in entries]}
        if not entries and not prompt:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in (prompt or []) + (entries or []):
            text, logprob, alts = entry
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            if logprob is None:
                out["top_logprobs"].append(None)
            else:
                top = {alt: lp for alt, lp in alts}
                top.setdefault(text, logprob)
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _chat_entry(entry: list) -> dict:
    text, logprob, alts = entry
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": alt, "logprob": lp, "bytes": list(alt.encode("utf-8"))} for alt, lp in alts
        ],
    }
