"""Today's request fields at the OpenAI API's edge (pagedserve.gateway.openai.request): min_tokens and
logit_bias become SamplingParams or a 400 naming the field."""
import pytest

from tests.unit.gateway.test_openai_bodies import ASK, parse, refused


def test_min_tokens_and_logit_bias_reach_the_sampling():
    r = parse({"messages": ASK, "min_tokens": 30, "logit_bias": {"7": -100, "50": 2.5}})
    assert r.sampling.min_tokens == 30 and r.sampling.max_tokens > 30  # chat: the rest of the context
    assert r.sampling.logit_bias == {7: -100.0, 50: 2.5}
    assert parse({"prompt": "x", "logit_bias": {}}).sampling.logit_bias == {}


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "min_tokens": 17}, "min_tokens", "at most max_tokens (16)"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", "between 0"),
    ({"prompt": "x", "logit_bias": {"7": 101}}, "logit_bias[7]", "in [-100, 100]"),
    ({"prompt": "x", "logit_bias": {"seven": 1}}, "logit_bias['seven']", "token ids"),
    ({"prompt": "x", "logit_bias": {"7": "up"}}, "logit_bias[7]", "a number"),
    ({"prompt": "x", "logit_bias": {"1000": 1}}, "logit_bias", "outside the vocabulary [0, 1000)"),
    ({"messages": ASK, "logit_bias": [1]}, "logit_bias", "an object"),
    ({"prompt": "x", "request_id": "r" * 1025}, "request_id", "at most 1024 characters"),
])
def test_bad_values_are_refused_naming_the_field(body, param, words):
    e = refused(body)
    assert e.param == param and words in e.message, e.message


class RecordingTokenizer:
    """Renders with the keyword arguments it was given recorded."""

    chat_template = "{{ x }}{{ tools }}"  # a template that takes tools

    def __init__(self):
        self.kwargs = None

    def encode(self, text, add_special_tokens=False):
        return [1] * len(text)

    def apply_chat_template(self, messages, **kw):
        self.kwargs = kw
        return [1, 2, 3]


@pytest.mark.parametrize("tools", [False, True])
def test_chat_template_kwargs_reach_the_template(tools):
    tok = RecordingTokenizer()
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False, "x": [1]}}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    parse(body, tok)
    assert tok.kwargs["enable_thinking"] is False and tok.kwargs["x"] == [1]
    assert tok.kwargs["tokenize"] is True and ("tools" in tok.kwargs) == tools  # the server's own


@pytest.mark.parametrize("value,words", [({"tokenize": False}, "chat_template_kwargs.tokenize is set by the server"),
                                         ({"tools": []}, "chat_template_kwargs.tools"),
                                         ([1], "must be an object")])
def test_chat_template_kwargs_the_server_sets_are_refused(value, words):
    e = refused({"messages": ASK, "chat_template_kwargs": value}, RecordingTokenizer())
    assert e.param == "chat_template_kwargs" and words in e.message, e.message


def test_chat_template_file_is_read_and_checked(tmp_path):
    from pagedserve.gateway import chat_template
    from pagedserve.gateway.config import GatewayConfig

    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{% if loop.index > 9 %}{% break %}{% endif %}{{ m.content }}"
                    "{% endfor %}")
    assert chat_template.load(GatewayConfig(chat_template=str(good)).chat_template) == good.read_text()
    assert chat_template.load(GatewayConfig().chat_template) is None
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for path, words in ((bad, "not a Jinja template"), (tmp_path / "none.jinja", "cannot read it")):
        with pytest.raises(ValueError, match=f"--chat-template {path}: {words}"):
            chat_template.load(str(path))


def test_the_gateway_will_not_start_with_a_bad_chat_template(tmp_path, capfd):
    import asyncio

    from pagedserve.gateway.config import GatewayConfig
    from pagedserve.gateway.main import serve

    assert asyncio.run(serve(GatewayConfig(chat_template=str(tmp_path / "none.jinja")))) == 1
    assert "--chat-template" in capfd.readouterr().err


# -- every field of OpenAI's and vLLM's request schemas: acted on, or refused by name ---------
# OpenAI's chat.completions.create and completions.create parameters, and vLLM's
# ChatCompletionRequest and CompletionRequest fields (vllm/entrypoints/openai/*protocol.py)
OPENAI_CHAT = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
               "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
               "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
               "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
               "verbosity", "web_search_options"}
OPENAI_COMPLETIONS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                      "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                      "temperature", "top_p", "user"}
VLLM_BOTH = {"use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
             "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
             "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
             "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
             "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
             "kv_transfer_params", "vllm_xargs", "best_of"}
VLLM_CHAT = VLLM_BOTH | {"bad_words", "echo", "add_generation_prompt", "continue_final_message", "documents",
                         "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs",
                         "structural_tag", "include_reasoning", "reasoning_effort", "thinking_token_budget",
                         "watermarking", "truncation_side", "logprob_token_ids", "session_id", "repetition_detection",
                         "stream_interval", "return_prompt_text", "return_token_offsets", "return_mm_kwargs",
                         "ec_transfer_params", "routed_experts_prompt_start"}
VLLM_COMPLETIONS = VLLM_BOTH | {"prompt_embeds", "echo"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# a value of each field that asks for something, and what else the body needs for it
ASKING = {
    "messages": [{"role": "user", "content": "other"}], "prompt": "other", "audio": {"voice": "alloy"},
    "frequency_penalty": 0.5, "function_call": "auto", "functions": [{"name": "f"}], "logit_bias": {"5": 1},
    "logprobs": True, "max_completion_tokens": 5, "max_tokens": 5, "metadata": {"k": "v"},
    "modalities": ["text", "audio"], "n": 2, "parallel_tool_calls": (False, {"tools": [TOOL]}),
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5, "prompt_cache_key": "k",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "u", "seed": 3,
    "service_tier": "flex", "stop": ["x"], "store": True, "stream": True,
    "stream_options": ({"include_usage": True}, {"stream": True}), "temperature": 0.5,
    "tool_choice": ("none", {"tools": [TOOL]}), "tools": [TOOL], "top_logprobs": (2, {"logprobs": True}),
    "top_p": 0.5, "user": "u", "verbosity": "low", "web_search_options": {"search_context_size": "low"},
    "best_of": 3, "echo": True, "suffix": "x", "use_beam_search": True, "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.1, "length_penalty": 0.5, "stop_token_ids": [5], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5, "allowed_token_ids": [1], "prompt_logprobs": 1, "add_special_tokens": True,
    "structured_outputs": {"choice": ["a", "b"]}, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a"], "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "priority": 1, "request_id": "r1", "logits_processors": ["x"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "s", "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "bad_words": ["x"], "add_generation_prompt": False, "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1}, "media_io_kwargs": {"image": {"a": 1}}, "structural_tag": "x",
    "include_reasoning": False, "thinking_token_budget": 10, "watermarking": True, "truncation_side": "left",
    "logprob_token_ids": [1], "session_id": "s", "repetition_detection": {"a": 1}, "stream_interval": 4,
    "return_prompt_text": True, "return_token_offsets": True, "return_mm_kwargs": False,
    "ec_transfer_params": {"a": 1}, "routed_experts_prompt_start": 2, "prompt_embeds": "abc",
    "unknown_field": 1,
}
ASKING_COMPLETIONS = {**ASKING, "logprobs": 2}  # an integer there: the top k
HONOURED_CHAT = {"messages", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens",
                 "n", "parallel_tool_calls", "presence_penalty", "response_format", "seed", "stop", "stream",
                 "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "top_k",
                 "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "ignore_eos", "min_tokens",
                 "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "priority", "request_id", "cache_salt", "chat_template_kwargs", "include_reasoning"}
HONOURED_COMPLETIONS = (HONOURED_CHAT - {"messages", "max_completion_tokens", "parallel_tool_calls", "tool_choice",
                                         "tools", "top_logprobs", "chat_template_kwargs",
                                         "include_reasoning"}) | {"prompt", "echo", "prompt_logprobs"}


class TemplateTokenizer:
    """Renders the messages and every template argument into the tokens, so a change shows."""

    chat_template = "{{ messages }}{{ tools }}"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 1000 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, **kw):
        return [ord(c) % 1000 for c in repr(messages) + repr(sorted(kw.items(), key=str))][:1000]


def what_it_does(r):
    import dataclasses

    return (r.prompts, dataclasses.asdict(r.sampling), r.stream, r.include_usage, r.user, r.echo,
            r.tools and (r.tools.choice, r.tools.parallel), r.priority, r.cache_salt, r.prompt_logprobs,
            r.include_reasoning, r.request_id)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_field_of_openais_and_vllms_schemas_is_honoured_or_refused_by_name(chat):
    from pagedserve.gateway.openai.errors import OpenAIError

    names = (OPENAI_CHAT | VLLM_CHAT) if chat else (OPENAI_COMPLETIONS | VLLM_COMPLETIONS)
    names = (names | {"unknown_field"}) - {"model"}  # model: another model's name is a 404 (test_openai_http)
    base = {"messages": ASK} if chat else {"prompt": "x"}
    honoured, refused_names = set(), set()
    for name in sorted(names):
        asking = (ASKING if chat else ASKING_COMPLETIONS)[name]
        value, extra = asking if isinstance(asking, tuple) else (asking, {})
        before = what_it_does(parse({**base, **extra}, TemplateTokenizer()))
        try:
            after = what_it_does(parse({**base, **extra, name: value}, TemplateTokenizer()))
        except OpenAIError as e:
            assert e.status == 400 and e.param.split(".")[0].split("[")[0] == name, (name, e.message)
            refused_names.add(name)
            continue
        assert after != before, f"{name} was accepted and changed nothing: act on it or refuse it"
        honoured.add(name)
    assert honoured == (HONOURED_CHAT if chat else HONOURED_COMPLETIONS)
    assert "unknown_field" in refused_names and "logit_bias" in honoured and "min_tokens" in honoured


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"messages": ASK, "skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_values_that_ask_more_than_is_done_are_refused(body, param):
    e = refused(body)
    assert e.param == param


@pytest.mark.parametrize("body", [
    {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
    {"messages": ASK, "skip_special_tokens": True, "add_generation_prompt": True, "echo": False, "store": False,
     "service_tier": "auto", "metadata": {}, "functions": [], "logits_processors": None, "unknown": None},
    {"prompt": "x", "use_beam_search": False, "include_stop_str_in_output": False, "suffix": ""},
])
def test_values_that_ask_for_what_is_done_anyway_are_accepted(body):
    parse(body)


class MessagesTokenizer(RecordingTokenizer):
    def apply_chat_template(self, messages, **kw):
        self.messages = messages
        return [1, 2, 3]


def test_message_fields_reach_the_template_or_are_refused_by_name():
    tok = MessagesTokenizer()
    history = [{"role": "user", "content": "hi", "name": "ann"},
               {"role": "assistant", "content": "Paris.", "reasoning": "they asked", "refusal": None,
                "annotations": []},
               {"role": "user", "content": "why?"}]
    parse({"messages": history}, tok)
    assert tok.messages[0]["name"] == "ann" and tok.messages[1]["reasoning_content"] == "they asked"
    assert "refusal" not in tok.messages[1]
    e = refused({"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]}, tok)
    assert e.param == "messages[0].audio" and "not supported" in e.message
