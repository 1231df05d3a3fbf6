"""Public requests (pagedserve.v1 protobufs) into prompt token ids and SamplingParams.

Defaults follow generation.proto (declared in pagedserve.wire.sampling_fields): unset max_tokens means
16, unset n means 1, unset temperature and top_p mean 1.0; an explicit max_tokens or n of 0
is refused. Every field is checked against its declaration (SamplingParams.validate) before
a grammar is prepared or a prompt tokenized, and a text prompt too large for the model is
refused by its size before it is tokenized (pagedserve.gateway.request_limits). A field this
gateway's generation.proto lacks (a client built from a newer one) is refused by its number
(`check_known_fields`): protobuf would set it aside, dropped without a word. Anything wrong
raises ApiError with a gRPC status code and a message that names the field.
"""
from __future__ import annotations

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet

from pagedserve.gateway import chat_template, request_limits
from pagedserve.wire import convert, sampling_fields
from pagedserve.wire.protocol import ModelInfo, SamplingParams
from pagedserve.wire.served_names import names_of, serves


class ApiError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def sampling_from_proto(p, max_model_len: int | None = None) -> SamplingParams:
    """The request's SamplingParams, validated (for `max_model_len`, when given), its
    grammar prepared."""
    sp = convert.sampling_from_proto(p)
    try:
        sp.validate(max_model_len)
    except ValueError as e:
        raise invalid(str(e)) from None
    if sp.guided_kind:
        from pagedserve.gateway import structured

        try:
            if sp.guided_kind == "structural_tag":  # vLLM's older form too, as on the HTTP API
                sp.guided_spec = structured.structural_tag(sp.guided_spec, "sampling.guided_spec")
            sp.guided_spec = structured.prepare(sp.guided_kind, sp.guided_spec)
        except structured.grammar_budget.GrammarBusy as e:  # not the request's fault: retry
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except ValueError as e:
            raise invalid(f"sampling.guided_spec ({sp.guided_kind}): {e}") from None
    return sp


def check_known_fields(message, path: str = "") -> None:
    """INVALID_ARGUMENT naming the first field of `message` (nested messages too) that this
    gateway's proto does not declare; `path`: where `message` sits in the request."""
    unknown = sorted({f.field_number for f in UnknownFieldSet(message)})
    if unknown:
        raise invalid(f"{path.rstrip('.') or 'the request'}: field number {unknown[0]} is not a field of "
                      f"{message.DESCRIPTOR.full_name} in this gateway's API (a client built from a "
                      "newer generation.proto?): leave it out, or upgrade the gateway")
    for fd, value in message.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            if fd.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    check_known_fields(item, f"{path}{fd.name}[{key!r}].")
        elif fd.is_repeated:
            for i, item in enumerate(value):
                check_known_fields(item, f"{path}{fd.name}[{i}].")
        else:
            check_known_fields(value, f"{path}{fd.name}.")


def check_request_field(name: str, value) -> None:
    """INVALID_ARGUMENT unless `value` is what request field `name` may hold (pagedserve.wire.sampling_fields)."""
    try:
        sampling_fields.check(name, value)
    except ValueError as e:
        raise invalid(str(e)) from None


def check_model(requested: str, info: ModelInfo) -> None:
    """NOT_FOUND unless the gateway serves a model named `requested` (empty: the model)."""
    if not serves(info, requested):
        served = ", ".join(repr(n) for n in names_of(info))
        raise ApiError(grpc.StatusCode.NOT_FOUND, f"model: {requested!r} is not served here; this "
                       f"gateway serves {served} (or leave model empty)")


def check_text_size(size: int, max_model_len: int | None, tokenizer, what: str) -> None:
    """INVALID_ARGUMENT when `size` bytes of text could not fit the model (pagedserve.gateway.request_limits)."""
    if max_model_len is None:
        return
    try:
        request_limits.check_prompt_bytes(size, max_model_len, tokenizer, what)
    except ValueError as e:
        raise invalid(str(e)) from None


def generate_prompt(request, tokenizer, max_model_len: int | None = None) -> list[int]:
    """The prompt of a GenerateRequest as token ids: prompt_token_ids, or the tokenized prompt
    (refused by its size first when `max_model_len` is given)."""
    if request.prompt and request.prompt_token_ids:
        raise invalid("send either prompt or prompt_token_ids, not both")
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    if not request.prompt:
        raise invalid("prompt is empty: send prompt text or prompt_token_ids")
    if tokenizer is None:
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                       "this model has no tokenizer: send prompt_token_ids")
    check_text_size(request_limits.utf8_size(request.prompt), max_model_len, tokenizer, "prompt")
    ids = tokenizer.encode(request.prompt, add_special_tokens=False)
    if not ids:
        raise invalid("prompt tokenizes to no tokens")
    return ids


def chat_prompt(request, tokenizer, max_model_len: int | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """The messages of a ChatRequest rendered by the model's chat template, as token ids
    (refused by their size first when `max_model_len` is given), with `template_kwargs` (else
    the request's own chat_template_kwargs, pagedserve.gateway.chat_template) as template variables."""
    if not request.messages:
        raise invalid("messages is empty: send at least one message")
    if len(request.messages) > request_limits.MAX_MESSAGES:
        raise invalid(f"messages must hold at most {request_limits.MAX_MESSAGES} messages, "
                      f"got {len(request.messages)}")
    for i, m in enumerate(request.messages):
        if not m.role:
            raise invalid(f"messages[{i}].role is empty (e.g. system, user, assistant)")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                       "this model has no chat template: use Generate with a prompt")
    size = sum(request_limits.utf8_size(m.content) for m in request.messages)
    check_text_size(size, max_model_len, tokenizer, "messages (their contents together)")
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    if template_kwargs is None:
        try:
            template_kwargs = chat_template.kwargs_of_proto(request)
        except ValueError as e:
            raise invalid(str(e)) from None
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False,
                                                  **(template_kwargs or {})))
    except Exception as e:  # a template may raise on roles it does not know
        raise invalid(f"messages: the chat template refused them: {e}") from None
