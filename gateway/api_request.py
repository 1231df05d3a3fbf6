"""Public requests (pagedserve.v1 protobufs) into prompt token ids and SamplingParams.

Defaults follow generation.proto: max_tokens 0 means 16, n 0 means 1, unset temperature
and top_p mean 1.0. Anything wrong raises ApiError with a gRPC status code and a message
that names the field.
"""
from __future__ import annotations

import grpc

from pagedserve.protocol import ModelInfo, SamplingParams


class ApiError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _f32(x: float) -> float:
    """Recover the decimal a client most likely sent from its float32 wire value (0.7, not 0.69999998)."""
    return float(f"{x:.7g}")


def sampling_from_proto(p) -> SamplingParams:
    if p.beam_width > 1:
        raise invalid(f"sampling.beam_width={p.beam_width}: beam search is not supported; use 0 or 1")
    return SamplingParams(
        max_tokens=p.max_tokens or 16,
        temperature=_f32(p.temperature) if p.HasField("temperature") else 1.0,
        top_p=_f32(p.top_p) if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        min_p=_f32(p.min_p),
        repetition_penalty=_f32(p.repetition_penalty) if p.HasField("repetition_penalty") else 1.0,
        presence_penalty=_f32(p.presence_penalty),
        frequency_penalty=_f32(p.frequency_penalty),
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        n=p.n or 1,
    )


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
