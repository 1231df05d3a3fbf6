"""Nothing a request asks for is dropped in silence: every body field of the OpenAI API is acted
on (declared in pagedserve.gateway.openai.models and used by pagedserve.gateway.openai.request) or refused by name.

Contract: `check(body, declared)` raises OpenAIError 400 naming the first field that is
- one of `NOT_SUPPORTED` (fields of OpenAI's and vLLM's request schemas this server does
  not act on) asking for something: absent, null, false, 0, "" and empty lists or objects
  ask for nothing and pass;
- one of `SAME_AS_DONE` (fields whose value can ask for what this server does anyway, e.g.
  vLLM's skip_special_tokens true) with any other value; its message says what it may be;
- none of these and not `declared` (the endpoint's model's fields): an unknown field, with
  any value but null;
- stream_options with a key other than include_usage (continuous_usage_stats false passes).
`check_messages(messages, declared)` does the same for each message's fields (the message
model's), naming `messages[i].<field>`; an undeclared one passes only when it asks for
nothing (a response's `refusal: null` or `annotations: []` sent back).
"""
from __future__ import annotations

import json

from pagedserve.gateway.openai.errors import bad_request

NOT_SUPPORTED = (
    # OpenAI
    "audio", "functions", "suffix", "metadata", "prediction", "prompt_cache_key", "reasoning_effort",
    "safety_identifier", "verbosity", "web_search_options",
    # vLLM
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "bad_words", "documents",
    "chat_template", "mm_processor_kwargs", "media_io_kwargs", "structural_tag", "guided_whitespace_pattern",
    "logits_processors", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "thinking_token_budget",
    "watermarking", "logprob_token_ids", "session_id", "repetition_detection", "prompt_embeds",
)
SAME_AS_DONE = {
    "store": (False,), "modalities": (["text"],), "service_tier": ("auto", "default"),
    "function_call": ("none",), "use_beam_search": (False,), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "echo": (False,),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "add_special_tokens": (False,),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "return_token_offsets": (False,),
    "return_prompt_text": (False,), "return_mm_kwargs": (True,), "routed_experts_prompt_start": (0,),
    "guided_decoding_backend": ("xgrammar", "auto"), "stream_interval": (1,),
}
HINTS = {"use_beam_search": "; use beam_width for beam search", "chat_template": "; start the server with "
         "--chat-template FILE", "structural_tag": "; use structured_outputs.structural_tag",
         "guided_whitespace_pattern": "", "functions": "; use tools", "function_call": "; use tool_choice"}


def check(body: dict, declared) -> None:
    for name, value in body.items():
        if name in NOT_SUPPORTED:
            if _asks_nothing(value):
                continue
            raise bad_request(f"{name} is not supported by this server{HINTS.get(name, '')}", name)
        if name in declared:
            continue
        if name in SAME_AS_DONE:
            allowed = SAME_AS_DONE[name]
            if value is None or any(value == a and type(value) is type(a) for a in allowed):
                continue
            raise bad_request(f"{name}={_shown(value)} is not supported by this server: it may be "
                              f"{' or '.join(_shown(a) for a in allowed)}{HINTS.get(name, '')}", name)
        if value is not None:
            raise bad_request(f"{name} is not a parameter this server knows: leave it out", name)
    options = body.get("stream_options")
    if isinstance(options, dict):
        for key, value in options.items():
            if key == "include_usage" or key == "continuous_usage_stats" and value in (None, False):
                continue
            raise bad_request(f"stream_options.{key} is not supported by this server", f"stream_options.{key}")


def check_messages(messages, declared) -> None:
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        for name, value in (m.items() if isinstance(m, dict) else ()):
            if name not in declared and not _asks_nothing(value):
                raise bad_request(f"messages[{i}].{name} is not supported by this server", f"messages[{i}].{name}")


def _asks_nothing(value) -> bool:
    return value in (None, False, 0, "") or value == [] or value == {}


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
