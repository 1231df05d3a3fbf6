"""What structured output refuses, rewrites and bounds in a JSON schema (pagedserve.gateway.schema_support,
pagedserve.gateway.schema_bounds, pagedserve.gateway.structured.prepare): each refusal stands on a probe showing
that the grammar engine accepts an output the keyword forbids (so a newer xgrammar that
enforces it fails the probe, and the refusal can go); rewrites are equivalent; bounds only
narrow; the JSONSchemaBench sample keeps compiling."""
import json
import os

import jsonschema
import pytest

from pagedserve.gateway import schema_bounds, schema_support, structured
from pagedserve.gateway.schema_walk import walk

xgr = pytest.importorskip("xgrammar")
SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "jsonschemabench", "sample.jsonl")


def engine_accepts(schema: dict, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), text)


# (keyword refused, schema, an output the engine accepts that the schema forbids)
IGNORED = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ("multipleOf", {"type": "number", "multipleOf": 1}, "1.5"),
    ("not", {"type": "integer", "not": {"const": 1}}, "1"),
    ("if", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("pattern", {"type": "string", "pattern": "^(?!a)[a-z]+$"}, '"ab"'),
    ("maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"'),
    ("format", {"type": "string", "format": "regex"}, '"(("'),
    ("maxLength", {"anyOf": [{"maxLength": 2}, {"type": "integer"}]}, '"abc"'),
]


@pytest.mark.parametrize("keyword,schema,violating", IGNORED, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(IGNORED)])
def test_each_refusal_is_a_keyword_the_engine_does_not_enforce(keyword, schema, violating):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(violating), schema, format_checker=jsonschema.FormatChecker())
    assert engine_accepts(schema, violating)  # the probe: if this fails, xgrammar learned it
    with pytest.raises(ValueError) as e:
        structured.prepare("json_schema", json.dumps(schema))
    assert keyword in str(e.value)


def test_refused_through_the_openai_body_names_the_keyword_and_param():
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": IGNORED[0][1]}}}
    with pytest.raises(structured.GuidedError) as e:
        structured.from_openai(body)
    assert e.value.param == "response_format" and "uniqueItems" in str(e.value) and "#" in str(e.value)


def test_a_required_property_that_properties_lacks_is_declared():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
              "additionalProperties": {"type": "string"}}
    assert engine_accepts(schema, '{"a": 1}')  # the engine drops b: why the rewrite exists
    fixed = schema_support.normalize(schema)
    assert fixed["properties"]["b"] == {"type": "string"}
    assert not engine_accepts(fixed, '{"a": 1}') and engine_accepts(fixed, '{"a": 1, "b": "x"}')
    with pytest.raises(schema_support.UnsupportedKeyword, match="additionalProperties"):
        schema_support.normalize({**schema, "additionalProperties": False})


def test_draft4_forms_are_rewritten_to_equivalents():
    s = schema_support.normalize({"type": "array", "items": [{"type": "integer", "minimum": 5, "exclusiveMinimum": True}],
                                  "additionalItems": {"type": "string"}})
    assert s == {"type": "array", "prefixItems": [{"type": "integer", "exclusiveMinimum": 5}],
                 "items": {"type": "string"}}
    assert not engine_accepts(s, "[5]") and engine_accepts(s, '[6, "x"]')


# (schema the engine misreads as written, an output it then accepts that the schema forbids,
#  an output the schema allows): pagedserve.gateway.schema_rewrite makes each exact
REWRITTEN = [
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1", "6"),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5}, "1", "6"),
    ({"type": "string", "anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]}, "5", '"ab"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "oneOf": [{"properties": {"a": {"const": 1}}}, {"properties": {"a": {"const": 2}}}]}, '{"a": 3}', '{"a": 2}'),
    ({"type": "object", "properties": {"k": {"enum": ["x", "y", "z"]}, "n": {"type": "integer"}},
      "additionalProperties": False, "if": {"properties": {"k": {"const": "x"}}},
      "then": {"required": ["n"]}, "else": {"properties": {"n": {"type": "null"}}}},
     '{"k": "x"}', '{"k": "y"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["c"],
      "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, '{"a": 1, "b": 2, "c": {}}', '{"a": 1, "c": {}}'),
]


@pytest.mark.parametrize("schema,violating,valid", REWRITTEN, ids=[str(i) for i in range(len(REWRITTEN))])
def test_rewritten_forms_are_enforced_exactly(schema, violating, valid):
    jsonschema.validate(json.loads(valid), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(violating), schema)
    fixed = json.loads(structured.prepare("json_schema", json.dumps(schema)))
    assert not engine_accepts(fixed, violating) and engine_accepts(fixed, valid)
    for _, node in walk(fixed):  # the rewritten schema forbids nothing the original allows it to write
        assert not {"allOf", "if", "then", "else"} & set(node)


def test_a_rewrite_that_can_never_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="can never hold"):
        structured.prepare("json_schema", json.dumps({"allOf": [{"type": "integer"}, {"type": "string"}]}))


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    {"oneOf": [{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/b"}], "$defs": {"s": {"type": "string"}, "b": {"type": "boolean"}}},
    {"oneOf": [{"enum": ["a"]}, {"enum": ["b"]}]},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"type": "object", "properties": {"k": {"enum": ["b", "c"]}, "x": {"type": "integer"}}, "required": ["k"]}]},
    {"allOf": [{"type": "integer"}], "description": "one schema and annotations"},
    {"type": "string", "format": "int32"},  # not a JSON Schema format: an annotation
])
def test_exact_forms_are_accepted(schema):
    structured.prepare("json_schema", json.dumps(schema))


def only_narrowed(original, bounded) -> bool:
    """`bounded` is `original` with assertion keywords added, never changed or removed."""
    if isinstance(original, dict):
        return isinstance(bounded, dict) and all(k in bounded and only_narrowed(v, bounded[k])
                                                 for k, v in original.items()) and all(
            k in ("maxLength", "maxItems", "maxProperties", "minimum", "maximum") for k in bounded if k not in original)
    if isinstance(original, list):
        return isinstance(bounded, list) and len(original) == len(bounded) and all(
            only_narrowed(a, b) for a, b in zip(original, bounded))
    return original == bounded


def test_bounds_only_narrow_and_stay_satisfiable():
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 100}, "a": {"type": "array", "minItems": 9, "items": {"type": "number"}},
        "n": {"type": "integer", "minimum": 10 ** 12}, "o": {"type": "object", "additionalProperties": True},
        "p": {"type": "string", "pattern": "^x+$"}}}
    b = schema_bounds.bound(schema)
    assert only_narrowed(schema, b)
    p = b["properties"]
    assert p["s"]["maxLength"] == 100 and p["a"]["maxItems"] == 9 and p["n"]["maximum"] == 10 ** 12
    assert p["o"]["maxProperties"] == schema_bounds.MAX_EXTRA_KEYS and "maxLength" not in p["p"]
    assert p["a"]["items"]["maximum"] == schema_bounds.MAX_NUMBER


def sample():
    if not os.path.exists(SAMPLE):
        pytest.skip(f"no JSONSchemaBench sample at {SAMPLE}")
    with open(SAMPLE) as f:
        return [json.loads(line) for line in f]


def test_the_sample_is_bounded_without_widening_and_compiles():
    accepted = 0
    for row in sample():
        try:
            schema = schema_support.normalize(row["schema"])
            schema_support.check(schema)
        except schema_support.UnsupportedKeyword:
            continue
        bounded = schema_bounds.bound(schema)
        assert only_narrowed(schema, bounded), row["source"]
        spec = structured.prepare("json_schema", json.dumps(row["schema"]))
        assert json.loads(spec) == bounded
        accepted += 1
        for _, node in walk(bounded):
            if node.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(node):
                assert "maxLength" in node, row["source"]
    assert accepted >= 78  # of 80; refused: multipleOf on a number, uniqueItems on strings
