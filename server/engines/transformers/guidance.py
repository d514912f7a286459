"""Structured output's second backend on the transformers engine: llguidance, for the JSON
schemas whose keywords xgrammar would drop (:mod:`.schema_check`) and llguidance
enforces.

Example::

    guidance = Guidance(tokenizer, vocab_size=V, stop_ids=eos_ids)
    compiled = guidance.compile('{"type": "string", "format": "uri", "maxLength": 80}')
    matcher = guidance.matcher(compiled)       # quick: the loop's thread
    matcher.fill_next_token_bitmask(bitmask, row)   # xgrammar's bitmask layout, so the batch
    matcher.accept_token(token)                     # shares one mask with xgrammar's rows
    matcher.is_terminated()                    # the JSON is complete and EOS was taken
    failure(matcher)                           # llguidance's error, when it gave up

Theory of operation
-------------------
xgrammar stays the engine's grammar (:mod:`.grammar`): quicker to compile, and what the
tests and benchmarks were written against. When :func:`.schema_check.unenforced` finds a
keyword xgrammar would drop, :class:`~.grammar.Grammars` compiles the schema here
instead, in the same compile threads, under the same time budget and in the same cache
(keyed apart). llguidance's JSON compiler is strict: a keyword or ``format`` it does not
implement (``uniqueItems``, ``contains``, ``not``, ``if``, ``dependentRequired``,
``propertyNames``, a lookaround, an overlapping ``oneOf``, ``idn-email``...) is an error,
never ignored (``lenient`` is forced off, whatever the schema's ``x-guidance`` says: that
key, which could also allow free whitespace, is removed), so such a schema stays a 400
naming xgrammar's keyword and llguidance's reason. What llguidance adds: length bounds
beside a ``pattern`` or ``format`` (an intersection of the two), ``multipleOf`` on numbers,
``allOf`` of several schemas and constraints beside ``$ref``/``anyOf`` (intersections),
``patternProperties`` with ``properties`` or disjoint patterns.

Compiling makes one matcher (llguidance builds the grammar with the GIL released) and
computes its first mask, which builds the lexer's first states off the step loop; each
request's matcher is a ``deep_copy`` of it. JSON is compact (``whitespace_flexible`` off),
as on the xgrammar path, and llguidance's strings hold no raw control characters. A matcher
that fails mid-way (llguidance's per-step limits: ``step_lexer_fuel``, ``step_max_items``)
masks every token but EOS and refuses the next: :func:`failure` then names its error, and
the engine ends that request with an error rather than an unfinished document.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["Guidance", "GuidedMatcher", "failure", "OPTIONS"]

#: llguidance's JSON options, applied over the schema's own ``x-guidance``: compact JSON, no
#: keyword ignored, ``oneOf`` only when its branches cannot both match.
OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "lenient": False, "coerce_one_of": False}


class Guidance:
    """llguidance for one model's tokenizer (see the module docstring). Making it reads the
    tokenizer (a few ms for a small vocabulary, about a second for 128k tokens): the engine
    makes it at start, beside xgrammar's."""

    def __init__(self, tokenizer, *, vocab_size: int, stop_ids) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self._stop_ids = frozenset(stop_ids)

    def compile(self, schema_text: str):
        """A schema's compiled grammar (an unused matcher); any thread. ``ValueError`` with
        llguidance's reason for a schema it refuses."""
        schema = json.loads(schema_text)
        if isinstance(schema, dict):
            schema.pop("x-guidance", None)  # its options are ours (OPTIONS)
        matcher_type = self._llg.LLMatcher
        grammar = matcher_type.grammar_from_json_schema(schema, overrides=OPTIONS)
        compiled = matcher_type(self._tokenizer, grammar, log_level=0)
        if not compiled.is_error():
            compiled.compute_bitmask()  # the lexer's first states, here and not on the loop
        if compiled.is_error():
            raise ValueError(_first_line(compiled.get_error()))
        return compiled

    def matcher(self, compiled) -> GuidedMatcher:
        """A fresh matcher for a compiled grammar (quick: the loop's thread)."""
        return GuidedMatcher(compiled.deep_copy(), self._stop_ids)


class GuidedMatcher:
    """An llguidance matcher with the methods the engine calls on xgrammar's."""

    __slots__ = ("_matcher", "_stop_ids", "_ended")

    def __init__(self, matcher, stop_ids: frozenset) -> None:
        self._matcher = matcher
        self._stop_ids = stop_ids
        self._ended = False

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU int32 tensor, bit
        ``i % 32`` of word ``i // 32`` for token ``i``: xgrammar's layout too). What
        ``llguidance.torch.fill_next_token_bitmask`` does, without importing that module,
        which compiles a kernel with ``torch.compile`` on import (20 s on a busy machine)."""
        words = bitmask[row]
        if str(bitmask.dtype) != "torch.int32" or not words.is_contiguous() or words.device.type != "cpu":
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept_token(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar refuses it (the matcher then stays
        in error: :func:`failure`)."""
        taken = self._matcher.consume_token(token)
        if taken and token in self._stop_ids:
            self._ended = True
        return taken

    def is_terminated(self) -> bool:
        """Whether an EOS token was taken, which the grammar allows only once complete."""
        return self._ended

    def error(self) -> str | None:
        """llguidance's error, once it gave up (None while it has not)."""
        matcher = self._matcher
        return _first_line(matcher.get_error()) if matcher.is_error() else None


def failure(matcher) -> str | None:
    """Why a request's matcher gave up mid-way (an llguidance one; xgrammar's do not)."""
    return matcher.error() if isinstance(matcher, GuidedMatcher) else None


def _first_line(message: str) -> str:
    """llguidance's error without the parser state it appends (the tokens generated)."""
    return message.strip().split("\n")[0][:500]
