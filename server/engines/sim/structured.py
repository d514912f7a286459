"""The sim engine's structured output: an instance of a JSON schema, built rather than
sampled. Sans-IO.

The sim has no model to constrain. For a ``response_format`` (and the grammar of a forced
or optional tool call, which is one: :mod:`server.openai.tools`) it writes the smallest
instance of the schema it can build simply: the required properties only, ``minItems``
items, ``minLength`` characters, the number in range nearest 0, ``false``, ``null``. The
choices a model would make are drawn with the request's generator (``pick(n)``, an index
below ``n``): an ``anyOf``/``oneOf`` branch (the next one it can build when it cannot
build that one), an ``enum`` value. So seeds vary them, and
``tool_choice: auto`` with a JSON format (the union of the calls and the document) gives
calls for some seeds and the document for others.

A schema it cannot build so is refused (:class:`Unbuildable`, its reason naming the
keyword): ``pattern``, a ``format`` outside a few common ones, ``not``, ``allOf`` of more
than one schema, ``if``, ``patternProperties``, ``uniqueItems`` over equal items, bounds
that leave nothing, and schemas nested or recursing past :data:`MAX_DEPTH` (or costing
more than :data:`MAX_VISITS` steps).

Example::

    instance({"type": "object", "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 3}}}, pick)   # {"n": 3}
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from urllib.parse import unquote

__all__ = ["MAX_DEPTH", "MAX_VISITS", "Unbuildable", "instance"]

#: How deep the sim follows a schema (nesting and references together).
MAX_DEPTH = 64
#: How many subschemas the sim visits for one instance at most (``anyOf`` branches it
#: cannot build are tried again elsewhere: without a bound, nested ones are exponential).
MAX_VISITS = 10_000

#: Keywords that constrain an instance in ways the sim does not build.
_UNBUILT = ("pattern", "not", "if", "then", "else", "patternProperties", "propertyNames",
            "dependentRequired", "dependentSchemas", "dependencies", "contains",
            "$dynamicRef", "$recursiveRef")
#: A valid string of each ``format`` the sim writes.
_FORMATS = {
    "date-time": "1970-01-01T00:00:00Z", "date": "1970-01-01", "time": "00:00:00Z",
    "duration": "P0D", "email": "a@example.com", "hostname": "example.com",
    "ipv4": "0.0.0.0", "ipv6": "::", "uri": "http://example.com",
    "uuid": "00000000-0000-0000-0000-000000000000",
}


class Unbuildable(ValueError):
    """The sim cannot build an instance of this schema (the message says why)."""


def instance(schema: object, pick: Callable[[int], int]) -> object:
    """An instance of JSON ``schema`` (see the module docstring); :class:`Unbuildable`
    when the sim cannot build one simply."""
    return _Builder(schema, pick).build(schema, 0)


class _Builder:
    __slots__ = ("root", "pick", "visits")

    def __init__(self, root: object, pick: Callable[[int], int]) -> None:
        self.root = root
        self.pick = pick
        self.visits = 0

    def build(self, schema: object, depth: int) -> object:
        if depth > MAX_DEPTH:
            raise Unbuildable(f"the schema nests or recurses deeper than {MAX_DEPTH} levels")
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise Unbuildable(f"the schema needs more than {MAX_VISITS} steps to build")
        if schema is True:
            return {}
        if not isinstance(schema, dict):
            raise Unbuildable("a schema that no value satisfies (false)")
        for key in _UNBUILT:
            if key in schema:
                raise Unbuildable(f"the sim engine does not write instances of '{key}'")
        if "$ref" in schema:
            return self.build(self._resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise Unbuildable("an empty 'enum'")
            return values[self.pick(len(values))]
        for key in ("anyOf", "oneOf"):
            if key in schema:
                branches = schema[key]
                if not isinstance(branches, list) or not branches:
                    raise Unbuildable(f"an empty '{key}'")
                first = self.pick(len(branches))
                failed: Unbuildable | None = None
                for i in range(len(branches)):  # the drawn branch, else the next buildable
                    try:
                        return self.build(branches[(first + i) % len(branches)], depth + 1)
                    except Unbuildable as exc:
                        failed = failed or exc
                assert failed is not None
                raise failed
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise Unbuildable("the sim engine writes instances of an 'allOf' of one schema "
                                  "only")
            return self.build(parts[0], depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise Unbuildable("an empty 'type' list")
            kind = kind[0]
        if kind is None:
            kind = _implied_type(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            return _string(schema)
        if kind in ("integer", "number"):
            return _number(schema, kind == "integer")
        if kind == "boolean":
            return False
        if kind == "null":
            return None
        raise Unbuildable(f"an unknown type {kind!r}")

    def _resolve(self, ref: object) -> object:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise Unbuildable(f"'$ref' {ref!r} is not a JSON pointer into the schema")
        node = self.root
        for token in ref[2:].split("/") if ref != "#" else ():
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or token not in node:
                raise Unbuildable(f"'$ref' {ref!r} points to nothing in the schema")
            node = node[token]
        return node

    def _object(self, schema: dict, depth: int) -> dict:
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties", True)
        names = list(dict.fromkeys(schema.get("required") or ()))
        for name in properties:  # minProperties beyond the required: the first others
            if len(names) >= (schema.get("minProperties") or 0):
                break
            if name not in names:
                names.append(name)
        if len(names) < (schema.get("minProperties") or 0):
            raise Unbuildable("'minProperties' beyond the properties the schema names")
        if len(names) > schema.get("maxProperties", len(names)):
            raise Unbuildable("'maxProperties' below the required properties")
        out = {}
        for name in names:
            sub = properties[name] if name in properties else extra
            if sub is False:
                raise Unbuildable(f"the required property {name!r} is not allowed")
            out[name] = self.build(sub, depth + 1)
        return out

    def _array(self, schema: dict, depth: int) -> list:
        prefix = schema.get("prefixItems")
        items = schema.get("items", True)
        if isinstance(items, list):  # (draft 7's tuple form)
            prefix, items = items, schema.get("additionalItems", True)
        prefix = prefix or []
        n = max(schema.get("minItems") or 0, 0)
        if n > schema.get("maxItems", n):
            raise Unbuildable("'maxItems' below 'minItems'")
        out = [self.build(sub, depth + 1) for sub in prefix[:n]]
        while len(out) < n:
            if items is False:
                raise Unbuildable("'minItems' beyond the items the schema allows")
            out.append(self.build(items, depth + 1))
        if schema.get("uniqueItems") and len({_key(v) for v in out}) < len(out):
            raise Unbuildable("'uniqueItems' over items the sim engine writes alike")
        return out


def _implied_type(schema: dict) -> str:
    """The type a schema without ``type`` implies by its keywords (an object by default)."""
    if {"items", "prefixItems", "minItems", "maxItems"} & schema.keys():
        return "array"
    if {"minLength", "maxLength", "format"} & schema.keys():
        return "string"
    if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"} & schema.keys():
        return "number"
    return "object"


def _string(schema: dict) -> str:
    fmt = schema.get("format")
    if fmt is not None and fmt not in _FORMATS:
        raise Unbuildable(f"the sim engine does not write strings of 'format' {fmt!r}")
    low = schema.get("minLength") or 0
    text = _FORMATS[fmt] if fmt is not None else "x" * low
    if not low <= len(text) <= schema.get("maxLength", len(text)):
        raise Unbuildable("'minLength' and 'maxLength' that the sim engine's string misses")
    return text


def _number(schema: dict, integer: bool) -> int | float:
    bounds = {k: schema.get(k) for k in ("minimum", "exclusiveMinimum", "maximum",
                                         "exclusiveMaximum", "multipleOf")}
    if any(isinstance(v, bool) or not isinstance(v, (int, float, type(None)))
           for v in bounds.values()):
        raise Unbuildable("numeric bounds that are not numbers (draft 4's boolean "
                          "exclusive bounds are not supported)")
    low, low_ex, high, high_ex, step = bounds.values()
    value: int | float = 0
    if low is not None and value < low:
        value = low
    if low_ex is not None and value <= low_ex:
        value = math.floor(low_ex) + 1
    if high is not None and value > high:
        value = high
    if high_ex is not None and value >= high_ex:
        value = math.ceil(high_ex) - 1
    if integer or step is not None:
        value = math.ceil(value) if (low, low_ex) != (None, None) else math.floor(value)
    if step is not None:
        if step <= 0:
            raise Unbuildable("a 'multipleOf' that is not positive")
        value = math.ceil(value / step) * step
        value = int(value) if float(value).is_integer() else value
    fits = ((low is None or value >= low) and (low_ex is None or value > low_ex)
            and (high is None or value <= high) and (high_ex is None or value < high_ex))
    if not fits:
        raise Unbuildable("numeric bounds that the sim engine's number misses")
    return int(value) if integer else value


def _key(value: object) -> str:
    return json.dumps(value, sort_keys=True)
