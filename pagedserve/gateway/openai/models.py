"""The OpenAI API's request bodies as pydantic models: each parameter's type and bounds,
checked before any work and published in the OpenAPI document (pagedserve.gateway.openai.openapi).

Contract: `validated(Model, body)` returns the model of a JSON body (pagedserve.gateway.openai.json_body)
or raises OpenAIError 400 whose `param` names the first bad parameter as OpenAI does
(`messages[2].tool_calls[0]`, `stop_token_ids[1]`) and whose message says what it may hold.
- Sampling parameters and priority / cache_salt / request_id take their types, ranges and checks from
  pagedserve.wire.sampling_fields (pagedserve.gateway.openai.param_types.table), so that both APIs and the wire
  agree; list bounds beyond those are pagedserve.gateway.request_limits'.
- Types are as strict as the API has always been: an integer takes 5 or 5.0 but not "5"
  or true, a number an integer or a float, a boolean only true or false, a string only a
  string; null is the same as leaving a parameter out.
- Unknown parameters pass here and are refused by pagedserve.gateway.openai.unsupported (as are
  those declared only to be refused: suffix, functions, audio); parameters whose rules live
  elsewhere (tools, tool_choice, response_format, structured_outputs, guided_json: pagedserve.gateway.openai.tool_calls,
  pagedserve.gateway.structured) are only typed here.
"""
from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, model_validator

from pagedserve.gateway.openai.errors import OpenAIError, bad_request, param_path
from pagedserve.gateway.openai.param_types import (Arguments, Bool, Content, Int, Object, Prompt, Stop, Str, TokenIds,
                                        documented, table)
from pagedserve.gateway.request_limits import MAX_MESSAGES, MAX_TOOL_CALLS, MAX_TOOLS
from pagedserve.wire import sampling_fields
from pagedserve.wire.sampling_fields import FieldError


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Body):
    name: Str = None
    arguments: Arguments = None


class ToolCall(_Body):
    id: Str = None
    type: Str = None
    function: Optional[FunctionCall] = None


class Message(_Body):
    role: StrictStr
    content: Content = ""
    tool_calls: Optional[Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)]] = None
    tool_call_id: Str = None
    name: Str = None
    reasoning_content: Str = None  # an earlier answer's reasoning (vLLM's), for the template
    reasoning: Str = None  # the same, vLLM's newer name

    @model_validator(mode="before")
    @classmethod
    def _an_object_with_a_role(cls, data):
        if not isinstance(data, dict) or not isinstance(data.get("role"), str):
            raise ValueError("must be an object with a string role")
        return data


Messages = Optional[Annotated[list[Message], Field(max_length=MAX_MESSAGES)]]


class StreamOptions(_Body):
    include_usage: Bool = None


class _Generation(_Body):
    """The parameters completions and chat share."""

    model: Str = None
    max_tokens: table("max_tokens") = None
    temperature: table("temperature") = None
    top_p: table("top_p") = None
    top_k: table("top_k") = None
    min_p: table("min_p") = None
    repetition_penalty: table("repetition_penalty") = None
    presence_penalty: table("presence_penalty") = None
    frequency_penalty: table("frequency_penalty") = None
    seed: table("seed") = None
    stop: Stop = None
    stop_token_ids: table("stop_token_ids") = None
    ignore_eos: table("ignore_eos") = None
    min_tokens: table("min_tokens") = None
    logit_bias: table("logit_bias") = None
    n: table("n") = None
    best_of: Int = None
    beam_width: table("beam_width") = None
    length_penalty: table("length_penalty") = None
    early_stopping: table("early_stopping") = None
    stream: Bool = None
    stream_options: Optional[StreamOptions] = None
    user: Str = None
    priority: table("priority") = None
    cache_salt: table("cache_salt") = None
    request_id: table("request_id") = None
    response_format: Object = None
    guided_json: documented({"anyOf": [{"type": "object"}, {"type": "string"}]}) = None
    guided_regex: Str = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Str = None
    structured_outputs: Object = None
    # refused when given (suffix, functions, audio): typed loosely to say so
    suffix: documented({}) = None
    functions: documented({}) = None
    audio: documented({}) = None


class CompletionRequest(_Generation):
    prompt: Prompt = None
    echo: Bool = None
    logprobs: table("logprobs") = None
    prompt_logprobs: table("prompt_logprobs") = None


class ChatRequest(_Generation):
    messages: Messages = None
    max_completion_tokens: table("max_tokens") = None
    logprobs: Bool = None
    top_logprobs: table("logprobs") = None
    tools: Optional[Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: documented({"anyOf": [{"type": "string"}, {"type": "object"}]}) = None
    parallel_tool_calls: Bool = None
    prompt_logprobs: documented({}) = None  # completions only: refused here
    chat_template_kwargs: Object = None
    include_reasoning: Bool = None


class TokenizeRequest(_Body):
    model: Str = None
    prompt: Str = None
    messages: Messages = None
    add_special_tokens: Bool = None
    add_generation_prompt: Bool = None
    chat_template_kwargs: Object = None


class DetokenizeRequest(_Body):
    model: Str = None
    tokens: TokenIds = None


_WHAT = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
         "float_type": "a number", "float_parsing": "a number", "bool_type": "a boolean",
         "bool_parsing": "a boolean", "string_type": "a string", "list_type": "a list",
         "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object"}


def validated(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise as_openai_error(e.errors(include_url=False)[0]) from None


def as_openai_error(error: dict) -> OpenAIError:
    """One pydantic error as the 400 naming its parameter."""
    param = param_path(error["loc"])
    kind, ctx = error["type"], error.get("ctx") or {}
    cause = ctx.get("error")
    subject = param or "the request body"
    if isinstance(cause, FieldError):
        return bad_request(f"{param}{cause.where} {cause.problem}", f"{param}{cause.where}")
    if isinstance(cause, ValueError):
        return bad_request(f"{subject} {cause}", param)
    if kind in _WHAT:
        return bad_request(f"{subject} must be {_WHAT[kind]}, got {sampling_fields.shown(error['input'])}",
                           param)
    if kind == "too_long":
        return bad_request(f"{subject} must hold at most {ctx['max_length']} items, got "
                           f"{ctx.get('actual_length')}", param)
    if kind == "missing":
        return bad_request(f"{subject} is required", param)
    return bad_request(f"{subject}: {error['msg']}", param)
