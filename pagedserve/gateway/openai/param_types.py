"""The types of the OpenAI API's parameters for its pydantic request models
(pagedserve.gateway.openai.models): each validates a value and describes it in the OpenAPI document.

Contract:
- `table(name)`: a parameter declared in pagedserve.wire.sampling_fields (sampling, priority,
  cache_salt): its checks (`sampling_fields.check`, raising FieldError) and its JSON
  schema come from there; a map's keys (logit_bias's token ids) come as JSON's strings.
- `Stop`, `Prompt`, `Content`, `Arguments`: the parameters that take one of several shapes
  (a string or a list of strings...), normalized (a prompt: a list of prompts; a content:
  its text); a value of no allowed shape raises ValueError saying what it must be, with
  no subject (the caller names the parameter).
- `Int`: an integer as the API always took it (5 or 5.0, never "5" or true), `TokenIds` a
  list of them; `Str`, `Bool` strict; `documented(schema)`: a parameter checked elsewhere,
  only described.
"""
from functools import partial
from typing import Annotated, Any, Optional

from pydantic import PlainValidator, StrictBool, StrictStr, WithJsonSchema

from pagedserve.gateway.request_limits import MAX_CONTENT_PARTS, MAX_PROMPTS
from pagedserve.wire import sampling_fields
from pagedserve.wire.sampling_fields import FLOAT32_MAX

Str = Optional[StrictStr]
Bool = Optional[StrictBool]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _int(v):
    v = _integral(v)
    if not _is_int(v):
        raise ValueError(f"must be an integer, got {sampling_fields.shown(v)}")
    return v


Int = Optional[Annotated[Any, PlainValidator(_int), WithJsonSchema({"type": "integer"})]]


def _schema(f: sampling_fields.Field, item: bool = False) -> dict:
    if f.kind is dict and not item:
        return {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": _schema(f, item=True), "maxProperties": f.max_items}
    kind = f.item if f.kind in (list, dict) and item else f.kind
    if kind is list:
        return {"type": "array", "items": _schema(f, item=True), "maxItems": f.max_items}
    if kind is str:
        return {"type": "string", **({"maxLength": f.max_chars} if f.max_chars else {})}
    if kind is bool:
        return {"type": "boolean"}
    if kind is int:
        return {"type": "integer", "minimum": f.low, "maximum": f.high}
    low = -FLOAT32_MAX if f.low is None else f.low
    return {"type": "number", "exclusiveMinimum" if f.low_open else "minimum": low,
            "maximum": FLOAT32_MAX if f.high is None else f.high}


def _token_id(key):
    """A JSON object's key as the token id it names ("50256": 50256), else as given."""
    return int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key


def _table_value(f: sampling_fields.Field, v):
    if f.kind is dict and isinstance(v, dict):
        v = {_token_id(k): _integral(x) if isinstance(x, float) else x for k, x in v.items()}
    if f.kind is int or f.kind is list and f.item is int:
        v = [_integral(x) for x in v] if isinstance(v, list) else _integral(v)
    sampling_fields.check(f.name, v)
    return v


def table(name: str):
    """The type of parameter `name` as pagedserve.wire.sampling_fields declares it (None: not given)."""
    f = sampling_fields.field(name)
    return Optional[Annotated[Any, PlainValidator(partial(_table_value, f)), WithJsonSchema(_schema(f))]]


def _stop(v):
    if isinstance(v, str):
        v = [v]
    elif not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ValueError("must be a string or a list of strings")
    sampling_fields.check("stop", v)
    return [s for s in v if s]


_STOP = sampling_fields.FIELDS["stop"]
Stop = Optional[Annotated[Any, PlainValidator(_stop), WithJsonSchema(
    {"anyOf": [_schema(_STOP, item=True), _schema(_STOP)]})]]
PROMPT_SHAPE = ("must be a string, a list of strings, a list of token ids or a list of lists of "
                "token ids, and not empty")


def _prompt(v):
    """A completions prompt as a list of prompts, each a string or a list of token ids."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(_is_int(t) for t in v):
            return [v]
        if all(isinstance(p, str) for p in v) or all(
                isinstance(p, list) and p and all(_is_int(t) for t in p) for p in v):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"must hold at most {MAX_PROMPTS} prompts, got {len(v)}")
            return v
    raise ValueError(PROMPT_SHAPE)


_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
Prompt = Optional[Annotated[Any, PlainValidator(_prompt), WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_PROMPTS},
    _IDS, {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_PROMPTS}]})]]


def _content(v) -> str:
    """A message's content as text: a string, or the text parts joined."""
    if v is None or isinstance(v, str):
        return v or ""
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                   and isinstance(p.get("text"), str) for p in v):
        if len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"must hold at most {MAX_CONTENT_PARTS} parts, got {len(v)}")
        return "".join(p["text"] for p in v)
    raise ValueError("must be a string or a list of text parts")


_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
         "required": ["type", "text"]}
Content = Annotated[Any, PlainValidator(_content), WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": _PART, "maxItems": MAX_CONTENT_PARTS}, {"type": "null"}]})]


def _arguments(v):
    if not isinstance(v, (str, dict)):
        raise ValueError("must be a string (JSON) or an object")
    return v


Arguments = Optional[Annotated[Any, PlainValidator(_arguments), WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "object"}]})]]


def documented(schema: dict):
    """A parameter checked elsewhere, described here."""
    return Optional[Annotated[Any, WithJsonSchema(schema)]]


Object = documented({"type": "object"})
TokenIds = Optional[list[Annotated[Any, PlainValidator(_int), WithJsonSchema({"type": "integer"})]]]
