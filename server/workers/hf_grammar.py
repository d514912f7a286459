"""Structured output for the transformers engine: ``response_format`` as a grammar, with
xgrammar (what vLLM and SGLang use by default).

Example::

    grammars = Grammars(tokenizer, vocab_size=V, stop_ids=eos_ids)
    matcher = grammars.matcher({"type": "json_schema", "schema": {"type": "object", ...}})
    grammars.mask(logits, [(row, matcher)])      # the batch's constrained rows, in place
    matcher.accept_token(token)                  # after the pick
    matcher.is_terminated()                      # the JSON is complete and EOS was taken

Compiled grammars are cached per schema (xgrammar's compiler cache), so a schema sent with
every request is compiled once. The mask is one bitmask for the rows that have a grammar,
filled per row and applied to the logits in one call; rows without one are not touched.
JSON is generated without free whitespace between tokens (as vLLM's
``disable_any_whitespace``): a model may not pad a document forever with blanks.
"""

from __future__ import annotations

import json

from .base import Rejected, one_line

__all__ = ["Grammars"]


class Grammars:
    """The grammars of one model's tokenizer (see the module docstring)."""

    def __init__(self, tokenizer, *, vocab_size: int, stop_ids) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size

    def matcher(self, response_format: dict):
        """A fresh matcher for a request's ``response_format`` (``{"type": "json_object"}``
        or ``{"type": "json_schema", "schema": {...}}``); an invalid or unsupported schema
        is :class:`Rejected` naming the problem."""
        kind = response_format.get("type")
        try:
            if kind == "json_object":
                compiled = self._compiler.compile_builtin_json_grammar()
            elif kind == "json_schema":
                schema = json.dumps(response_format.get("schema") or {})
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
            else:
                raise Rejected(f"unknown response_format type {kind!r}")
        except Rejected:
            raise
        except Exception as exc:
            raise Rejected(f"response_format: unsupported JSON schema: {one_line(exc)}") from None
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, logits, rows: list) -> None:
        """Allow only each constrained row's grammatical next tokens: ``rows`` is
        ``[(row index, matcher), ...]``; ``logits`` is changed in place."""
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
            indices=[row for row, _ in rows],
        )
