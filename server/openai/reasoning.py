"""Reasoning content: a reasoning model's ``<think>...</think>`` split from its answer.
Sans-IO, streaming-safe.

Example::

    split = ReasoningSplitter.for_parser("qwen3")
    split.feed("<thi")            # ("", ""): could be the start of the tag, held back
    split.feed("nk>Let me see")   # ("Let me see", "")
    split.feed("</think>Yes.")    # ("", "Yes.")
    split.finish()                # ("", ""): anything held back

``--reasoning-parser`` picks the family, as vLLM names them:

- ``qwen3`` (vLLM 0.32's): the output starts in reasoning (Qwen3's templates may open
  ``<think>`` in the prompt; a leading ``<think>`` is dropped) until ``</think>``. When the
  output did not open ``<think>`` itself, a ``<tool_call>`` also ends it and starts the
  content: that is a model that answers with a call without thinking. Inside thinking the
  output opened, a ``<tool_call>`` is only mentioned. An answer that never closes its thinking
  is all reasoning. With thinking off (the request's
  ``chat_template_kwargs.enable_thinking: false``) it is all content;
- ``deepseek_r1``: the chat template opens the thinking in the prompt, so the output starts
  in reasoning; ``</think>`` ends it (a leading ``<think>`` is dropped). An answer that never
  closes its thinking is all reasoning.

Text that might be the beginning of a tag is held back until it is decided, so a tag split
across tokens (``"</th"``, ``"ink>"``) never leaks into either part; the concatenation of
what is returned equals the text without its tags.
"""

from __future__ import annotations

__all__ = ["ReasoningSplitter", "PARSERS", "split_text"]

START = "<think>"
END = "</think>"

TOOL_CALL = "<tool_call>"

#: The parsers ``--reasoning-parser`` takes: name -> (whether the output starts in
#: reasoning, the tag that also ends reasoning, kept in the content; None: only ``</think>``).
PARSERS: dict[str, tuple[bool, str | None]] = {
    "qwen3": (True, TOOL_CALL), "deepseek_r1": (True, None),
}


class ReasoningSplitter:
    """Splits one choice's streamed text into (reasoning, content) deltas."""

    __slots__ = ("_state", "_held", "_also_ends")

    # States: "open" (at the start: a <think> may come), "reasoning", "content".

    def __init__(self, starts_in_reasoning: bool, also_ends: str | None = None) -> None:
        self._state = "open-reasoning" if starts_in_reasoning else "open"
        self._held = ""
        self._also_ends = also_ends

    @classmethod
    def for_parser(cls, name: str, thinking: bool = True) -> ReasoningSplitter:
        """``thinking``: false when the request turned the model's thinking off (qwen3's
        ``enable_thinking: false``): then its answer is all content, as in vLLM."""
        starts, also_ends = PARSERS[name]
        if name == "qwen3" and not thinking:
            return cls(False, None)
        return cls(starts, also_ends)

    def feed(self, piece: str) -> tuple[str, str]:
        """Add text; returns the (reasoning, content) that is decided now."""
        text = self._held + piece
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            state = self._state
            if state.startswith("open"):
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self._state = "reasoning"
                    self._also_ends = None  # thinking the output opened: </think> ends it
                    text = stripped[len(START):]
                    continue
                if START.startswith(stripped):  # maybe a <think> still coming
                    self._held = text
                    break
                self._state = "reasoning" if state == "open-reasoning" else "content"
                continue
            if state == "content":
                content.append(text)
                break
            # reasoning: up to </think> (or the tag that also ends it, which stays in the
            # content), holding back what could begin either
            cut = text.find(END)
            other = self._also_ends
            at = text.find(other) if other else -1
            if at != -1 and (cut == -1 or at < cut):
                reasoning.append(text[:at])
                text = text[at:]
                self._state = "content"
                continue
            if cut != -1:
                reasoning.append(text[:cut])
                text = text[cut + len(END):]
                self._state = "content"
                continue
            keep = max(_partial_suffix(text, END), _partial_suffix(text, other) if other else 0)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text ended: what was held back, where it belongs."""
        held, self._held = self._held, ""
        if not held:
            return "", ""
        if self._state in ("reasoning", "open-reasoning"):
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split_text(parser: str, text: str, thinking: bool = True) -> tuple[str, str]:
    """(reasoning, content) of a whole answer."""
    splitter = ReasoningSplitter.for_parser(parser, thinking)
    thought, said = splitter.feed(text)
    more_thought, more_said = splitter.finish()
    return thought + more_thought, said + more_said
