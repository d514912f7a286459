"""A corpus of real-world JSON schemas, built offline from what is installed (for
``bench/schema_validity.py``).

Sources, each bounded (``per_source`` schemas of at most ``max_bytes`` of compact JSON,
taken in a fixed order so that a run is reproducible on the same installation):

* ``pydantic``: ``model_json_schema()`` of the pydantic models that installed packages
  ship: the openai SDK's types, MCP's protocol types, FastAPI's OpenAPI models, vLLM's
  OpenAI-server protocol models (what clients such as instructor, pydantic-ai or
  openai-agents send is exactly such a schema);
* ``dataclasses``: pydantic's schema of standard-library dataclasses shipped in packages
  (transformers' argument and output dataclasses, vLLM's configs), where pydantic can
  describe them;
* ``files``: schema files shipped in site-packages (any ``*.json`` with ``"$schema"``):
  Kubernetes' resource schemas (kubernetes-validate; their references into the shared
  ``_definitions.json`` are inlined under ``$defs``, as a client would send them), the
  JSON Schema metaschemas, setuptools' configuration schemas;
* ``handwritten``: the constructs clients send, one or a few each (``$defs``/``$ref``
  chains, recursion, ``anyOf``/``oneOf``, enums, ``const``, patterns, formats, length and
  item bounds, ``additionalProperties``, nullable fields, and keywords a grammar cannot
  enforce, which must be refused).

Duplicates (the same compact JSON with keys sorted) are kept once. Nothing is written to
disk; building takes a few seconds (most of it importing the packages).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
import sys
import warnings
from pathlib import Path

__all__ = ["SOURCES", "build_corpus", "HANDWRITTEN"]

SOURCES = ("handwritten", "pydantic", "dataclasses", "files")

#: Modules whose pydantic models are taken (packages are walked: every submodule).
PYDANTIC_MODULES = (
    "openai.types", "mcp.types", "fastapi.openapi.models",
    "vllm.entrypoints.openai.chat_completion.protocol",
)
#: The quick run's: small packages, quick to import.
QUICK_PYDANTIC_MODULES = ("mcp.types", "fastapi.openapi.models")
#: Modules whose dataclasses are taken.
DATACLASS_MODULES = (
    "transformers.training_args", "transformers.generation.configuration_utils",
    "transformers.modeling_outputs",
)


def _obj(props: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


_S = {"type": "string"}
_I = {"type": "integer"}

#: (id, schema): the constructs clients send, written for the bench.
HANDWRITTEN: list[tuple[str, dict]] = [
    ("flat", _obj({"name": _S, "age": _I, "ok": {"type": "boolean"}})),
    ("nullable_type_list", _obj({"a": {"type": ["string", "null"]}, "b": {"type": ["integer", "null"]}})),
    ("nullable_anyof", _obj({"a": {"anyOf": [_S, {"type": "null"}]},
                             "b": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None}})),
    ("enum_mixed", _obj({"e": {"enum": ["red", "green", 3, None, True]}})),
    ("enum_strings_special", _obj({"e": {"enum": ["a \"quoted\" word", "back\\slash", "tab\there",
                                                  "ünïcödé", "日本語", "emoji 🚀"]}})),
    ("const", _obj({"kind": {"const": "event"}, "v": {"const": 3}})),
    ("defs_chain", {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/C"},
                              "C": _obj({"x": _I})},
                    **_obj({"a": {"$ref": "#/$defs/A"}})}),
    ("definitions_old", {"definitions": {"Item": _obj({"id": _I, "tags": {"type": "array", "items": _S,
                                                                           "maxItems": 3}})},
                         **_obj({"items": {"type": "array", "items": {"$ref": "#/definitions/Item"},
                                           "maxItems": 3}})}),
    ("recursive_tree", {"$defs": {"Node": _obj({"v": _I, "children": {
        "type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Node"}}})},
        "$ref": "#/$defs/Node"}),
    ("recursive_root", _obj({"name": _S, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}})),
    ("anyof_objects", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "r": {"type": "number"}}),
        _obj({"kind": {"const": "rect"}, "w": {"type": "number"}, "h": {"type": "number"}})]}})),
    ("oneof_discriminated", {"$defs": {
        "Cat": _obj({"pet_type": {"const": "cat", "type": "string"}, "meows": _I}),
        "Dog": _obj({"pet_type": {"const": "dog", "type": "string"}, "barks": {"type": "number"}})},
        **_obj({"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                        "discriminator": {"propertyName": "pet_type"}}})}),
    ("oneof_types", _obj({"v": {"oneOf": [_S, _I, {"type": "boolean"}]}})),
    ("oneof_overlapping", _obj({"v": {"oneOf": [{"type": "number"}, {"type": "integer"}]}})),
    ("pattern_simple", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}})),
    ("pattern_unanchored", _obj({"s": {"type": "string", "pattern": "ab+c"}})),
    ("pattern_dot", _obj({"s": {"type": "string", "pattern": "^.{1,8}$"}})),
    ("pattern_negated_class", _obj({"s": {"type": "string", "pattern": "^[^a-z]{2,6}$"}})),
    ("pattern_escapes", _obj({"s": {"type": "string", "pattern": "^\\w+@\\d+\\.\\s?[\\\\/\"]$"}})),
    ("pattern_lookahead", _obj({"s": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}})),
    ("pattern_with_length", _obj({"s": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}})),
    ("format_date_time", _obj({"d": {"type": "string", "format": "date"},
                               "t": {"type": "string", "format": "time"},
                               "dt": {"type": "string", "format": "date-time"},
                               "du": {"type": "string", "format": "duration"}})),
    ("format_net", _obj({"e": {"type": "string", "format": "email"},
                         "h": {"type": "string", "format": "hostname"},
                         "i4": {"type": "string", "format": "ipv4"},
                         "i6": {"type": "string", "format": "ipv6"}})),
    ("format_email", _obj({"e": {"type": "string", "format": "email"}})),
    ("format_ids", _obj({"u": {"type": "string", "format": "uuid"},
                         "uri": {"type": "string", "format": "uri"},
                         "ref": {"type": "string", "format": "uri-reference"},
                         "ptr": {"type": "string", "format": "json-pointer"}})),
    ("format_unknown", _obj({"p": {"type": "string", "format": "password"},
                             "b": {"type": "string", "format": "binary"}})),
    ("format_with_length", _obj({"url": {"type": "string", "format": "uri", "minLength": 1,
                                         "maxLength": 2083}})),
    ("format_regex", _obj({"r": {"type": "string", "format": "regex"}})),
    ("string_lengths", _obj({"a": {"type": "string", "maxLength": 5},
                             "b": {"type": "string", "minLength": 2, "maxLength": 3},
                             "c": {"type": "string", "minLength": 1}})),
    ("array_bounds", _obj({"a": {"type": "array", "items": _I, "minItems": 1, "maxItems": 3},
                           "b": {"type": "array", "items": _S, "maxItems": 0}})),
    ("prefix_items", _obj({"p": {"type": "array", "prefixItems": [_I, _S], "items": False,
                                 "minItems": 2}})),
    ("unique_items", _obj({"u": {"type": "array", "items": {"enum": [1, 2, 3]},
                                 "uniqueItems": True, "maxItems": 3}})),
    ("contains", _obj({"c": {"type": "array", "items": _I, "contains": {"const": 3}}})),
    ("additional_props_schema", {"type": "object", "additionalProperties": {
        "type": "integer", "minimum": 0, "maximum": 9}, "maxProperties": 3}),
    ("additional_props_true", {"type": "object", "properties": {"a": _I}, "required": ["a"],
                               "additionalProperties": True}),
    ("pattern_properties", {"type": "object", "patternProperties": {"^x_": _I},
                            "additionalProperties": False}),
    ("min_max_properties", {"type": "object", "additionalProperties": _S,
                            "minProperties": 1, "maxProperties": 2}),
    ("numbers_bounds", _obj({"i": {"type": "integer", "minimum": -5, "maximum": 5},
                             "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
                             "big": {"type": "integer", "minimum": 1000000}})),
    ("multiple_of_int", _obj({"m": {"type": "integer", "multipleOf": 7}})),
    ("multiple_of_number", _obj({"m": {"type": "number", "multipleOf": 0.25}})),
    ("not", _obj({"n": {"not": {"type": "string"}}})),
    ("if_then_else", {"type": "object", "properties": {"a": _S, "b": _I},
                      "if": {"properties": {"a": {"const": "x"}}}, "then": {"required": ["b"]}}),
    ("all_of_merge", {"allOf": [_obj({"a": _I}, required=["a"]),
                                {"properties": {"b": _S}, "required": ["b"]}]}),
    ("all_of_single_ref", {"$defs": {"A": _obj({"x": _I})},
                           **_obj({"a": {"allOf": [{"$ref": "#/$defs/A"}], "description": "an A"}})}),
    ("dependent_required", {"type": "object", "properties": {"a": _I, "b": _I},
                            "dependentRequired": {"a": ["b"]}}),
    ("property_names", {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,4}$"},
                        "additionalProperties": _I, "maxProperties": 3}),
    ("ref_with_siblings", {"$defs": {"S": _S}, **_obj({"s": {"$ref": "#/$defs/S", "maxLength": 3}})}),
    ("root_array", {"type": "array", "items": _obj({"q": _S, "a": {"type": "boolean"}}),
                    "maxItems": 4}),
    ("root_string", {"type": "string", "maxLength": 12}),
    ("root_enum", {"enum": ["yes", "no", "maybe"]}),
    ("empty_schema", {}),
    ("deep_nesting", _obj({"a": _obj({"b": _obj({"c": _obj({"d": _obj({"e": {"type": "boolean"}})})})})})),
    ("optional_fields", {"type": "object", "properties": {"a": _S, "b": _I, "c": {"type": "boolean"}},
                         "required": ["a"], "additionalProperties": False}),
    ("tuple_items_draft7", {"type": "array", "items": [_I, _S], "additionalItems": False}),
]


def _canonical(schema) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _size(schema) -> int:
    return len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())


def _walk_modules(name: str):
    """The module ``name`` and, for a package, every submodule that imports."""
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - an optional package: absent or broken, skipped
        return
    yield mod
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), name + "."):
        if "._" in info.name or ".tests" in info.name:
            continue
        try:
            yield importlib.import_module(info.name)
        except Exception:  # noqa: BLE001
            continue


def _pydantic(modules=PYDANTIC_MODULES) -> list[tuple[str, dict]]:
    from pydantic import BaseModel

    out = []
    for root in modules:
        for mod in _walk_modules(root):
            for name, cls in sorted(vars(mod).items()):
                if (inspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == mod.__name__
                        and not getattr(cls, "__pydantic_generic_metadata__", {}).get("parameters")):
                    try:
                        out.append((f"{mod.__name__}.{name}", cls.model_json_schema()))
                    except Exception:  # noqa: BLE001 - a model pydantic cannot describe
                        continue
    return out


def _dataclasses() -> list[tuple[str, dict]]:
    from pydantic import TypeAdapter

    out = []
    for root in DATACLASS_MODULES:
        for mod in _walk_modules(root):
            for name, cls in sorted(vars(mod).items()):
                if inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == mod.__name__:
                    try:
                        out.append((f"{mod.__name__}.{name}", TypeAdapter(cls).json_schema()))
                    except Exception:  # noqa: BLE001
                        continue
    return out


def _site_packages() -> list[Path]:
    return [Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]


def _inline_k8s(schema: dict, defs: dict, max_bytes: int) -> dict | None:
    """A Kubernetes schema with its references into ``_definitions.json`` inlined under
    ``$defs`` (None when that grows past ``max_bytes``)."""
    prefix = "/api/_definitions.json#/$defs/"
    needed: dict = {}

    def fix(node):
        if isinstance(node, list):
            return [fix(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith((prefix, "#/$defs/")):
                name = v.rpartition("/")[2]
                out[k] = "#/$defs/" + name
                if name not in needed and name in defs:
                    needed[name] = None
                    needed[name] = fix(defs[name])
            elif k in ("enum", "const", "default", "examples"):
                out[k] = v
            else:
                out[k] = fix(v)
        return out

    try:
        body = fix({k: v for k, v in schema.items() if k not in ("$schema", "$id")})
    except RecursionError:
        return None
    if needed:
        body["$defs"] = needed
    return body if _size(body) <= max_bytes else None


def _files(max_bytes: int) -> list[tuple[str, dict]]:
    out = []
    for site in _site_packages():
        k8s = sorted((site / "kubernetes_validate" / "kubernetes-json-schema").glob("v*-local-strict"))
        if k8s:
            folder = k8s[-1]
            defs = json.loads((folder / "_definitions.json").read_text()).get("$defs", {})
            for path in sorted(folder.glob("*.json")):
                if path.name.startswith("_") or path.stat().st_size > 4 * max_bytes:
                    continue
                schema = _inline_k8s(json.loads(path.read_text()), defs, max_bytes)
                if schema is not None:
                    out.append((f"k8s/{folder.name}/{path.stem}", schema))
        for path in sorted(site.rglob("*.json")):
            if "kubernetes-json-schema" in path.parts or path.stat().st_size > max_bytes * 4:
                continue
            try:
                text = path.read_text()
                if '"$schema"' not in text:
                    continue
                schema = json.loads(text)
            except (OSError, ValueError):
                continue
            if isinstance(schema, dict) and ("type" in schema or "properties" in schema
                                             or "$ref" in schema or "$defs" in schema):
                out.append((str(path.relative_to(site)), schema))
    return out


def _spread(items: list, n: int) -> list:
    """At most ``n`` of ``items``, evenly spaced (a fixed, representative subset)."""
    if len(items) <= n:
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def build_corpus(*, per_source: int = 100, max_bytes: int = 8192, sources=SOURCES,
                 quick: bool = False) -> list[tuple[str, str, dict]]:
    """``[(source, id, schema), ...]``: up to ``per_source`` distinct schemas of each
    source, each of at most ``max_bytes`` of compact JSON (the handwritten ones all).
    ``quick``: pydantic models of small packages only (:data:`QUICK_PYDANTIC_MODULES`)."""
    seen: set[str] = set()
    corpus = []
    for source in sources:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if source == "handwritten":
                items = list(HANDWRITTEN)
            elif source == "pydantic":
                items = _pydantic(QUICK_PYDANTIC_MODULES if quick else PYDANTIC_MODULES)
            elif source == "dataclasses":
                items = _dataclasses()
            elif source == "files":
                items = _files(max_bytes)
            else:
                raise ValueError(f"unknown source {source!r}")
        fresh = []
        for sid, schema in items:
            key = _canonical(schema)
            if key in seen or (source != "handwritten" and _size(schema) > max_bytes):
                continue
            seen.add(key)
            fresh.append((source, sid, schema))
        corpus.extend(fresh if source == "handwritten" else _spread(fresh, per_source))
    return corpus


def main(argv=None) -> int:
    """Build the corpus, print how many schemas each source gave."""
    import argparse
    import collections

    from loadgen_lib import smoke  # (run as a script: bench/ is on the path)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-source", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="pydantic models of small packages only")
    args = smoke.parse_args(p, argv, per_source=5, quick=True)
    c = build_corpus(per_source=args.per_source, quick=args.quick)
    print(collections.Counter(s for s, _, _ in c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
