"""The constraints of vLLM's ``structured_outputs`` that are texts rather than JSON schemas
(a ``grammar``, a ``structural_tag``), compiled for the transformers engine with xgrammar
as vLLM's xgrammar backend compiles them, so that a client's grammar means the same on
both engines.

Example::

    is_lark('?start: "a" "b"+')                              # True
    compile_text_grammar(compiler, 'root ::= "a" "b"+')      # GBNF/EBNF
    structural_tag_grammar(xgrammar, tag_json)               # response_format's JSON text

A ``grammar`` is in one of two dialects, told apart by vLLM's rule
(``vllm.v1.structured_output.utils.grammar_is_likely_lark``): a grammar with a rule
defined by ``::=`` (comments aside) is GBNF/EBNF, xgrammar's dialect (llama.cpp's GBNF);
any other is Lark (what outlines' ``CFG`` and llguidance take), which xgrammar reads
itself (``compile_lark``: ``start``, ``?rule``, terminals, ``/regex/``, ``%import
common``, ``%ignore``). A grammar that fails in the dialect it was read as is refused
(``ValueError``) with the reader's first line and the two dialects expected. Sans-IO: the
xgrammar module and compiler are the caller's.

A ``structural_tag`` is the JSON text of ``response_format`` ``{"type": "structural_tag",
...}``: vLLM's legacy form (``structures`` of ``begin``/``schema``/``end`` and their
``triggers``) or xgrammar's (``format``), built as vLLM does; the JSON inside a tag is
written with xgrammar's whitespace rules for tags, as vLLM's. Its schemas are checked
first (:func:`.schema_check.tag_unenforced`), as a ``json_schema``'s are.
"""

from __future__ import annotations

import json
import re

__all__ = ["is_lark", "compile_text_grammar", "structural_tag_grammar", "DIALECTS"]

#: What a grammar may be, for a refusal.
DIALECTS = ("a grammar must be GBNF/EBNF (xgrammar's dialect: 'root ::= ...') or Lark "
            "('start: ...')")
_COMMENT = re.compile(r"(#|//).*$")


def is_lark(text: str) -> bool:
    """Whether ``text`` is read as Lark: vLLM's rule, no line (comments removed) with
    ``::=``."""
    return not any("::=" in _COMMENT.sub("", line) for line in text.split("\n"))


def compile_text_grammar(compiler, text: str):
    """A ``grammar`` compiled in its dialect (see the module docstring); ``ValueError``
    naming the dialect it was read as and the dialects expected when it does not compile."""
    lark = is_lark(text)
    try:
        return compiler.compile_lark(text) if lark else compiler.compile_grammar(text)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        reason = lines[0] if lines else type(exc).__name__
        read_as = ("Lark (no rule is defined with '::=')" if lark
                   else "GBNF/EBNF (a rule is defined with '::=')")
        raise ValueError(f"read as {read_as}: {reason}; {DIALECTS}") from None


def structural_tag_grammar(xgrammar, text: str):
    """A ``structural_tag`` (its JSON text) as the grammar vLLM's xgrammar backend compiles
    (a ``Grammar``: the caller narrows its strings before compiling it)."""
    tag = json.loads(text)
    if "structures" in tag:  # vLLM's legacy form
        items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                            end=s["end"]) for s in tag["structures"]]
        return xgrammar.Grammar.from_structural_tag(items, tag["triggers"])
    return xgrammar.Grammar.from_structural_tag(text)
