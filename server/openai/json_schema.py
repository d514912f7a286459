"""JSON schemas from clients: their references checked, and moved with the schema. Sans-IO.

Theory of operation
-------------------
Clients rarely write schemas by hand: pydantic, zod and the SDKs built on them emit every
nested model once under ``$defs`` (or the older ``definitions``) and point at it with
``{"$ref": "#/$defs/Item"}``, a JSON pointer from the root of the schema they sent. The
grammar of a forced tool call (:mod:`server.openai.tools`) puts each tool's ``parameters``
inside a larger schema (``#/items/properties/arguments``), where such a pointer would name
the wrong place. :func:`rebase` returns a copy whose local references point where the
schema now sits, so any pointer (``$defs``, ``definitions``, a chain of references, ``#``
itself for recursion) still resolves, to the same subschema.

:func:`check_refs` is applied first to every schema a grammar is compiled from (the
``parameters`` of a forced tool call, ``response_format``). A reference the grammar engine
cannot resolve would otherwise be an error from deep in the engine, or, for a URL, silently
ignored by xgrammar. So it is a 400 here naming the field and the reference. Such are
references to other documents, to ``$anchor`` names, ``$dynamicRef`` / ``$recursiveRef``,
pointers to nothing, and pointers through a list (``#/anyOf/0``: xgrammar resolves object
keys only).

Keywords whose values are data, not schemas (``enum``, ``const``, ``default``,
``examples``), are left alone; under ``properties`` (and the other keyword maps) the keys
are names, so a property named ``default`` is still a schema.

Example::

    check_refs(params, "tools[0].function.parameters")
    rebase({"$ref": "#/$defs/A", "$defs": {...}}, "#/items")  # {"$ref": "#/items/$defs/A", ...}
"""

from __future__ import annotations

from urllib.parse import unquote

from ..errors import ClientError

__all__ = ["check_grammar_ints", "check_refs", "rebase"]

#: Keywords whose value is a map of names to schemas.
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas", "dependencies"})
#: Keywords whose value is data.
_DATA = frozenset({"enum", "const", "default", "examples"})
#: Reference keywords no pointer rewriting can serve.
_DYNAMIC = ("$dynamicRef", "$recursiveRef")


def _refs(node, out: list) -> None:
    """Collect every ``$ref`` (and dynamic reference) string of a schema, in order."""
    if isinstance(node, list):
        for item in node:
            _refs(item, out)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _DATA:
            continue
        if key == "$ref" or key in _DYNAMIC:
            out.append((key, value))
        elif key in _MAPS and isinstance(value, dict):
            for sub in value.values():
                _refs(sub, out)
        else:
            _refs(value, out)


def _target(schema: dict, pointer: str) -> str | None:
    """What is wrong with a local JSON pointer (None: it names a subschema)."""
    node: object = schema
    for token in pointer[2:].split("/") if pointer != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            return ("points into a list, which is not supported: move the subschema under "
                    "'$defs' and refer to it there")
        if not isinstance(node, dict) or token not in node:
            return "points to nothing in the schema"
        node = node[token]
    return None if isinstance(node, (dict, bool)) else "points to something not a schema"


def check_refs(schema: dict, param: str) -> None:
    """A 400 naming ``param`` and the reference for any ``$ref`` of ``schema`` that is not
    a JSON pointer into ``schema`` itself (see the module docstring)."""
    found: list = []
    try:
        _refs(schema, found)
    except RecursionError:
        raise ClientError("The schema is nested too deeply.", param=param) from None
    for key, ref in found:
        if key in _DYNAMIC:
            raise ClientError(f"'{key}' is not supported in a schema: use '$ref' to a "
                              "definition under '$defs'.", param=param)
        if not isinstance(ref, str):
            raise ClientError("'$ref' must be a string.", param=param)
        shown = ref if len(ref) <= 80 else ref[:77] + "..."
        if not ref.startswith("#"):
            raise ClientError(
                f"'$ref' {shown!r} refers to another document, which is not supported: give "
                "the definitions in the schema itself (under '$defs').", param=param)
        if ref != "#" and not ref.startswith("#/"):
            raise ClientError(
                f"'$ref' {shown!r} names an anchor, which is not supported: use a JSON "
                "pointer such as '#/$defs/Name'.", param=param)
        wrong = _target(schema, ref)
        if wrong is not None:
            raise ClientError(f"'$ref' {shown!r} {wrong}.", param=param)


_INT64 = range(-(2**63), 2**63)


def _big_int(node) -> bool:
    if isinstance(node, int) and not isinstance(node, bool):
        return node not in _INT64
    if isinstance(node, list):
        return any(_big_int(item) for item in node)
    if isinstance(node, dict):
        return any(_big_int(v) for k, v in node.items() if k not in ("default", "examples"))
    return False


def check_grammar_ints(schema: dict, param: str) -> None:
    """A 400 naming ``param`` for an integer beyond 64 bits in a schema the grammar is
    compiled from (``default`` and ``examples`` aside): xgrammar holds them as doubles, so
    an ``enum`` or ``const`` of one would force a different number, and a bound of one is
    an error. (Elsewhere, in tool-call arguments and template variables, they pass
    through intact.)"""
    try:
        big = _big_int(schema)
    except RecursionError:
        raise ClientError("The schema is nested too deeply.", param=param) from None
    if big:
        raise ClientError(
            "Integers beyond 64 bits in a schema are not supported by the grammar compiler "
            "(in 'enum', 'const' or bounds): write them as strings.", param=param)


def rebase(schema, base: str):
    """A copy of ``schema`` (checked by :func:`check_refs`) whose local references point
    into it at its new place, the JSON pointer ``base`` (such as ``"#/items"``)."""
    if isinstance(schema, list):
        return [rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _MAPS and isinstance(value, dict):
            out[key] = {name: rebase(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebase(value, base)
    return out
