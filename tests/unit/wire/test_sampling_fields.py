"""The field table (pagedserve.wire.sampling_fields): one set of defaults, ranges the proto carries, float
checks as float32, a length_penalty bound that keeps beam scores finite, and FieldError
naming the field (with its index in a list)."""
import math

import pytest

from pagedserve.wire import convert, sampling_fields
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.sampling_fields import FIELDS, REQUEST_FIELDS, FieldError, length_penalty_bound
from pagedserve.wire.v1 import generation_pb2 as pb
from google.protobuf.descriptor import FieldDescriptor as FD


def test_one_set_of_defaults_for_the_dataclass_and_the_proto():
    plain = SamplingParams()
    for name, f in FIELDS.items():
        assert getattr(plain, name) == (list(f.default) if f.kind is list else f.default), name
    assert convert.sampling_from_proto(pb.SamplingParams()) == plain
    plain.validate(2048)


TYPES = {FD.TYPE_INT32: "int32", FD.TYPE_UINT32: "uint32", FD.TYPE_UINT64: "uint64",
         FD.TYPE_FLOAT: "float", FD.TYPE_BOOL: "bool", FD.TYPE_STRING: "string"}
RANGES = {"int32": (-2 ** 31, 2 ** 31 - 1), "uint32": (0, 2 ** 32 - 1), "uint64": (0, 2 ** 64 - 1)}
ALL = {**FIELDS, **REQUEST_FIELDS}


def _descriptor(name):
    message = pb.SamplingParams if name in FIELDS else pb.GenerateRequest
    return message, message.DESCRIPTOR.fields_by_name[name]


@pytest.mark.parametrize("name", list(ALL))
def test_each_declaration_is_its_proto_field_and_within_its_type(name):
    f = ALL[name]
    message, fd = _descriptor(name)
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        key, value = (fd.message_type.fields_by_name[n].type for n in ("key", "value"))
        assert f.kind is dict and f.wire == f"map<{TYPES[key]}, {TYPES[value]}>"
        m = message(**{name: {RANGES[TYPES[key]][1]: f.high, 0: f.low}})
        assert type(m).FromString(m.SerializeToString()) == m
        return
    said = ("repeated " if fd.is_repeated else "optional " if fd.has_presence else "") + TYPES[fd.type]
    assert f.wire == said
    if f.kind is int or f.item is int:
        low, high = RANGES[TYPES[fd.type]]
        assert low <= f.low <= f.high <= high
        for value in (f.low, f.high):
            m = message(**{name: [value] if f.kind is list else value})
            assert type(m).FromString(m.SerializeToString()) == m
    assert f.optional == (fd.has_presence and f.default is None)


BAD = [
    ({"top_k": 2 ** 31}, "top_k", "between -1 and 2147483647"),
    ({"stop_token_ids": [1, 2 ** 40]}, "stop_token_ids[1]", "between 0 and 4294967295"),
    ({"stop": ["ok", "\ud800"]}, "stop[1]", "lone surrogate"),
    ({"guided_spec": "x\udfff"}, "guided_spec", "UTF-8"),
    ({"seed": 2 ** 64}, "seed", "9223372036854775807"),
    ({"seed": -1}, "seed", "between 0"),
    ({"n": 2 ** 32}, "n", "between 1 and 128"),
    ({"logprobs": 2 ** 32}, "logprobs", "between 0 and 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "between 0 and 20"),
    ({"max_tokens": 2 ** 32}, "max_tokens", "4294967295"),
    ({"beam_width": 11}, "beam_width", "between 1 and 10"),
    ({"top_p": 1e-46}, "top_p", "as a 32-bit float"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"temperature": 1e39}, "temperature", "finite 32-bit float"),
    ({"temperature": 101.0}, "temperature", "[0, 100]"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"repetition_penalty": 1e-3}, "repetition_penalty", "[0.01, 100]"),
    ({"repetition_penalty": 1e-46}, "repetition_penalty", "[0.01, 100]"),
    ({"presence_penalty": 10 ** 400}, "presence_penalty", "finite"),
    ({"length_penalty": 4e38}, "length_penalty", "finite 32-bit float"),
    ({"stop": ["s"] * 33}, "stop", "at most 32 items"),
    ({"stop": ["x" * 1025]}, "stop[0]", "at most 1024 characters"),
    ({"stop_token_ids": [1] * 129}, "stop_token_ids", "at most 128 items"),
    ({"guided_kind": "xml"}, "guided_kind", "one of json_schema"),
    ({"ignore_eos": 1}, "ignore_eos", "a boolean"),
    ({"top_k": 2.0}, "top_k", "an integer"),
    ({"temperature": "hot"}, "temperature", "a number"),
    ({"min_tokens": -1}, "min_tokens", "between 0 and 4294967295"),
    ({"min_tokens": 17}, "min_tokens", "at most max_tokens (16)"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5]", "[-100, 100]"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias[5]", "finite"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias[-1]", "token ids"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias['a']", "token ids"),
    ({"logit_bias": [1]}, "logit_bias", "an object"),
    ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "logit_bias", "at most 1024 entries"),
]


@pytest.mark.parametrize("fields,where,words", BAD)
def test_a_value_the_declaration_refuses_is_named(fields, where, words):
    with pytest.raises(FieldError) as e:
        SamplingParams(**fields).validate(2048)
    assert str(e.value).startswith(f"{where} must") and words in str(e.value), str(e.value)
    assert e.value.name + e.value.where == where


@pytest.mark.parametrize("fields", [
    {"top_p": 1e-40}, {"temperature": 1e-46}, {"temperature": 100}, {"top_k": -1}, {"top_k": 2 ** 31 - 1},
    {"seed": 2 ** 63 - 1}, {"stop_token_ids": [2 ** 32 - 1] * 128}, {"stop": ["x" * 1024] * 32},
    {"repetition_penalty": 0.01}, {"min_p": 1}, {"top_p": 1}])
def test_values_at_the_edges_are_accepted_and_travel(fields):
    sp = SamplingParams(**fields)
    sp.validate(2048)
    m = convert.sampling_to_proto(sp)
    assert type(m).FromString(m.SerializeToString()) == m


def test_the_request_fields():
    sampling_fields.check("priority", -2 ** 31)
    with pytest.raises(FieldError, match=r"^priority must be between -2147483648 and 2147483647"):
        sampling_fields.check("priority", 2 ** 31)
    with pytest.raises(FieldError, match=r"^cache_salt must be at most 1024 characters"):
        sampling_fields.check("cache_salt", "s" * 1025)


@pytest.mark.parametrize("max_model_len", [2, 16, 2048, 131072, 2 ** 32 - 1])
def test_length_penalty_bound_keeps_every_length_power_finite_and_nonzero(max_model_len):
    bound = length_penalty_bound(max_model_len)
    lengths = sorted({1, 2, 3, max_model_len // 2, max_model_len - 1, max_model_len} - {0})
    for lp in (bound, -bound):
        for length in (n for n in lengths if n <= max_model_len):
            scale = length ** lp
            assert 1e-155 < scale < 1e155, (length, lp)
            assert math.isfinite(-1e6 * max_model_len / scale)  # a beam's score over it
    past = bound + 0.1  # the bound is the largest at 0.1 steps
    assert max_model_len ** past > 1.3e154 and max_model_len ** -past < 1 / 1.3e154


def test_length_penalty_past_the_bound_is_refused_naming_it():
    SamplingParams(beam_width=2, length_penalty=46.5).validate(2048)
    for lp in (1000.0, -1000.0, 46.6):
        with pytest.raises(FieldError) as e:
            SamplingParams(beam_width=2, length_penalty=lp).validate(2048)
        assert str(e.value).startswith("length_penalty must be between -46.5 and 46.5")
        assert "2048" in str(e.value)
    SamplingParams(beam_width=2, length_penalty=1000.0).validate()  # no model: no bound
