"""Every request field declared once: its type on the wire, its range and its default.

`FIELDS` declares each SamplingParams field, `REQUEST_FIELDS` the request's own (priority,
cache_salt, request_id). SamplingParams takes its defaults from here and validates with `check`;
pagedserve.wire.convert takes the proto's defaults from here; the OpenAI API's request models
(pagedserve.gateway.openai.models) take their types and bounds from here. So both public APIs and the
messages between services agree on what a field may hold.

Ranges are those of the field's protobuf type (generation.proto) or narrower:
- integers fit their proto type (int32, uint32; seed a signed 64-bit integer, which also
  fits its uint64 and every place a seed goes: tracing attributes, torch);
- floats travel as float32: a value must be finite, and in range both as given and rounded
  to float32 (a top_p of 1e-46 is 0 as a float32). temperature is at most 100 (beyond it a
  distribution is as good as uniform; under 1e-5 it is greedy, so 1 / temperature never
  passes 1e5); repetition_penalty within [0.01, 100] (a logit is divided or multiplied by
  it: any logit below 3e36 stays finite in float32). length_penalty's bound depends on the
  model's maximum length: `length_penalty_bound`;
- strings are valid UTF-8 (no lone surrogate: protobuf cannot carry one); lists are bounded;
- a map (logit_bias) is from token ids (uint32; the model's vocabulary is the API's check) to
  values of its `item` type in its range, bounded in size.

`check(name, value)` raises FieldError ("<name>[i] must ..., got ...").
"""
from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass

MAX_BEAM_WIDTH = 10  # each beam asks for 2 * beam_width top logprobs, at most 20
GUIDED_KINDS = ("", "json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_N = 128  # completions per request (OpenAI's bound): each is a sequence the gateway holds
MAX_LOGPROBS = 20  # top logprobs per token (sampled or prompt)
MAX_STOP = 32  # stop strings, each matched against every new piece of text
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 128  # stop token ids, looked up for every sampled token
MAX_SALT_CHARS = 1024  # cache_salt: hashed into the key of every block of the prompt
MAX_REQUEST_ID_CHARS = 1024  # request_id: echoed in every response message (gRPC) and span
MAX_LOGIT_BIAS = 1024  # logit_bias entries, each added to its token's logit every step
FLOAT32_MAX = 3.4028234663852886e38
INT32 = (-2 ** 31, 2 ** 31 - 1)
UINT32 = (0, 2 ** 32 - 1)
INT64 = (0, 2 ** 63 - 1)
# length ** length_penalty stays within [1/R, R], R = sqrt(float64's largest) ~ 1.3e154, so a
# beam's score (a sum of logprobs, far smaller) divided by it is finite and comparable
_LN_SCORE_RANGE = math.log(sys.float_info.max) / 2


@dataclass(frozen=True)
class Field:
    name: str
    kind: type  # int, float, bool, str; list: a list of `item`; dict: token id -> `item`
    wire: str  # its protobuf type in generation.proto
    default: object
    low: float | None = None  # the range of a number, or of a list's numbers
    high: float | None = None
    low_open: bool = False  # low itself is refused
    optional: bool = False  # None (unset) is allowed
    item: type | None = None
    max_items: int | None = None
    max_chars: int | None = None  # each string's length
    choices: tuple = ()
    note: str = ""  # said after the range


def _f(name, kind, wire, default, low=None, high=None, **kw) -> Field:
    return Field(name, kind, wire, default, low, high, **kw)


FIELDS = {f.name: f for f in (
    _f("max_tokens", int, "optional uint32", 16, 1, UINT32[1]),
    _f("temperature", float, "optional float", 1.0, 0.0, 100.0, note=" (0: greedy)"),
    _f("top_p", float, "optional float", 1.0, 0.0, 1.0, low_open=True),
    _f("top_k", int, "int32", 0, -1, INT32[1], note=" (-1 or 0: off)"),
    _f("min_p", float, "float", 0.0, 0.0, 1.0),
    _f("repetition_penalty", float, "optional float", 1.0, 0.01, 100.0),
    _f("presence_penalty", float, "float", 0.0, -2.0, 2.0),
    _f("frequency_penalty", float, "float", 0.0, -2.0, 2.0),
    _f("seed", int, "optional uint64", None, *INT64, optional=True),
    _f("stop", list, "repeated string", (), item=str, max_items=MAX_STOP, max_chars=MAX_STOP_CHARS),
    _f("stop_token_ids", list, "repeated uint32", (), *UINT32, item=int, max_items=MAX_STOP_TOKEN_IDS),
    _f("ignore_eos", bool, "bool", False),
    _f("min_tokens", int, "uint32", 0, *UINT32, note=" (end-of-sequence and stop tokens masked until then)"),
    _f("logit_bias", dict, "map<uint32, float>", {}, -100.0, 100.0, item=float, max_items=MAX_LOGIT_BIAS),
    _f("logprobs", int, "optional uint32", None, 0, MAX_LOGPROBS, optional=True),
    _f("prompt_logprobs", int, "optional uint32", None, 0, MAX_LOGPROBS, optional=True),
    _f("n", int, "optional uint32", 1, 1, MAX_N),
    _f("beam_width", int, "uint32", 1, 1, MAX_BEAM_WIDTH),
    _f("length_penalty", float, "optional float", 1.0),
    _f("early_stopping", bool, "bool", False),
    _f("guided_kind", str, "string", "", choices=GUIDED_KINDS),
    _f("guided_spec", str, "string", ""),
)}
REQUEST_FIELDS = {f.name: f for f in (
    _f("priority", int, "int32", 0, *INT32, note=" (lower runs first)"),
    _f("cache_salt", str, "string", "", max_chars=MAX_SALT_CHARS),
    _f("request_id", str, "string", "", max_chars=MAX_REQUEST_ID_CHARS),
)}
DEFAULTS = {f.name: f.default for f in FIELDS.values()}


class FieldError(ValueError):
    """A value that breaks its field's declaration: `where` ("" or an index into the list,
    "[3]") and `problem` ("must be ..., got ...") let each API name the field its own way."""

    def __init__(self, name: str, where: str, problem: str):
        super().__init__(f"{name}{where} {problem}")
        self.name, self.where, self.problem = name, where, problem


def field(name: str) -> Field:
    return FIELDS.get(name) or REQUEST_FIELDS[name]


def check(name: str, value) -> None:
    """Raise FieldError unless `value` is what field `name` may hold."""
    f = field(name)
    if value is None and f.optional:
        return
    if f.kind is dict:
        _check_map(f, value)
        return
    if f.kind is not list:
        problem = value_problem(f, value)
        if problem:
            raise FieldError(name, "", problem)
        return
    if not isinstance(value, (list, tuple)):
        raise FieldError(name, "", f"must be a list, got {shown(value)}")
    if f.max_items is not None and len(value) > f.max_items:
        raise FieldError(name, "", f"must hold at most {f.max_items} items, got {len(value)}")
    for i, v in enumerate(value):
        problem = value_problem(f, v)
        if problem:
            raise FieldError(name, f"[{i}]", problem)


def _check_map(f: Field, value) -> None:
    if not isinstance(value, dict):
        raise FieldError(f.name, "", f"must be an object (token id: value), got {shown(value)}")
    if len(value) > f.max_items:
        raise FieldError(f.name, "", f"must hold at most {f.max_items} entries, got {len(value)}")
    for k, v in value.items():
        if isinstance(k, bool) or not isinstance(k, int) or not UINT32[0] <= k <= UINT32[1]:
            raise FieldError(f.name, f"[{shown(k)}]", f"must be keyed by token ids (integers between "
                             f"{UINT32[0]} and {UINT32[1]}), got {shown(k)}")
        problem = value_problem(f, v)
        if problem:
            raise FieldError(f.name, f"[{shown(k)}]", problem)


def value_problem(f: Field, v) -> str | None:
    """What is wrong with `v` as a value of `f` (a list or map field: as one of its items), or None."""
    kind = f.item if f.kind in (list, dict) else f.kind
    if kind is bool:
        return None if isinstance(v, bool) else f"must be a boolean, got {shown(v)}"
    if kind is str:
        return _text_problem(f, v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or kind is int and not isinstance(v, int):
        return f"must be {'an integer' if kind is int else 'a number'}, got {shown(v)}"
    if kind is int:
        return None if f.low <= v <= f.high else f"must be {range_text(f)}, got {v}"
    try:
        x = float(v)
    except OverflowError:  # an integer past float64
        x = math.inf
    if not math.isfinite(x):
        return f"must be a finite number, got {shown(v)}"
    as32 = float32(x)
    if math.isinf(as32):
        return f"must be a finite 32-bit float (at most {FLOAT32_MAX:.4g} in size), got {shown(v)}"
    if f.low is None:
        return None
    for y, low, high, how in ((x, f.low, f.high, ""),  # as given, then as the wire carries it
                              (as32, float32(f.low), float32(f.high), f" ({as32!r} as a 32-bit float)")):
        if y < low or f.low_open and y == low or y > high:
            return f"must be {range_text(f)}, got {shown(v)}{how}"
    return None


def _text_problem(f: Field, v) -> str | None:
    if not isinstance(v, str):
        return f"must be a string, got {shown(v)}"
    problem = utf8_problem(v)
    if problem:
        return problem
    if f.max_chars is not None and len(v) > f.max_chars:
        return f"must be at most {f.max_chars} characters, got {len(v)}"
    if f.choices and v not in f.choices:
        return f"must be one of {', '.join(c for c in f.choices if c)}, got {shown(v)}"
    return None


def utf8_problem(s: str) -> str | None:
    """None if `s` encodes as UTF-8 (protobuf strings must), else what is wrong."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"must be valid UTF-8: character {e.start} is a lone surrogate (U+{ord(s[e.start]):04X})"
    return None


def range_text(f: Field) -> str:
    if f.kind is int or f.item is int:
        return f"between {f.low} and {f.high}{f.note}"
    return f"in {'(' if f.low_open else '['}{f.low:g}, {f.high:g}]{f.note}"


def float32(x: float) -> float:
    """`x` rounded to float32, as the wire carries it (infinite past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def length_penalty_bound(max_model_len: int) -> float:
    """The largest |length_penalty| (rounded down to 0.1) for which length ** length_penalty
    is finite and nonzero, within [1e-154, 1e154], for every length up to `max_model_len`:
    ln(sqrt(float64 max)) / ln(max_model_len); 46.5 for 2048 tokens, 30.1 for 131072."""
    if max_model_len < 2:
        return math.inf
    return math.floor(_LN_SCORE_RANGE / math.log(max_model_len) * 10) / 10


def shown(v) -> str:
    """`v` for an error message, cut short."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
