"""pagedserve.gateway.reasoning: <think> reasoning split from the answer, whole and streamed in
pieces of every size, the two ways agreeing."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.gateway.reasoning import ReasoningStream, split

CASES = [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "Paris.")),
    ("qwen3", "Paris.", (None, "Paris.")),  # enable_thinking false: no <think>
    ("qwen3", "  <thi", (None, "  <thi")),
    ("qwen3", "<think>still thinking", ("still thinking", None)),  # cut off while thinking
    ("qwen3", "<think></think>Hi", ("", "Hi")),
    ("deepseek_r1", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),  # <think> was in the prompt
    ("deepseek_r1", "<think>Hmm</think>\nParis.", ("Hmm", "Paris.")),
    ("deepseek_r1", "still thinking </thin", ("still thinking </thin", None)),
    ("deepseek_r1", "", ("", None)),
]


@pytest.mark.parametrize("parser,text,want", CASES)
def test_split(parser, text, want):
    assert split(parser, text) == want


def streamed(parser, text, sizes):
    s, reasoning, answer, at, i = ReasoningStream(parser), "", "", 0, 0
    while at < len(text):
        r, a = s.feed(text[at:at + sizes[i % len(sizes)]])
        reasoning, answer = reasoning + r, answer + a
        at, i = at + sizes[i % len(sizes)], i + 1
    r, a = s.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("parser,text,want", CASES)
def test_streamed_one_character_at_a_time_gives_the_same(parser, text, want):
    assert streamed(parser, text, (1,)) == tuple(x or "" for x in want)


def test_only_a_possible_tag_is_held_back():
    s = ReasoningStream("qwen3")
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>I think </th") == ("I think ", "")
    assert s.feed("ink>\n") == ("", "")
    assert s.feed("\nAnswer") == ("", "Answer")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["qwen3", "deepseek_r1"]), st.lists(st.integers(1, 6), min_size=1, max_size=4),
       st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "a", " ", "\n", "</"]), max_size=10))
def test_any_output_in_any_pieces_agrees_with_split(parser, sizes, parts):
    text = "".join(parts)
    assert streamed(parser, text, tuple(sizes)) == tuple(x or "" for x in split(parser, text))


def chat_response(pieces, stream, reasoning="qwen3", include=True, tools=None):
    import json

    from pagedserve.gateway.openai.request import OpenAIRequest
    from pagedserve.gateway.openai.response import Formatter
    from pagedserve.wire.protocol import Delta, SamplingParams

    req = OpenAIRequest(True, "m", [[1]], SamplingParams(), stream=stream, reasoning=reasoning,
                        include_reasoning=include, tools=tools)
    fmt, events = Formatter(req), []
    for i, text in enumerate(pieces):
        d = Delta("r", 0, text, [i], "stop" if i == len(pieces) - 1 else None, completion_tokens=i + 1)
        fmt.add(0, d)
        events += fmt.chunks(0, d) if stream else []
    if not stream:
        return fmt.body()["choices"][0]
    return [json.loads(e[len("data: "):]) for e in events]


PIECES = ["<thi", "nk>The user", " wants Paris.</th", "ink>\n\n", "Paris", " it is."]


def test_the_chat_body_gives_reasoning_content_beside_the_answer():
    choice = chat_response(PIECES, stream=False)
    assert choice["message"] == {"role": "assistant", "content": "Paris it is.",
                                 "reasoning_content": "The user wants Paris."}
    assert chat_response(PIECES, stream=False, reasoning=None)["message"]["content"] == "".join(PIECES)
    assert "reasoning_content" not in chat_response(PIECES, stream=False, include=False)["message"]


def test_the_stream_gives_delta_reasoning_content_then_content():
    chunks = chat_response(PIECES, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants Paris."
    assert "".join(d.get("content") or "" for d in deltas) == "Paris it is."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_are_read_from_the_answer_only():
    from pagedserve.gateway.openai.tool_calls import Tools

    tools = Tools([{"name": "f", "description": "", "parameters": {}}], names={"f"})
    pieces = ["<think>I could call <tool_call>{\"name\": \"f\"}</tool_call>?</think>",
              '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>']
    choice = chat_response(pieces, stream=False, tools=tools)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"].startswith("I could call")
    chunks = chat_response(pieces, stream=True, tools=tools)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "f" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_grpc_message_with_a_whole_output_is_split_as_the_http_body():
    from pagedserve.gateway.generation_service import to_response
    from pagedserve.wire.protocol import Delta

    text = "".join(PIECES)
    r = to_response(Delta("r", 0, text, [1, 2], "stop"), "r", ReasoningStream("qwen3"))
    assert (r.reasoning, r.text) == split("qwen3", text) == ("The user wants Paris.", "Paris it is.")
    r = to_response(Delta("r", 0, text, [1, 2], "stop"), "r")  # no parser: the text as written
    assert (r.reasoning, r.text) == ("", text)
