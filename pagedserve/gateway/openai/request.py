"""OpenAI request bodies (/v1/completions, /v1/chat/completions, /tokenize, /detokenize)
into prompts and SamplingParams.

Contract: `parse_completion` / `parse_chat` return an OpenAIRequest or raise OpenAIError
(400 naming the parameter, 404 for a model other than the served one), all before anything
is queued: the body's parameters are checked first (pagedserve.gateway.openai.models: types, ranges
and bounds declared once, in pagedserve.wire.sampling_fields and pagedserve.gateway.request_limits), then the
prompt's size (a text the model's maximum length could not hold is refused before it is
tokenized), then the prompt is tokenized and a grammar prepared. They do blocking work
(tokenizing, chat templates, grammars): the app runs them on the gateway's parse pool.
Prompts are tokenized exactly as the gRPC API does (pagedserve.gateway.api_request), so the same
request gives the same tokens on both. Defaults are SamplingParams' (pagedserve.wire.sampling_fields),
as OpenAI's: max_tokens 16 for completions, but the rest of the context for chat.
logit_bias is on the model's token ids (an id past its vocabulary is refused).
Extensions beside OpenAI's parameters: top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, beam search (beam_width, length_penalty, early_stopping), priority,
cache_salt, and prompt_logprobs on completions (echo with logprobs asks for them too: the
echoed prompt's tokens get logprobs, as OpenAI gives them).
Nothing is dropped in silence: a field this server does not act on is a 400 naming it
(pagedserve.gateway.openai.unsupported), unknown ones included. `request_id` (vLLM's) names the
response ("chatcmpl-<id>", "cmpl-<id>") and the request's telemetry.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from pagedserve.gateway import chat_template, structured
from pagedserve.gateway.api_request import ApiError, chat_prompt, check_text_size, generate_prompt
from pagedserve.gateway.grammar_budget import GrammarBusy
from pagedserve.gateway.openai import unsupported
from pagedserve.gateway.openai.errors import OpenAIError, bad_request, from_api_error, model_not_found
from pagedserve.gateway.openai.models import (ChatRequest, CompletionRequest, DetokenizeRequest, Message, TokenizeRequest,
                                   validated)
from pagedserve.gateway.openai.param_types import PROMPT_SHAPE
from pagedserve.gateway.openai.tool_calls import guided as guided_tools, parse_tools, render
from pagedserve.gateway.request_limits import utf8_size
from pagedserve.wire.protocol import ModelInfo, SamplingParams
from pagedserve.wire.served_names import names_of, serves

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
            "n", "beam_width", "length_penalty", "early_stopping")


@dataclass
class OpenAIRequest:
    chat: bool
    model: str  # the served model's name
    prompts: list[list[int]]  # one request to the batching loop each, n completions per prompt
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    echo: bool = False  # completions: each choice's text starts with its prompt
    prompt_texts: list[str] = dataclasses.field(default_factory=list)  # with echo
    tools: object = None  # pagedserve.gateway.openai.tool_calls.Tools, chat only
    priority: int = 0  # lower runs first (the scheduler's queue order)
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share
    prompt_logprobs: int | None = None  # completions: as asked (choices[i].prompt_logprobs); the
    # sampling's may be larger, for echo with logprobs
    reasoning: str | None = None  # chat: the --reasoning-parser splitting the output (the app sets it)
    include_reasoning: bool = True  # chat: send the reasoning (vLLM's include_reasoning)
    request_id: str = ""  # the client's (vLLM's request_id): the response's id and telemetry's


def parse_completion(body: dict, info: ModelInfo, tokenizer) -> OpenAIRequest:
    m = validated(CompletionRequest, body)
    unsupported.check(body, CompletionRequest.model_fields)
    _check_common(m, info)
    sampling = _sampling(m, info, chat=False)
    if m.prompt is None:
        raise bad_request(f"prompt {PROMPT_SHAPE}", "prompt")
    prompts = [_text_prompt(p, info, tokenizer) if isinstance(p, str) else _ids_prompt(p, info)
               for p in m.prompt]
    _guided(body, sampling)
    req = _finish(m, info, False, prompts, sampling)
    req.echo = bool(m.echo)
    req.prompt_logprobs = sampling.prompt_logprobs
    if req.echo:
        if sampling.beam_search:
            raise bad_request("echo is not supported with beam search", "echo")
        if sampling.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            sampling.prompt_logprobs = max(sampling.prompt_logprobs or 0, sampling.logprobs)
        texts = m.prompt if all(isinstance(p, str) for p in m.prompt) else None
        req.prompt_texts = texts or [_decode(p, tokenizer) for p in prompts]
    return req


def _decode(ids: list[int], tokenizer) -> str:
    if tokenizer is None:
        raise bad_request("echo of token-id prompts needs the model's tokenizer", "echo")
    return tokenizer.decode(ids)


def parse_chat(body: dict, info: ModelInfo, tokenizer) -> OpenAIRequest:
    m = validated(ChatRequest, body)
    unsupported.check(body, ChatRequest.model_fields)
    unsupported.check_messages(body.get("messages"), Message.model_fields)
    _check_common(m, info)
    if m.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is only supported on /v1/completions, not on chat",
                          "prompt_logprobs")
    turns = _turns(m.messages)
    template_kwargs = _template_kwargs(m.chat_template_kwargs)
    tools = parse_tools(body)
    sampling = _sampling(m, info, chat=True)
    turns = _with_message_fields(turns, m.messages)
    if tools is not None or any(len(t) > 2 for t in turns):  # more than role and content
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template", "messages")
        _check_chat_size(turns, info, tokenizer)
        prompt = render(turns, tools, tokenizer, template_kwargs)
    else:
        prompt = _chat_prompt(turns, info, tokenizer, template_kwargs)
    if m.max_tokens is None and m.max_completion_tokens is None:
        sampling.max_tokens = max(info.max_model_len - len(prompt), 1)
    _guided(body, sampling)
    if tools is not None and tools.forced:
        if sampling.guided:
            raise bad_request("tool_choice required or named cannot be combined with response_format "
                              "or guided_*", "tool_choice")
        kind, spec = guided_tools(tools)
        try:
            sampling.guided_kind, sampling.guided_spec = kind, structured.prepare(kind, spec)
        except GrammarBusy as e:
            raise busy(e) from None
        except ValueError as e:
            raise bad_request(f"tools: {e}", "tools") from None
    req = _finish(m, info, True, [prompt], sampling)
    req.tools = tools if tools is not None and tools.active else None
    req.include_reasoning = m.include_reasoning is not False
    return req


def _turns(messages) -> list[dict]:
    if not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    return [{"role": m.role, "content": m.content} for m in messages]


def _with_message_fields(turns: list[dict], messages) -> list[dict]:
    """The turns with their tool calls, tool results, names and earlier reasoning (vLLM's
    `reasoning` or `reasoning_content`, given to the template as reasoning_content, as
    Qwen3's reads it), as dicts for the chat template."""
    for turn, m in zip(turns, messages):
        if m.tool_calls is not None:
            turn["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                turn[key] = getattr(m, key)
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            turn["reasoning_content"] = reasoning
    return turns


def _guided(body: dict, sampling: SamplingParams) -> None:
    try:
        sampling.guided_kind, sampling.guided_spec = structured.from_openai(body)
    except GrammarBusy as e:
        raise busy(e) from None
    except structured.GuidedError as e:
        raise bad_request(str(e), e.param) from None


def busy(e: GrammarBusy) -> OpenAIError:
    """Every grammar worker is taken: 429, retry (the request itself may be fine)."""
    return OpenAIError(429, str(e), code="grammar_workers_busy")


def tokenize_body(body: dict, info: ModelInfo, tokenizer) -> list[int]:
    """The tokens of a /tokenize body: {prompt} as completions tokenize it, or {messages}
    rendered by the chat template as chat does."""
    m = validated(TokenizeRequest, body)
    unsupported.check(body, TokenizeRequest.model_fields)
    unsupported.check_messages(body.get("messages"), Message.model_fields)
    _check_model(m.model, info)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", None)
    if m.messages is not None:
        turns = _turns(m.messages)
        template_kwargs = _template_kwargs(m.chat_template_kwargs)
        if m.add_generation_prompt is False:
            _check_chat_size(turns, info, tokenizer)
            try:
                return list(tokenizer.apply_chat_template(turns, add_generation_prompt=False, tokenize=True,
                                                          return_dict=False, **(template_kwargs or {})))
            except Exception as e:
                raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
        return _chat_prompt(turns, info, tokenizer, template_kwargs)
    if m.prompt is None:
        raise bad_request("send prompt (a string) or messages", "prompt")
    _check_size(utf8_size(m.prompt), info, tokenizer, "prompt", "prompt")
    return list(tokenizer.encode(m.prompt, add_special_tokens=bool(m.add_special_tokens)))


def detokenize_body(body: dict, info: ModelInfo, tokenizer) -> str:
    """The text of a /detokenize body {tokens: [ids]}."""
    m = validated(DetokenizeRequest, body)
    unsupported.check(body, DetokenizeRequest.model_fields)
    _check_model(m.model, info)
    tokens = m.tokens
    if tokens is None or not all(0 <= t < info.vocab_size for t in tokens) or len(tokens) > info.max_model_len:
        raise bad_request(f"tokens must be a list of at most {info.max_model_len} token ids in "
                          f"[0, {info.vocab_size})", "tokens")
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    return tokenizer.decode(tokens)


def _check_model(model: str | None, info: ModelInfo) -> None:
    if not serves(info, model):
        raise model_not_found(model, names_of(info))


def _check_common(m, info: ModelInfo) -> None:
    _check_model(m.model, info)


def _finish(m, info: ModelInfo, chat: bool, prompts, sampling) -> OpenAIRequest:
    stream = bool(m.stream)
    if m.stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    include_usage = bool(m.stream_options is not None and m.stream_options.include_usage)
    return OpenAIRequest(chat, info.name, prompts, sampling, stream, include_usage, m.user,
                         priority=m.priority or 0, cache_salt=m.cache_salt or None,
                         request_id=m.request_id or "")


def _ids_prompt(ids: list[int], info: ModelInfo) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {info.vocab_size})", "prompt")
    return list(ids)


def _text_prompt(text: str, info: ModelInfo, tokenizer) -> list[int]:
    try:
        return generate_prompt(SimpleNamespace(prompt=text, prompt_token_ids=[]), tokenizer, info.max_model_len)
    except ApiError as e:
        raise from_api_error(e, "prompt") from None


def _template_kwargs(value) -> dict | None:
    try:
        return chat_template.kwargs(value)
    except ValueError as e:
        raise bad_request(str(e), "chat_template_kwargs") from None


def _chat_prompt(turns: list[dict], info: ModelInfo, tokenizer,
                 template_kwargs: dict | None = None) -> list[int]:
    try:
        return chat_prompt(SimpleNamespace(messages=[SimpleNamespace(**t) for t in turns]), tokenizer,
                           info.max_model_len, template_kwargs or {})
    except ApiError as e:
        raise from_api_error(e, "messages") from None


def _check_chat_size(turns: list[dict], info: ModelInfo, tokenizer) -> None:
    size = sum(utf8_size(t["content"]) for t in turns)
    _check_size(size, info, tokenizer, "messages (their contents together)", "messages")


def _check_size(size: int, info: ModelInfo, tokenizer, what: str, param: str) -> None:
    try:
        check_text_size(size, info.max_model_len, tokenizer, what)
    except ApiError as e:
        raise from_api_error(e, param) from None


def _sampling(m, info: ModelInfo, chat: bool) -> SamplingParams:
    """The SamplingParams of a checked body, validated; a chat without max_tokens gets the
    rest of the context once its prompt is known (1, or min_tokens, here)."""
    max_name = "max_completion_tokens" if chat and m.max_completion_tokens is not None else "max_tokens"
    given = {name: getattr(m, name) for name in SAMPLING if getattr(m, name) is not None}
    if getattr(m, max_name) is not None:
        given["max_tokens"] = getattr(m, max_name)
    elif chat:
        given["max_tokens"] = max(1, m.min_tokens or 0)
    logprobs = _chat_logprobs(m) if chat else m.logprobs
    s = SamplingParams(**given, logprobs=logprobs, prompt_logprobs=None if chat else m.prompt_logprobs)
    outside = next((t for t in s.logit_bias if t >= info.vocab_size), None)
    if outside is not None:
        raise bad_request(f"logit_bias[{outside}]: token id {outside} is outside the vocabulary "
                          f"[0, {info.vocab_size})", "logit_bias")
    if m.best_of not in (None, 1, s.n):
        raise bad_request("best_of is not supported; use n, or beam_width for beam search", "best_of")
    try:
        s.validate(info.max_model_len)
    except ValueError as e:
        field = str(e).split()[0].split("=")[0]
        param = {"max_tokens": max_name, "logprobs": "top_logprobs" if chat else "logprobs"}.get(field, field)
        raise bad_request(param + str(e)[len(field):], param) from None
    return s


def _chat_logprobs(m) -> int | None:
    if not m.logprobs:
        if m.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        return None
    return m.top_logprobs or 0
