"""Public requests (pagedserve.v1 protobufs) into prompt token ids and SamplingParams.

Defaults follow generation.proto: unset max_tokens means 16, unset n means 1, unset
temperature and top_p mean 1.0; an explicit max_tokens or n of 0 is refused. Anything wrong raises ApiError with a gRPC status code and a message
that names the field.
"""
from __future__ import annotations

import grpc

from wire import convert
from wire.protocol import ModelInfo, SamplingParams


class ApiError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def sampling_from_proto(p) -> SamplingParams:
    sp = convert.sampling_from_proto(p)
    if sp.guided_kind:
        from gateway import structured

        try:
            if sp.guided_kind not in ("json_schema", "json_object", "regex", "choice", "grammar",
                                      "structural_tag"):
                raise ValueError(f"unknown kind {sp.guided_kind!r}")
            sp.guided_spec = structured.prepare(sp.guided_kind, sp.guided_spec)
        except ValueError as e:
            raise invalid(f"sampling.guided_spec ({sp.guided_kind}): {e}") from None
    return sp


def check_model(requested: str, info: ModelInfo) -> None:
    if requested and requested != info.name:
        raise invalid(f"model {requested!r} is not served here; this gateway serves {info.name!r} "
                      "(or leave model empty)")


def generate_prompt(request, tokenizer) -> list[int]:
    """The prompt of a GenerateRequest as token ids: prompt_token_ids, or the tokenized prompt."""
    if request.prompt and request.prompt_token_ids:
        raise invalid("send either prompt or prompt_token_ids, not both")
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    if not request.prompt:
        raise invalid("prompt is empty: send prompt text or prompt_token_ids")
    if tokenizer is None:
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                       "this model has no tokenizer: send prompt_token_ids")
    ids = tokenizer.encode(request.prompt, add_special_tokens=False)
    if not ids:
        raise invalid("prompt tokenizes to no tokens")
    return ids


def chat_prompt(request, tokenizer) -> list[int]:
    """The messages of a ChatRequest rendered by the model's chat template, as token ids."""
    if not request.messages:
        raise invalid("messages is empty: send at least one message")
    for i, m in enumerate(request.messages):
        if not m.role:
            raise invalid(f"messages[{i}].role is empty (e.g. system, user, assistant)")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                       "this model has no chat template: use Generate with a prompt")
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    except Exception as e:  # a template may raise on roles it does not know
        raise invalid(f"messages: the chat template refused them: {e}") from None
