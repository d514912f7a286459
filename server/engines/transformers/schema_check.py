"""JSON Schema keywords the transformers engine's grammar (xgrammar 0.2) cannot enforce,
found before compiling so that they are refused, never accepted and ignored. Sans-IO.

Theory of operation
-------------------
xgrammar turns a schema into a grammar, and some keywords it cannot express in one: it
drops them (sometimes with a line on stderr, sometimes silently), and the answer then need
not satisfy the schema (issue 29, item 7: ``bench/schema_validity.py`` shows it). vLLM
checks for the same list (``has_xgrammar_unsupported_json_features``) and falls back to
another backend; this engine has no other, so each is a 400 naming the keyword and where
it is (``#/properties/tags``). :func:`unenforced` walks every subschema (``$defs`` too:
what is never referenced is still refused, as the check does not follow references):

- ``not``, ``if``/``then``/``else``, ``dependentRequired``, ``dependentSchemas``,
  ``dependencies``, ``uniqueItems: true``, ``contains``/``minContains``/``maxContains``,
  ``allOf`` of more than one schema: dropped by xgrammar (any value, or an array of any
  items, is allowed in their place);
- ``multipleOf`` but on integers by an integer: dropped for numbers;
- ``minLength``/``maxLength`` with ``pattern`` or ``format`` on the same string: the bounds
  are dropped (a ``minLength`` of 1 beside a format that is never empty, as pydantic's
  ``AnyUrl`` has, is met anyway and accepted);
- a ``pattern`` with a lookaround (``(?=``, ``(?!``, ``(?<=``, ``(?<!``): xgrammar ignores
  lookaheads (lookbehinds, backreferences and word boundaries it refuses itself);
- a ``format`` that JSON Schema defines and xgrammar does not implement (``idn-email``,
  ``idn-hostname``, ``iri``, ``iri-reference``, ``regex``); other unknown formats
  (``password``, ``binary``, ``int32``: OpenAPI's and pydantic's) are annotations, which
  JSON Schema says a validator must not fail on, and are accepted;
- ``propertyNames`` with ``properties`` or ``patternProperties``, and ``patternProperties``
  with ``properties`` or with more than one pattern: keys matching two of them need not
  satisfy both schemas;
- a constraint beside ``$ref``, ``allOf``, ``anyOf``, ``oneOf``, ``const`` or ``enum`` (say
  ``maxLength`` beside a ``$ref``, or two of them together): xgrammar generates that one
  and drops the rest; annotations (``title``, ``description``, ``default``, ``x-...``),
  ``$defs`` and a ``type`` that every ``const``/``enum`` value has are fine;
- ``oneOf`` whose branches are not provably disjoint: xgrammar generates any branch
  (``anyOf``), so a value matching two would be invalid. Branches are disjoint when their
  types cannot overlap (``string`` and ``integer``; ``integer`` and ``number`` overlap),
  or when both are objects requiring a property whose ``const``/``enum`` values differ, as
  in pydantic's discriminated unions.

The JSON schemas inside a structural tag are compiled by the same converter, so they are
checked the same way (:func:`tag_unenforced`): each ``structures[i].schema`` of vLLM's
legacy form, and each ``json_schema`` of a ``format`` node that has one (``json_schema``,
``qwen_xml_parameter``), wherever it is nested. llguidance takes no structural tag in
xgrammar's terms, so there such a schema is refused, never routed.

Example::

    unenforced({"type": "array", "uniqueItems": True})
    # "'uniqueItems' at # is not enforced by the grammar (xgrammar drops it: ...)"
    tag_unenforced('{"type": "structural_tag", "triggers": ["<f"], "structures": '
                   '[{"begin": "<f>", "schema": {"not": {}}, "end": "</f>"}]}')
    # ("structures[0].schema", "'not' at # is not enforced by the grammar (...)")
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import unquote

__all__ = ["tag_schemas", "tag_unenforced", "unenforced"]

#: Keywords whose value is a map of names to subschemas.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords whose value is a subschema.
_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "contains",
        "not", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
#: Keywords whose value is a list of subschemas.
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")

#: Keywords dropped by xgrammar, and why a client should not rely on them here.
_DROPPED = {
    "not": "negation",
    "if": "conditional subschemas",
    "dependentRequired": "dependencies between properties",
    "dependentSchemas": "dependencies between properties",
    "dependencies": "dependencies between properties",
    "contains": "constraints on some of an array's items",
    "minContains": "constraints on some of an array's items",
    "maxContains": "constraints on some of an array's items",
}
#: Formats JSON Schema defines that xgrammar does not implement.
_UNIMPLEMENTED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
#: Formats whose strings xgrammar never writes empty.
_NONEMPTY_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6",
                               "hostname", "uuid", "uri"})
_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")
#: Keywords after which xgrammar drops the rest of a schema's constraints.
_ALTERNATIVES = ("$ref", "allOf", "anyOf", "oneOf", "const", "enum")
#: Keywords that constrain nothing (annotations, definitions).
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                          "deprecated", "readOnly", "writeOnly", "discriminator", "nullable",
                          "$schema", "$id", "$defs", "definitions"})
_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})


def _message(keyword: str, path: str, why: str) -> str:
    return f"'{keyword}' at {path} is not enforced by the grammar ({why})"


def unenforced(schema) -> str | None:
    """The first keyword of ``schema`` the grammar would not enforce, as a message naming it
    and its place (None: all are enforced). See the module docstring."""
    try:
        return _walk(schema, schema, "#")
    except RecursionError:
        return None  # too deep to walk: the reference check refuses such schemas first


#: The structural tag ``format`` nodes that hold a JSON schema (under ``json_schema``).
_SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")


def tag_schemas(tag) -> Iterator[tuple[str, object]]:
    """Each JSON schema of a structural tag (its parsed JSON), with where it is in the tag
    (``structures[0].schema``, ``format.tags[1].content.json_schema``)."""
    if not isinstance(tag, dict):
        return
    structures = tag.get("structures")
    if isinstance(structures, list):
        for i, item in enumerate(structures):
            if isinstance(item, dict):
                yield f"structures[{i}].schema", item.get("schema")
    stack: list[tuple[str, object]] = [("format", tag.get("format"))]
    while stack:  # (a loop, not recursion: a tag's nesting is the client's)
        path, node = stack.pop()
        if isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            if node.get("type") in _SCHEMA_FORMATS and "json_schema" in node:
                yield f"{path}.json_schema", node["json_schema"]
                continue
            stack.extend((f"{path}.{k}", v) for k, v in reversed(list(node.items())))


def tag_unenforced(text) -> tuple[str, str] | None:
    """The first schema of a structural tag (its JSON text) with a keyword the grammar
    would not enforce: (where it is in the tag, :func:`unenforced`'s message); None when
    every keyword is enforced (or the text is not JSON: the compiler refuses it)."""
    try:
        tag = json.loads(text)
    except (TypeError, ValueError):
        return None
    for where, schema in tag_schemas(tag):
        problem = unenforced(schema)
        if problem:
            return where, problem
    return None


def _walk(root, node, path: str) -> str | None:
    if not isinstance(node, dict):
        return None
    problem = _own(root, node, path)
    if problem:
        return problem
    for key in _MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                found = _walk(root, value, f"{path}/{key}/{name}")
                if found:
                    return found
    for key in _ONE:
        found = _walk(root, node.get(key), f"{path}/{key}")
        if found:
            return found
    for key in _LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                found = _walk(root, value, f"{path}/{key}/{i}")
                if found:
                    return found
    return None


def _own(root, node: dict, path: str) -> str | None:
    """What the grammar would drop of ``node``'s own keywords."""
    ways = [k for k in _ALTERNATIVES if k in node]
    if ways:
        beside = sorted(k for k in node if k not in _ANNOTATIONS and not k.startswith("x-")
                        and not (k == "type" and _fits_type(node)))
        if len(beside) > 1 or beside and beside[0] != ways[0]:
            extra = next(k for k in beside if k != ways[0])
            return _message(extra, path, f"xgrammar drops the keywords beside '{ways[0]}'; "
                            "move them into each branch or the definition")
    for keyword, why in _DROPPED.items():
        if node.get(keyword) not in (None, {}, []):
            return _message(keyword, path, f"xgrammar drops {why}")
    if node.get("uniqueItems") is True:
        return _message("uniqueItems", path, "xgrammar drops it: items may repeat")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return _message("allOf", path, "xgrammar takes an 'allOf' of one schema only; "
                        "merge them into one")
    if "multipleOf" in node:
        step = node["multipleOf"]
        integral = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
        if _types(node) != {"integer"} or not integral:
            return _message("multipleOf", path, "xgrammar enforces it on integers by an "
                            "integer only ('type': 'integer')")
    # pydantic's AnyUrl says {"format": "uri", "minLength": 1}: a bound every string of the
    # format meets needs no enforcing
    implied = node.get("format") in _NONEMPTY_FORMATS and "pattern" not in node \
        and isinstance(node.get("minLength"), int) and node["minLength"] <= 1
    bounded = "maxLength" in node or ("minLength" in node and not implied)
    for keyword in ("pattern", "format"):
        if keyword in node and bounded:
            return _message("maxLength" if "maxLength" in node else "minLength", path,
                            f"xgrammar drops length bounds on a string with a '{keyword}'")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and any(a in pattern for a in _LOOKAROUNDS):
        return _message("pattern", path, "xgrammar ignores lookaheads in a pattern")
    if node.get("format") in _UNIMPLEMENTED_FORMATS:
        return _message("format", path, f"xgrammar does not implement {node['format']!r}")
    names, patterns = "propertyNames" in node, node.get("patternProperties")
    if names and ("properties" in node or patterns):
        return _message("propertyNames", path, "xgrammar drops it beside 'properties' or "
                        "'patternProperties'")
    if isinstance(patterns, dict) and (len(patterns) > 1 or "properties" in node):
        return _message("patternProperties", path, "xgrammar takes one pattern and no "
                        "'properties' beside it (a key matching two need not satisfy both)")
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1:
        branches = [_resolve(root, b) for b in one_of]
        for i in range(len(branches)):
            for j in range(i):
                if not _disjoint(root, branches[i], branches[j]):
                    return _message("oneOf", path, f"branches {j} and {i} may both match, "
                                    "and xgrammar generates either ('anyOf'); make them "
                                    "disjoint (a 'const' discriminator) or use 'anyOf'")
    return None


def _fits_type(node: dict) -> bool:
    """Whether ``node``'s ``type`` allows every value of its ``const`` or ``enum`` (so the
    grammar, which writes those values, needs no ``type``)."""
    allowed, values = _types({"type": node.get("type")}), _types({k: node[k] for k in (
        "const", "enum") if k in node})
    if allowed is None or values is None:
        return False
    return values <= (allowed | ({"integer"} if "number" in allowed else set()))


def _resolve(root, node, depth: int = 0):
    """``node`` with a local ``$ref`` followed (up to a few hops)."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < 16:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target = root
        for token in ref[2:].split("/") if ref != "#" else ():
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or token not in target:
                return node
            target = target[token]
        node, depth = target, depth + 1
    return node


def _value_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _types(node) -> set[str] | None:
    """The JSON types ``node`` allows (None: any, as far as this check can tell)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {_value_type(node["const"])}
    if isinstance(node.get("enum"), list):
        return {_value_type(v) for v in node["enum"]}
    kind = node.get("type")
    if isinstance(kind, str) and kind in _JSON_TYPES:
        return {kind}
    if isinstance(kind, list) and kind and all(k in _JSON_TYPES for k in kind):
        return set(kind)
    if "properties" in node or "required" in node:
        return {"object"}
    return None


def _values(node) -> set[str] | None:
    """The values a property's schema allows, when it lists them (``const``, ``enum``)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {json.dumps(node["const"], sort_keys=True)}
    if isinstance(node.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in node["enum"]}
    return None


def _disjoint(root, a, b) -> bool:
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None:
        # an integer is a number too
        wa = ta | ({"integer"} if "number" in ta else set())
        wb = tb | ({"integer"} if "number" in tb else set())
        if not wa & wb:
            return True
        if (va := _values(a)) is not None and (vb := _values(b)) is not None:
            return not va & vb
    if ta == {"object"} and tb == {"object"}:
        required = set(a.get("required") or ()) & set(b.get("required") or ())
        props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
        for name in required:
            va = _values(_resolve(root, props_a.get(name)))
            vb = _values(_resolve(root, props_b.get(name)))
            if va is not None and vb is not None and not va & vb:
                return True
    return False
