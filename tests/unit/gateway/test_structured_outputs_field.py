"""vLLM's structured_outputs field (pagedserve.gateway.structured): each constraint gives the same
(guided_kind, guided_spec) as its guided_* twin; options this server does not act on, unknown
keys, and two constraints at once are refused naming the field."""
import json

import pytest

from pagedserve.gateway import structured
from pagedserve.gateway.structured import GuidedError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TWINS = [
    ({"json": SCHEMA}, {"guided_json": SCHEMA}),
    ({"json": json.dumps(SCHEMA)}, {"guided_json": SCHEMA}),
    ({"regex": "[ab]+"}, {"guided_regex": "[ab]+"}),
    ({"choice": ["red", "green"]}, {"guided_choice": ["red", "green"]}),
    ({"grammar": 'root ::= "x" | "y"'}, {"guided_grammar": 'root ::= "x" | "y"'}),
    ({"json_object": True}, {"response_format": {"type": "json_object"}}),
]


@pytest.mark.parametrize("so,twin", TWINS)
def test_each_constraint_equals_its_guided_twin(so, twin):
    got = structured.from_openai({"structured_outputs": so})
    assert got[0] and got == structured.from_openai(twin)


def test_options_this_server_honours_are_accepted():
    so = {"choice": ["a", "b"], "disable_fallback": True, "disable_any_whitespace": False,
          "disable_additional_properties": False, "backend": "xgrammar"}
    assert structured.from_openai({"structured_outputs": so})[0] == "choice"
    assert structured.from_openai({"structured_outputs": {"json_object": False}}) == ("", "")


@pytest.mark.parametrize("body,param,words", [
    ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " *"}},
     "structured_outputs.whitespace_pattern", "leave it out"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties", "false"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml", "json, regex, choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "not"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "guided_regex", "give one of"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json", "JSON schema"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "boolean"),
    ({"structured_outputs": ["regex"]}, "structured_outputs", "an object"),
    ({"structured_outputs": {"structural_tag": {"triggers": []}}}, "structured_outputs.structural_tag",
     "structures"),
])
def test_what_is_not_honoured_is_refused_by_name(body, param, words):
    with pytest.raises(GuidedError) as e:
        structured.from_openai(body)
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_a_structural_tag_in_vllms_older_form_is_xgrammars_triggered_tags():
    old = {"type": "structural_tag", "triggers": ["<fn="],
           "structures": [{"begin": "<fn=get>", "schema": SCHEMA, "end": "</fn>"}]}
    kind, spec = structured.from_openai({"structured_outputs": {"structural_tag": json.dumps(old)}})
    assert kind == "structural_tag"
    fmt = json.loads(spec)["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<fn="]
    assert fmt["tags"] == [{"type": "tag", "begin": "<fn=get>", "end": "</fn>",
                            "content": {"type": "json_schema", "json_schema": SCHEMA}}]
    assert structured.from_openai({"response_format": old}) == (kind, spec)
    new = {"format": fmt}
    assert structured.from_openai({"structured_outputs": {"structural_tag": new}}) == (kind, spec)


def test_the_grpc_api_reads_a_structural_tag_in_either_form():
    from pagedserve.gateway.api_request import ApiError, sampling_from_proto
    from pagedserve.wire.v1 import generation_pb2 as pb

    old = {"structures": [{"begin": "<fn=get>", "schema": SCHEMA, "end": "</fn>"}], "triggers": ["<fn="]}
    sp = sampling_from_proto(pb.SamplingParams(guided_kind="structural_tag", guided_spec=json.dumps(old)))
    assert json.loads(sp.guided_spec)["format"]["type"] == "triggered_tags"
    with pytest.raises(ApiError, match="structures"):
        sampling_from_proto(pb.SamplingParams(guided_kind="structural_tag", guided_spec='{"triggers": []}'))
