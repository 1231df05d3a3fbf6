"""pagedserve.gateway.openai.tool_stream: tool calls streamed as vLLM streams them (the name, then the
arguments in fragments), fed in pieces of every size; what the stream gives equals what
tool_calls.parse gives the whole text."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.gateway.openai.tool_calls import Tools, parse
from pagedserve.gateway.openai.tool_stream import ToolStream

TOOLS = Tools([{"name": "get_weather", "description": "", "parameters": {}},
               {"name": "g", "description": "", "parameters": {}}], names={"get_weather", "g"})
NAMED = Tools(TOOLS.functions, choice="named", name="get_weather", names=TOOLS.names)
REQUIRED = Tools(TOOLS.functions, choice="required", names=TOOLS.names)
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", '
          '"unit": ["c", {"x": 1}]}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')


def run(text, tools, sizes=(1,)):
    """Feed `text` in pieces of the given sizes (cycled); the deltas and whether it called."""
    stream, deltas, at, i = ToolStream(tools), [], 0, 0
    while at < len(text):
        n = sizes[i % len(sizes)]
        deltas += stream.feed(text[at:at + n])
        at, i = at + n, i + 1
    last, called = stream.finish()
    return deltas, last, called


def assembled(deltas):
    """The content and the calls (id, name, joined arguments) a client puts together."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.get("id") or call["id"]
            call["name"] += tc.get("function", {}).get("name", "")
            call["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def same_as_parse(text, tools, deltas):
    content, calls = assembled(deltas)
    want_content, want = parse(text, tools)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
           [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want]
    assert all(c["id"] for c in calls)
    assert content.strip() == (want_content or "").strip() if want else content == text
    return calls


@pytest.mark.parametrize("sizes", [(1,), (3, 7), (1000,)])
def test_hermes_blocks_stream_the_name_then_argument_fragments(sizes):
    deltas, last, called = run(HERMES, TOOLS, sizes)
    assert called
    calls = same_as_parse(HERMES, TOOLS, deltas + last)
    assert calls[0]["arguments"] == '{"city": "Pa\\"ris}", "unit": ["c", {"x": 1}]}'  # the model's own text
    if sizes == (1,):
        pieces = [d for d in deltas if "tool_calls" in d and d["tool_calls"][0]["index"] == 0]
        assert pieces[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
        assert len(pieces) > 10  # the arguments came as they were written, before the end
        assert deltas[0] == {"content": "L"}


@pytest.mark.parametrize("text,tools", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', NAMED),
    ('[{"name": "g", "arguments": {}}, {"name": "get_weather", "arguments": {"a": [1, "]}"]}}]', REQUIRED),
])
def test_forced_calls_stream_too(text, tools):
    deltas, last, called = run(text, tools)
    assert called and same_as_parse(text, tools, deltas + last)
    assert any("tool_calls" in d for d in deltas)  # before the finish


def test_text_without_calls_is_content_as_it_comes_holding_back_only_a_tag_prefix():
    text = "Hello <b>world</b> <tool"
    deltas, last, called = run(text, TOOLS)
    assert not called and assembled(deltas + last)[0] == text
    assert assembled(deltas)[0] == "Hello <b>world</b> "


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',  # Llama 3.x: held, sent whole
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call> after',  # unknown: stays content
    '<tool_call>{"arguments": {}, "name": "g"}</tool_call>',  # name last: sent whole at the end
    '<tool_call>{"name": "g", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as a string
])
def test_what_the_stream_cannot_follow_comes_whole_at_the_end(text):
    deltas, last, _ = run(text, TOOLS)
    same_as_parse(text, TOOLS, deltas + last)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=5),
       st.lists(st.sampled_from(["hi ", "<tool_call>", "</tool_call>", '{"name": "g", "arguments": ',
                                 '{"a": "}"}', "}", "\n", '"x"', "[", "]"]), max_size=12))
def test_any_output_in_any_pieces_never_crashes_and_ends_as_parse_says(sizes, parts):
    text = "".join(parts)
    _, _, called = run(text, TOOLS, tuple(sizes))
    assert called == bool(parse(text, TOOLS)[1])
