"""server.engines.transformers.schema_check: the JSON Schema keywords xgrammar would drop are found
(issue 29 item 7; bench/schema_validity.py found each in answers that did not validate),
and what it enforces passes. Sans-IO: no model, no xgrammar."""

from __future__ import annotations

import pytest

from server.engines.transformers.schema_check import unenforced

S = {"type": "string"}


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


REFUSED = [
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, "uniqueItems", "#"),
    (obj(c={"type": "array", "contains": {"const": 3}}), "contains", "#/properties/c"),
    (obj(n={"not": S}), "not", "#/properties/n"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if", "#"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#"),
    ({"allOf": [obj(a=S), {"required": ["b"]}]}, "allOf", "#"),
    (obj(m={"type": "number", "multipleOf": 0.5}), "multipleOf", "#/properties/m"),
    (obj(m={"type": "integer", "multipleOf": 2.5}), "multipleOf", "#/properties/m"),
    (obj(s={"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}), "maxLength", "#/properties/s"),
    (obj(u={"type": "string", "format": "uri", "minLength": 2}), "minLength", "#/properties/u"),
    (obj(u={"type": "string", "format": "json-pointer", "minLength": 1}), "minLength",
     "#/properties/u"),
    (obj(s={"type": "string", "pattern": "^(?=.*\\d)\\w{4}$"}), "pattern", "#/properties/s"),
    (obj(r={"type": "string", "format": "regex"}), "format", "#/properties/r"),
    ({"type": "object", "patternProperties": {"^a": S, "^ab": {"type": "integer"}}},
     "patternProperties", "#"),
    ({"type": "object", "properties": {"a": S}, "propertyNames": {"maxLength": 2}},
     "propertyNames", "#"),
    (obj(v={"oneOf": [{"type": "number"}, {"type": "integer"}]}), "oneOf", "#/properties/v"),
    ({"$defs": {"S": S}, **obj(s={"$ref": "#/$defs/S", "maxLength": 3})},
     "maxLength", "#/properties/s"),
    (obj(v={"anyOf": [S, {"type": "null"}], "minLength": 2}), "minLength", "#/properties/v"),
    (obj(e={"type": "string", "enum": ["a", 1]}), "type", "#/properties/e"),
    # in a definition, and deep inside a list
    ({"$defs": {"T": {"type": "array", "uniqueItems": True}}, "type": "integer"},
     "uniqueItems", "#/$defs/T"),
    (obj(a={"type": "array", "prefixItems": [{"not": S}]}), "not", "#/properties/a/prefixItems/0"),
]


@pytest.mark.parametrize("schema, keyword, where", REFUSED)
def test_dropped_keywords_are_named_with_their_place(schema, keyword, where):
    message = unenforced(schema)
    assert message is not None and message.startswith(f"'{keyword}' at {where} is not enforced")


ACCEPTED = [
    {},
    obj(a=S, b={"type": ["integer", "null"]}, c={"anyOf": [S, {"type": "null"}], "default": None,
                                                "title": "C", "description": "nullable"}),
    obj(i={"type": "integer", "multipleOf": 5, "minimum": 0}, s={"type": "string", "maxLength": 3},
        p={"type": "string", "pattern": "^[A-Z]{2}$"}, f={"type": "string", "format": "date"}),
    obj(pw={"type": "string", "format": "password"}),  # an annotation (pydantic's SecretStr)
    obj(url={"type": "string", "format": "uri", "minLength": 1}),  # pydantic's AnyUrl: met
    obj(e={"type": "string", "enum": ["a", "b"]}, k={"const": 3, "type": "number"}),
    {"type": "array", "items": S, "uniqueItems": False, "minItems": 1},
    {"allOf": [{"$ref": "#/$defs/A"}], "description": "an A", "$defs": {"A": obj(x=S)}},
    # pydantic's discriminated union: the branches differ in a required const
    {"$defs": {"Cat": obj(t={"const": "cat", "type": "string"}, m={"type": "integer"}),
               "Dog": obj(t={"enum": ["dog"]}, b={"type": "number"})},
     **obj(pet={"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                "discriminator": {"propertyName": "t"}})},
    obj(v={"oneOf": [S, {"type": "integer"}, {"type": "boolean"}]}),
    {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
     "additionalProperties": False},
    {"$defs": {"N": obj(v={"type": "integer"}, next={"anyOf": [{"$ref": "#/$defs/N"},
                                                              {"type": "null"}]})},
     "$ref": "#/$defs/N", "x-vendor": 1},
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_what_the_grammar_enforces_is_accepted(schema):
    assert unenforced(schema) is None
