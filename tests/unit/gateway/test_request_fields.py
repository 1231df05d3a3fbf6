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
