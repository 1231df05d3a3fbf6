"""OpenAI request bodies (/v1/completions, /v1/chat/completions) into prompts and SamplingParams.

Contract: `parse_completion` / `parse_chat` return an OpenAIRequest or raise OpenAIError
(400 naming the parameter, 404 for a model other than the served one). Prompts are
tokenized exactly as the gRPC API does (gateway.api_request), so the same request gives
the same tokens on both. Defaults follow OpenAI: max_tokens 16 for completions and the
rest of the context for chat; temperature and top_p 1; n 1. Extensions beside OpenAI's
parameters: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, beam search
(beam_width, length_penalty, early_stopping) where SamplingParams has those fields, and
prompt_logprobs on completions (echo with logprobs asks for them too: the echoed prompt's
tokens get logprobs, as OpenAI gives them).
Unknown parameters are ignored; known ones this server cannot honour are refused.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from gateway.api_request import ApiError, chat_prompt, generate_prompt
from gateway import structured
from gateway.openai.errors import bad_request, from_api_error, model_not_found
from gateway.openai.tool_calls import guided as guided_tools, parse_tools, render
from wire.protocol import ModelInfo, SamplingParams

EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
BEAM_FIELDS = ("beam_width", "length_penalty", "early_stopping")
REFUSED = ("suffix", "logit_bias", "functions", "audio")


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
    tools: object = None  # gateway.openai.tool_calls.Tools, chat only
    priority: int = 0  # lower runs first (the scheduler's queue order)
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share
    prompt_logprobs: int | None = None  # completions: as asked (choices[i].prompt_logprobs); the
    # sampling's may be larger, for echo with logprobs


def parse_completion(body: dict, info: ModelInfo, tokenizer) -> OpenAIRequest:
    _check_common(body, info)
    prompts = _completion_prompts(body.get("prompt"), tokenizer)
    sampling = _sampling(body, info, chat=False, default_max_tokens=16)
    if body.get("response_format") is not None:
        raise bad_request("response_format is a chat parameter; use guided_json here", "response_format")
    _guided(body, sampling, info)
    req = _finish(body, info, False, prompts, sampling)
    req.echo = _get(body, "echo", bool, False)
    req.prompt_logprobs = sampling.prompt_logprobs
    if req.echo:
        if sampling.beam_search:
            raise bad_request("echo is not supported with beam search", "echo")
        if sampling.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            sampling.prompt_logprobs = max(sampling.prompt_logprobs or 0, sampling.logprobs)
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt if all(isinstance(p, str) for p in prompt) \
            else None
        req.prompt_texts = texts or [_decode(p, tokenizer) for p in prompts]
    return req


def _decode(ids: list[int], tokenizer) -> str:
    if tokenizer is None:
        raise bad_request("echo of token-id prompts needs the model's tokenizer", "echo")
    return tokenizer.decode(ids)


def parse_chat(body: dict, info: ModelInfo, tokenizer) -> OpenAIRequest:
    _check_common(body, info)
    if body.get("prompt_logprobs") is not None:
        raise bad_request("prompt_logprobs is only supported on /v1/completions, not on chat",
                          "prompt_logprobs")
    tools = parse_tools(body)
    if tools is not None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template", "messages")
        prompt = render(_tool_messages(body.get("messages")), tools, tokenizer)
    else:
        prompt = _chat_prompt(body.get("messages"), tokenizer)
    sampling = _sampling(body, info, chat=True, default_max_tokens=max(info.max_model_len - len(prompt), 1))
    _guided(body, sampling, info)
    if tools is not None and tools.forced:
        if sampling.guided:
            raise bad_request("tool_choice required or named cannot be combined with response_format "
                              "or guided_*", "tool_choice")
        kind, spec = guided_tools(tools)
        try:
            sampling.guided_kind, sampling.guided_spec = kind, structured.prepare(kind, spec)
        except ValueError as e:
            raise bad_request(f"tools: {e}", "tools") from None
    req = _finish(body, info, True, [prompt], sampling)
    req.tools = tools if tools is not None and tools.active else None
    return req


def _tool_messages(messages) -> list[dict]:
    """Messages with tool calls and tool results, checked, as dicts for the chat template."""
    out = _chat_turns(messages)
    for i, (msg, m) in enumerate(zip(out, messages)):
        if m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list):
                raise bad_request(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
            msg["tool_calls"] = m["tool_calls"]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
    return out


def _guided(body: dict, sampling: SamplingParams, info: ModelInfo) -> None:
    try:
        sampling.guided_kind, sampling.guided_spec = structured.from_openai(body)
    except structured.GuidedError as e:
        raise bad_request(str(e), e.param) from None


def tokenize_body(body: dict, tokenizer) -> list[int]:
    """The tokens of a /tokenize body: {prompt} as completions tokenize it, or {messages}
    rendered by the chat template as chat does."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", None)
    if body.get("messages") is not None:
        turns = _chat_turns(body.get("messages"))
        if not _get(body, "add_generation_prompt", bool, True):
            try:
                return list(tokenizer.apply_chat_template(turns, add_generation_prompt=False,
                                                          tokenize=True, return_dict=False))
            except Exception as e:
                raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
        return _chat_prompt(body.get("messages"), tokenizer)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("send prompt (a string) or messages", "prompt")
    return list(tokenizer.encode(prompt, add_special_tokens=_get(body, "add_special_tokens", bool, False)))


def _chat_turns(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        turns.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return turns


def _check_common(body: dict, info: ModelInfo) -> None:
    model = body.get("model")
    if model not in (None, "") and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model and model != info.name:
        raise model_not_found(model, info.name)
    for name in REFUSED:
        if body.get(name):  # absent, null, false, "" and empty lists or objects are fine
            raise bad_request(f"{name} is not supported by this server", name)


def _finish(body: dict, info: ModelInfo, chat: bool, prompts, sampling) -> OpenAIRequest:
    stream = _get(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = _get(options or {}, "include_usage", bool, False, "stream_options.include_usage")
    user = _get(body, "user", str, None)
    priority = _get(body, "priority", int, 0)
    if not -2 ** 31 <= priority < 2 ** 31:
        raise bad_request("priority must fit in 32 bits", "priority")
    salt = _get(body, "cache_salt", str, None)
    return OpenAIRequest(chat, info.name, prompts, sampling, stream, include_usage, user,
                         priority=priority, cache_salt=salt or None)


def _completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [_text_prompt(prompt, tokenizer)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_text_prompt(p, tokenizer) for p in prompt]
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                      "lists of token ids, and not empty", "prompt")


def _text_prompt(text: str, tokenizer) -> list[int]:
    try:
        return generate_prompt(SimpleNamespace(prompt=text, prompt_token_ids=[]), tokenizer)
    except ApiError as e:
        raise from_api_error(e, "prompt") from None


def _chat_prompt(messages, tokenizer) -> list[int]:
    turns = [SimpleNamespace(**t) for t in _chat_turns(messages)]
    try:
        return chat_prompt(SimpleNamespace(messages=turns), tokenizer)
    except ApiError as e:
        raise from_api_error(e, "messages") from None


def _content(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content")


def _sampling(body: dict, info: ModelInfo, chat: bool, default_max_tokens: int) -> SamplingParams:
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    s = SamplingParams(
        max_tokens=_get(body, max_name, int, default_max_tokens),
        temperature=_get(body, "temperature", float, 1.0),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, 0),
        min_p=_get(body, "min_p", float, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", float, 1.0),
        presence_penalty=_get(body, "presence_penalty", float, 0.0),
        frequency_penalty=_get(body, "frequency_penalty", float, 0.0),
        seed=_get(body, "seed", int, None),
        stop=_stop(body.get("stop")),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        logprobs=_chat_logprobs(body) if chat else _get(body, "logprobs", int, None),
        prompt_logprobs=None if chat else _get(body, "prompt_logprobs", int, None),
        n=_get(body, "n", int, 1),
    )
    if s.seed is not None and not 0 <= s.seed < 2 ** 63:
        raise bad_request(f"seed must be between 0 and 2**63 - 1, got {s.seed}", "seed")
    best_of = _get(body, "best_of", int, None)
    if best_of not in (None, 1, s.n):
        raise bad_request("best_of is not supported; use n, or beam_width for beam search", "best_of")
    _beam_fields(body, s)
    try:
        s.validate(info.max_model_len)
    except ValueError as e:
        field = str(e).split()[0].split("=")[0]
        param = {"max_tokens": max_name, "logprobs": "top_logprobs" if chat else "logprobs"}.get(field, field)
        raise bad_request(param + str(e)[len(field):], param) from None
    return s


def _beam_fields(body: dict, s: SamplingParams) -> None:
    have = {f.name for f in dataclasses.fields(SamplingParams)}
    kinds = {"beam_width": int, "length_penalty": float, "early_stopping": bool}
    for name in BEAM_FIELDS:
        if body.get(name) is None:
            continue
        if name not in have:
            raise bad_request(f"{name}: beam search is not supported by this server", name)
        setattr(s, name, _get(body, name, kinds[name], None))


def _chat_logprobs(body: dict) -> int | None:
    top = _get(body, "top_logprobs", int, None)
    if not _get(body, "logprobs", bool, False):
        if top is not None:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        return None
    return top or 0


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad_request("stop must be a string or a list of strings", "stop")


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return list(value)
    raise bad_request(f"{name} must be a list of integers", name)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(body: dict, name: str, kind: type, default, param: str | None = None):
    """body[name] checked to be of `kind` (ints pass as floats, bools not as numbers);
    `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and _is_int(value):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool)):
        return value
    what = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}[kind]
    raise bad_request(f"{param or name} must be {what}, got {value!r}", param or name)
