"""What each output of a stream becomes on the wire when the request asked for more than text:
logprobs, or a reasoning split (--reasoning-parser). Sans-IO.

The plain case (text only) never comes here: the writer encodes it with
:meth:`ChunkEncoder.delta` directly, so its cost per event does not depend on these features.
"""

from __future__ import annotations

from ..outputs import RequestOutput
from .encode import ChunkEncoder
from .logprobs import LogprobsFormatter
from .reasoning import ReasoningSplitter

__all__ = ["RichEvents"]


class RichEvents:
    """Per-choice state (logprob offsets, reasoning splits) and the event of each output.

    ``prompts``: each choice's echoed prompt text (``echo`` with logprobs: it goes out with
    the prompt's logprobs, in the choice's first event), else None.
    """

    __slots__ = ("enc", "formatters", "splitters", "prompts")

    def __init__(
        self,
        enc: ChunkEncoder,
        *,
        choices: int,
        chat: bool,
        logprobs: bool,
        reasoning_parser: str | None,
        prompts: list[str] | None = None,
    ) -> None:
        self.enc = enc
        self.formatters = [LogprobsFormatter(chat) for _ in range(choices)] if logprobs else None
        self.splitters = None
        if chat and reasoning_parser is not None:
            self.splitters = [ReasoningSplitter.for_parser(reasoning_parser) for _ in range(choices)]
        self.prompts = prompts

    @staticmethod
    def wanted(*, chat: bool, logprobs: bool, reasoning_parser: str | None) -> bool:
        """Whether a stream needs these events (else: plain text events)."""
        return logprobs or (chat and reasoning_parser is not None)

    def event(self, o: RequestOutput) -> bytes | None:
        """The event of output ``o`` (None: nothing to send yet, as when a reasoning split
        holds back what may be the start of a tag)."""
        formatter = self.formatters[o.index] if self.formatters is not None else None
        if self.splitters is not None:
            splitter = self.splitters[o.index]
            thought, said = splitter.feed(o.text)
            if o.finish_reason is not None:
                more_thought, more_said = splitter.finish()
                thought, said = thought + more_thought, said + more_said
            lp = formatter.format(o.logprobs) if formatter is not None else None
            if not (thought or said or o.finish_reason is not None or lp is not None):
                return None
            return self.enc.delta_reasoning(o.index, thought, said, o.finish_reason, lp)
        assert formatter is not None
        text = o.text
        if o.prompt_logprobs is not None and self.prompts is not None:  # echo: the prompt first
            text = self.prompts[o.index] + text
        lp = formatter.format(o.logprobs, o.prompt_logprobs)
        return self.enc.delta_logprobs(o.index, text, o.finish_reason, lp)
