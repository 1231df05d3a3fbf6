"""pagedserve.gateway.openai.response costs what it sends: a prompt's prompt_logprobs (and echoed
logprobs) are made once and shared by its n choices, each token's text is decoded once per
response, and a choice's text and logprobs grow in place rather than being copied on every
delta; the shapes stay OpenAI's and vLLM's."""
import pytest

from pagedserve.gateway.openai.request import OpenAIRequest
from pagedserve.gateway.openai.response import Formatter
from pagedserve.wire.protocol import Delta, PromptLogprob, SamplingParams


class CountingTokenizer:
    """decode([t]) is "<t>"; counts the calls."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids):
        self.calls += 1
        return "".join(f"<{t}>" for t in ids)


def request(n=1, logprobs=None, prompt_logprobs=None, echo=False, stream=False, prompt=(1, 2, 3, 4)):
    sampling = SamplingParams(n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    req = OpenAIRequest(False, "m", [list(prompt)], sampling, stream=stream, echo=echo,
                        prompt_logprobs=prompt_logprobs)
    if echo:
        req.prompt_texts = ["".join(f"<{t}>" for t in prompt)]
    return req


def scored(prompt, k):
    """Prompt positions 1..: each token's entry with k alternatives."""
    return [PromptLogprob(t, -1.0 * i, 2, [(100 + j, -0.5) for j in range(k)]) for i, t in enumerate(prompt[1:], 1)]


def delta(index, token, first=None, finish=None):
    return Delta("r", index, f"<{token}>", [token], finish, [-0.25], [[(token, -0.25), (7, -1.5)]],
                 first or [], 4, 1)


def test_prompt_logprobs_are_made_once_and_shared_by_the_n_choices():
    prompt = list(range(10, 60))
    tok = CountingTokenizer()
    fmt = Formatter(request(n=8, prompt_logprobs=3, prompt=prompt), tok)
    entries = scored(prompt, 3)
    for i in range(8):
        fmt.add(i, delta(i, 5, first=entries, finish="length"))
    made = [c.prompt_logprobs for c in fmt.choices.values()]
    assert all(m is made[0] for m in made)  # one list for all eight
    assert made[0][0] is None and len(made[0]) == len(prompt)
    assert made[0][1] == {11: {"logprob": -1.0, "rank": 2, "decoded_token": "<11>"},
                          100: {"logprob": -0.5, "rank": 1, "decoded_token": "<100>"},
                          101: {"logprob": -0.5, "rank": 2, "decoded_token": "<101>"},
                          102: {"logprob": -0.5, "rank": 3, "decoded_token": "<102>"}}
    assert tok.calls == len(set(prompt[1:]) | {100, 101, 102})  # each token decoded once
    assert all(c["prompt_logprobs"] is made[0] for c in fmt.body()["choices"])


def test_logprobs_and_text_grow_in_place():
    fmt = Formatter(request(logprobs=1), CountingTokenizer())
    fmt.add(0, delta(0, 1))
    kept = fmt.choices[0].logprobs
    tokens = kept["tokens"]
    for t in range(2, 2001):
        fmt.add(0, delta(0, t % 50, finish="length" if t == 2000 else None))
    assert fmt.choices[0].logprobs is kept and kept["tokens"] is tokens  # extended, never copied
    assert len(tokens) == 2000 and kept["text_offset"][-1] == sum(len(s) for s in tokens[:-1])
    body = fmt.body()["choices"][0]
    assert body["text"] == "".join(tokens) and body["logprobs"]["top_logprobs"][1] == {"<2>": -0.25, "<7>": -1.5}


def test_a_stream_keeps_no_whole_logprobs_and_sends_each_delta_s_own():
    fmt = Formatter(request(logprobs=0, stream=True), CountingTokenizer())
    for t in range(3):
        fmt.add(0, delta(0, t))
        assert fmt.choices[0].last_logprobs["tokens"] == [f"<{t}>"]
    assert fmt.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_is_shared_yet_each_choice_gets_its_own(stream):
    prompt = [1, 2, 3, 4]
    fmt = Formatter(request(n=2, logprobs=1, prompt_logprobs=1, echo=True, stream=stream, prompt=prompt),
                    CountingTokenizer())
    entries = scored(prompt, 1)
    for i, token in ((0, 8), (1, 9)):
        fmt.add(i, delta(i, token, first=entries))
        fmt.add(i, delta(i, token + 10, finish="stop"))
    if stream:
        got = fmt.choices[1].last_logprobs
        assert got["tokens"] == ["<19>"] and got["text_offset"] == [len("<1><2><3><4><9>")]
        return
    for i, token in ((0, 8), (1, 9)):
        lp = fmt.body()["choices"][i]["logprobs"]
        assert lp["tokens"] == ["<1>", "<2>", "<3>", "<4>", f"<{token}>", f"<{token + 10}>"]
        assert lp["token_logprobs"][:2] == [None, -1.0] and lp["top_logprobs"][0] is None
        assert lp["text_offset"] == [0, 3, 6, 9, 12, 15]
        assert fmt.body()["choices"][i]["text"] == f"<1><2><3><4><{token}><{token + 10}>"
