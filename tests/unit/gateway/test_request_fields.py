"""Today's request fields at the OpenAI API's edge (gateway.openai.request): min_tokens and
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
    from gateway import chat_template
    from gateway.config import GatewayConfig

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

    from gateway.config import GatewayConfig
    from gateway.main import serve

    assert asyncio.run(serve(GatewayConfig(chat_template=str(tmp_path / "none.jinja")))) == 1
    assert "--chat-template" in capfd.readouterr().err
