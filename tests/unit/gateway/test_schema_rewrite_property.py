"""The structured-output rewrites (pagedserve.gateway.schema_rewrite) accept only values the original
schema accepts, as the grammar engine writes them (strict: an object holds only the
properties its schema declares unless additionalProperties says otherwise): hypothesis
draws schemas with keywords beside combinators, allOf, $ref and if/then/else, and values;
any value the rewritten schema accepts strictly must be valid under the original."""
import copy
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.gateway import schema_support
from pagedserve.gateway.schema_walk import walk

KEYS = ("a", "b", "k")
LEAF = st.sampled_from([{"type": "integer"}, {"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 0},
                        {"type": "integer", "minimum": 1}, {"type": "integer", "maximum": -1},
                        {"type": "string"}, {"type": "null"}, {"enum": ["x", "y", "z"]}, {"const": "x"},
                        {"$ref": "#/$defs/n"}, {"type": ["integer", "null"]}])


@st.composite
def objects(draw, depth: int = 0) -> dict:
    node = {}
    if draw(st.booleans()):
        node["type"] = "object"
    props = draw(st.dictionaries(st.sampled_from(KEYS), LEAF, max_size=3))
    if props or draw(st.booleans()):
        node["properties"] = props
    if draw(st.booleans()):
        node["required"] = draw(st.lists(st.sampled_from(KEYS), max_size=2, unique=True))
    if draw(st.booleans()):
        node["additionalProperties"] = draw(st.sampled_from([False, True, {"type": "integer"}]))
    if depth < 2:
        kind = draw(st.sampled_from(["", "anyOf", "oneOf", "allOf", "allOf", "ref", "if", "if"]))
        if kind in ("anyOf", "oneOf", "allOf"):
            node[kind] = draw(st.lists(objects(depth + 1), min_size=1, max_size=3))
        elif kind == "ref":
            node["$ref"] = "#/$defs/o"
        elif kind == "if":
            node["properties"] = {**node.get("properties", {}), "k": {"enum": ["x", "y", "z"]}}
            node["if"] = {"properties": {"k": draw(st.sampled_from([{"const": "x"}, {"enum": ["x", "y"]}]))}}
            node["then"] = draw(objects(depth + 1))
            if draw(st.booleans()):
                node["else"] = draw(objects(depth + 1))
    return node


VALUES = st.dictionaries(st.sampled_from(KEYS + ("c",)),
                         st.one_of(st.integers(-2, 2), st.sampled_from(["x", "y", "w"]), st.none()), max_size=4)


def strict(schema: dict) -> dict:
    """The schema as the engine writes it: no undeclared property where additionalProperties is unset."""
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        if ("properties" in node or node.get("type") == "object") and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return schema


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(root=objects(), value=VALUES)
def test_a_rewritten_schema_accepts_only_what_the_original_accepts(root, value):
    original = {**root, "$defs": {"n": {"type": "integer", "minimum": -1}, "o": {"type": "object",
                                                                               "properties": {"a": {"type": "integer"}}}}}
    try:
        fixed = schema_support.normalize(original)
        schema_support.check(fixed)
    except schema_support.UnsupportedKeyword:
        return  # refused: nothing is enforced less
    if jsonschema.Draft202012Validator(strict(fixed)).is_valid(value):
        assert jsonschema.Draft202012Validator(original).is_valid(value), json.dumps(fixed)


def test_the_generator_reaches_the_rewrites():
    """Guard: the property above is not vacuous (some drawn schemas are rewritten and accepted)."""
    rewritten = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}
    fixed = schema_support.normalize(rewritten)
    schema_support.check(fixed)
    assert "allOf" not in fixed and fixed["required"] == ["a"]
    with pytest.raises(AssertionError):
        assert jsonschema.Draft202012Validator(strict(fixed)).is_valid({"b": 1})


@pytest.mark.parametrize("a,b,merged", [
    ({"type": "integer", "minimum": 0}, {"minimum": 1, "maximum": 5}, {"type": "integer", "minimum": 1, "maximum": 5}),
    ({"type": "number", "maximum": 3}, {"type": "integer", "maximum": 2}, {"type": "integer", "maximum": 2}),
    ({"enum": ["x", "y"]}, {"enum": ["y", "z"]}, {"enum": ["y"]}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     {"type": "object", "properties": {"b": {"type": "integer"}}},
     {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}),
])
def test_merge_takes_the_tighter_of_each_bound(a, b, merged):
    assert schema_support.normalize({"allOf": [a, b]}) == merged
