"""Resuming a migrated request on the vllm engine: which requests can be, and their text
across the cut. Sans-IO (vLLM's detokenizer, no engine).

Theory of operation
-------------------
A resumed request (``"resume": {"token_ids": G, "text_chars": k}``, see
:mod:`server.workers.resume`) is added to vLLM with ``prompt_token_ids`` = the prompt's ids
and G, ``max_tokens`` what is left (the frontend reduced it), ``min_tokens`` less G, and the
other sampling fields as they were: greedy decoding continues as the uninterrupted run
would (vLLM's repetition penalty covers prompt and output alike, so it is unchanged).

vLLM's own detokenizer of that request would start at the cut: a stop string spanning the
cut would not be found, and the text the dead worker held back (it might begin a stop
string) would be lost. So vLLM gets the request *without* stop strings, and its text is
made here by :class:`ResumedText`. That is an instance of vLLM's own incremental detokenizer
(``vllm.v1.engine.detokenizer.IncrementalDetokenizer``, the class its output processor
uses, built for the *original* prompt and sampling params), replayed through G as the
dead worker's was step by step. It then holds the same decode state (a character whose
bytes span the cut comes out whole with the token that completes it), the same text, and
the same stop-string rules (``min_tokens``, ``include_stop_str_in_output``, the EOS token
not decoded). Its text past the client's ``k`` characters (held back for a stop
string) goes out as the detokenizer releases it (its deltas start at the start of its
text: the first ``k`` characters are dropped); each step's tokens are fed to it, and a stop
string it finds ends the request here (vLLM's request is aborted).

What cannot resume exactly is not resumed: the worker sends no token ids for it (so the
frontend ends its stream with ``worker_died``, as before) and refuses a ``resume`` of it:

- a grammar (``response_format``, forced tool calls): vLLM compiles and advances the
  request's grammar inside its engine core, with no public way to replay tokens through it,
  so a resumed request's grammar would start over at the cut;
- ``presence_penalty``, ``frequency_penalty`` (vLLM counts output tokens only: the tokens
  before the cut, now prompt, would stop counting) and ``bad_words`` (vLLM matches the
  output before the cut);
- a tokenizer vLLM detokenizes without its detokenizer class (none here).

Seeded sampling resumes, but not bit for bit: vLLM seeds a fresh generator for each
request, so after the cut the draws restart from the seed's first ones. The text is a
valid sample of the same distribution, and the same for the same seed and cut, but not the
uninterrupted run's (docs/routing.md).
"""

from __future__ import annotations

from ...workers.base import Rejected
from .private_api import new_detokenizer

__all__ = ["ResumedText", "not_resumable"]

#: Fields whose effect a resume on vLLM cannot reproduce (module docstring).
_NOT_RESUMABLE = ("response_format", "presence_penalty", "frequency_penalty", "bad_words")


def not_resumable(params: dict) -> str | None:
    """The field that keeps a request from resuming on vLLM (None: it can)."""
    for name in _NOT_RESUMABLE:
        if params.get(name):
            return name
    return None


class ResumedText:
    """The text side of one resumed request (see the module docstring).

    ``sampling``: the request's ``vllm.SamplingParams`` as first submitted (its stop
    strings included); ``prompt_ids``: its prompt, without the generated tokens."""

    __slots__ = ("_detok", "_skip")

    def __init__(self, tokenizer, prompt_ids: list[int], generated: list[int],
                 text_chars: int, sampling) -> None:
        self._detok = new_detokenizer(tokenizer, prompt_ids, sampling)
        if generated and self._detok.update(list(generated), False) is not None:
            raise Rejected("resume: the generated text already holds a stop string",
                           "engine_error")
        if len(getattr(self._detok, "output_text", "")) < text_chars:
            raise Rejected("resume: the client has more text than the generated tokens make",
                           "engine_error")
        #: Characters at the start of the detokenizer's text that the client already has
        #: (its deltas start at the start of the text, the held-back part included).
        self._skip = text_chars

    def feed(self, token_ids: list[int], finished: bool,
             stop_terminated: bool) -> tuple[str, int, bool]:
        """One step's new tokens of the request (vLLM's ``finished``; ``stop_terminated``:
        it ended on EOS or a stop token id). Returns the text to send, how many of the
        tokens count (those after a stop string's are dropped, as vLLM does), and whether a
        stop string ended it."""
        detok = self._detok
        before = detok.num_output_tokens()
        stopped = detok.update(list(token_ids), stop_terminated) is not None
        text = detok.get_next_output_text(finished or stopped, True)
        if self._skip:
            cut = min(self._skip, len(text))
            text, self._skip = text[cut:], self._skip - cut
        return text, detok.num_output_tokens() - before, stopped
