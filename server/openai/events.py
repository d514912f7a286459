"""What each output of a stream becomes on the wire when the request asked for more than text:
logprobs, a reasoning split (--reasoning-parser), or tool calls (--tool-call-parser, for
requests with tools). Sans-IO.

The plain case (text only) never comes here: the writer encodes it with
:meth:`ChunkEncoder.delta` directly, so its cost per event does not depend on these features.
"""

from __future__ import annotations

from ..outputs import RequestOutput
from .encode import ChunkEncoder
from .logprobs import LogprobsFormatter
from .reasoning import ReasoningSplitter
from .tool_parsers import new_parser
from .tools import ToolChoice

__all__ = ["RichEvents", "feed_through"]


class RichEvents:
    """Per-choice state (logprob offsets, reasoning splits) and the event of each output.

    ``prompts``: each choice's echoed prompt text (``echo`` with logprobs: it goes out with
    the prompt's logprobs, in the choice's first event), else None.
    """

    __slots__ = ("enc", "formatters", "splitters", "prompts", "tool_parsers", "include_reasoning")

    def __init__(
        self,
        enc: ChunkEncoder,
        *,
        choices: int,
        chat: bool,
        logprobs: bool,
        reasoning_parser: str | None,
        prompts: list[str] | None = None,
        tools: ToolChoice | None = None,
        include_reasoning: bool = True,
        tokens_as_ids: bool = False,
        thinking: bool = True,
    ) -> None:
        self.enc = enc
        self.include_reasoning = include_reasoning
        self.formatters = [
            LogprobsFormatter(chat, tokens_as_ids) for _ in range(choices)
        ] if logprobs else None
        self.splitters = None
        if chat and reasoning_parser is not None:
            self.splitters = [ReasoningSplitter.for_parser(reasoning_parser, thinking)
                              for _ in range(choices)]
        self.prompts = prompts
        self.tool_parsers = None
        if tools is not None and tools.parse is not None:
            self.tool_parsers = [
                new_parser(tools.parse, parallel=tools.parallel) for _ in range(choices)
            ]

    @staticmethod
    def wanted(
        *, chat: bool, logprobs: bool, reasoning_parser: str | None,
        tools: ToolChoice | None = None,
    ) -> bool:
        """Whether a stream needs these events (else: plain text events)."""
        return (
            logprobs or (chat and reasoning_parser is not None)
            or (tools is not None and tools.parse is not None)
        )

    def event(self, o: RequestOutput) -> bytes | None:
        """The event of output ``o`` (None: nothing to send yet, as when a reasoning split
        or a tool call parser holds back what may be the start of a tag). Several tool call
        deltas go out as consecutive chunks, one delta each."""
        formatter = self.formatters[o.index] if self.formatters is not None else None
        if self.splitters is None and self.tool_parsers is None:
            assert formatter is not None
            text = o.text
            if o.prompt_logprobs is not None and self.prompts is not None:  # echo: prompt first
                text = self.prompts[o.index] + text
            lp = formatter.format(o.logprobs, o.prompt_logprobs)
            return self.enc.delta_logprobs(o.index, text, o.finish_reason, lp)
        finish = o.finish_reason
        thought, said = "", o.text
        if self.splitters is not None:
            thought, said = feed_through(self.splitters[o.index], said, finish is not None)
            if not self.include_reasoning:  # (chat's include_reasoning: false)
                thought = ""
        calls: list = []
        if self.tool_parsers is not None:
            parser = self.tool_parsers[o.index]
            said, calls = feed_through(parser, said, finish is not None)
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
        lp = formatter.format(o.logprobs) if formatter is not None else None
        if not (thought or said or calls or finish is not None or lp is not None):
            return None
        delta = self.enc.delta_reasoning
        if len(calls) <= 1:
            return delta(o.index, thought, said, finish, lp, calls)
        chunks = [delta(o.index, thought, said, None, lp, calls[:1])]
        chunks += [delta(o.index, "", "", None, None, [c]) for c in calls[1:-1]]
        chunks.append(delta(o.index, "", "", finish, None, calls[-1:]))
        return b"".join(chunks)


def feed_through(parser, text: str, last: bool) -> tuple:
    """A splitter's or parser's ``feed`` of ``text``, with its ``finish`` when ``last``."""
    a, b = parser.feed(text)
    if last:
        more_a, more_b = parser.finish()
        a, b = a + more_a, b + more_b
    return a, b
