"""vLLM's ``structured_outputs`` request field: output constrained to a JSON schema, a
regular expression, one of several strings, or a grammar (sans-IO).

``structured_outputs`` is vLLM's spelling of what OpenAI calls ``response_format``, with
more kinds of constraint. Exactly one of:

- ``{"json": {...schema...}}`` (a schema object, or its JSON text),
- ``{"json_object": true}`` (any JSON object),
- ``{"regex": "..."}``,
- ``{"choice": ["yes", "no", ...]}`` (exactly one of these strings),
- ``{"grammar": "..."}`` (GBNF/EBNF, xgrammar's dialect: ``root ::= ...``; or Lark, as
  outlines' ``CFG`` sends: ``start: ...``; told apart as vLLM does,
  :mod:`server.engines.transformers.grammar_text`),
- ``{"structural_tag": "..."}`` (the JSON text of a structural tag, below).

It becomes the same engine parameter as ``response_format`` (the engine's
``response_format``, with a ``type`` per kind and the origin ``structured_outputs`` so that
the engine's errors name this field); sending both is a 400. Options of vLLM's
``StructuredOutputsParams`` that change how the constraint is compiled
(``disable_any_whitespace``, ``whitespace_pattern``, ...) are refused by name: this server
always generates JSON without free whitespace.

A structural tag (vLLM's ``response_format`` ``{"type": "structural_tag", ...}``, or this
field's ``structural_tag``) lets the model write free text, with xgrammar's constraints
where it opens a tag. Two forms, as vLLM takes them (:func:`structural_tag`): vLLM's legacy
``{"structures": [{"begin": "<f>", "schema": {...}, "end": "</f>"}, ...], "triggers":
["<f"]}``, and xgrammar's ``{"format": {...}}``; its JSON text goes to the engine, which
compiles it as vLLM does (a malformed ``format`` is xgrammar's 400).
"""

from __future__ import annotations

import json

from ..errors import ClientError
from .json_schema import check_grammar_ints, check_refs

__all__ = ["KINDS", "structural_tag", "structured_outputs"]

#: The constraint kinds, each the key that names it.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: The longest regex or grammar text, and the most choices (the engine's byte budget,
#: --grammar-max-bytes, bounds them too).
MAX_TEXT = 256 * 1024
MAX_CHOICES = 4096

_FIELD = "structured_outputs"


def _error(message: str) -> ClientError:
    return ClientError(f"'{_FIELD}' {message}", param=_FIELD)


def structured_outputs(data: dict) -> dict | None:
    """The engine's ``response_format`` for a request's ``structured_outputs``, or None when
    the field is absent or null; a :class:`ClientError` naming the field when it is not one
    of the forms in the module docstring."""
    value = data.get(_FIELD)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _error("must be an object with one of: " + ", ".join(KINDS) + ".")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    other = sorted(set(given) - set(KINDS))
    if other:
        raise _error(f"options {', '.join(map(repr, other))} are not supported here (only one "
                     "of " + ", ".join(KINDS) + ").")
    if len(given) != 1:
        raise _error("needs exactly one of: " + ", ".join(KINDS) + ".")
    ((kind, spec),) = given.items()
    if kind == "json_object":
        if spec is not True:
            raise _error("json_object must be true.")
        return {"type": "json_object", "origin": _FIELD}
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise _error("json must be a JSON schema (an object or its JSON text).") from None
        if not isinstance(spec, dict):
            raise _error("json must be a JSON schema (an object or its JSON text).")
        check_refs(spec, _FIELD)
        check_grammar_ints(spec, _FIELD)
        return {"type": "json_schema", "schema": spec, "origin": _FIELD}
    if kind == "choice":
        if not (isinstance(spec, list) and 0 < len(spec) <= MAX_CHOICES
                and all(isinstance(c, str) and c and "\x00" not in c for c in spec)):
            raise _error(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings "
                         "(without NUL characters).")
        if sum(len(c) for c in spec) > MAX_TEXT:
            raise _error(f"choice is too long (more than {MAX_TEXT} characters in all).")
        return {"type": "choice", "choice": list(spec), "origin": _FIELD}
    if not isinstance(spec, str) or not spec or len(spec) > MAX_TEXT:
        raise _error(f"{kind} must be a non-empty string of at most {MAX_TEXT} characters.")
    if kind == "structural_tag":
        try:
            tag = json.loads(spec)
        except ValueError:
            raise _error("structural_tag must be the JSON text of a structural tag.") from None
        if isinstance(tag, dict):
            tag = {"type": "structural_tag", **tag}
        return {**structural_tag(tag, _FIELD), "origin": _FIELD}
    return {"type": kind, kind: spec, "origin": _FIELD}


#: The members of each form of a structural tag (besides ``type``), and of a structure.
_LEGACY, _FORMAT, _STRUCTURE = ("structures", "triggers"), ("format",), ("begin", "schema", "end")


def structural_tag(value, param: str) -> dict:
    """The engine's ``response_format`` for a structural tag ``value`` (``{"type":
    "structural_tag", ...}`` in one of the two forms of the module docstring): its JSON text,
    compact, under ``structural_tag``. A :class:`ClientError` naming ``param`` when it has
    neither form, a member of neither, or a reference a grammar cannot follow."""
    def bad(what: str) -> ClientError:
        return ClientError(f"'{param}' {what}", param=param)

    forms = ("a structural tag is {\"type\": \"structural_tag\", \"structures\": [{\"begin\", "
             "\"schema\", \"end\"}, ...], \"triggers\": [...]} or {\"type\": \"structural_tag\", "
             "\"format\": {...}}")
    if not isinstance(value, dict) or value.get("type") != "structural_tag":
        raise bad(f"must be a structural tag: {forms}.")
    members = set(value) - {"type"}
    form = _LEGACY if "structures" in value else _FORMAT
    if members != set(form):
        raise bad(f"has {', '.join(map(repr, sorted(members))) or 'no members'}: {forms}.")
    if form == _FORMAT:
        if not isinstance(value["format"], dict):
            raise bad("'format' must be an object (an xgrammar structural tag format).")
    else:
        structures, triggers = value["structures"], value["triggers"]
        if not (isinstance(triggers, list) and triggers
                and all(isinstance(t, str) and t for t in triggers)):
            raise bad("'triggers' must be a list of non-empty strings.")
        if not isinstance(structures, list) or not structures:
            raise bad("'structures' must be a non-empty list.")
        for i, item in enumerate(structures):
            if not (isinstance(item, dict) and set(item) == set(_STRUCTURE)
                    and isinstance(item["begin"], str) and item["begin"]
                    and isinstance(item["end"], str) and isinstance(item["schema"], dict)):
                raise bad(f"structures[{i}] must be {{\"begin\": a non-empty string, "
                          "\"schema\": a JSON schema, \"end\": a string}.")
            check_refs(item["schema"], param)
            check_grammar_ints(item["schema"], param)
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return {"type": "structural_tag", "structural_tag": text}
