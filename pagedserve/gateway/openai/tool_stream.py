"""Tool calls streamed as vLLM streams them: each call's name as soon as it is whole, then its
arguments in fragments as the model writes them.

Contract: `ToolStream(tools)` follows one chat choice; `feed(text)` takes its next piece of
text and returns the deltas to send now, `finish()` the last ones and whether the output
called tools. A delta is {"content": text} (text outside the calls), {"tool_calls": [{"index",
"id", "type": "function", "function": {"name", "arguments": ""}}]} (a call begins), or
{"tool_calls": [{"index", "function": {"arguments": fragment}}]}. A call's fragments joined
are the model's own JSON text of its arguments (json.loads-equal to what
pagedserve.gateway.openai.tool_calls.parse gives the whole text, which decides at the end: a call the
stream could not follow comes whole in the last delta).
Formats, as `parse` reads them: forced choices (required, named) write JSON (a call object
or a list of them); auto streams Qwen/Hermes `<tool_call>` blocks; an auto output that starts
with `{` or `<|python_tag|>` (Llama 3.x JSON) is held and sent whole at the end.
Cost: linear in the output (each character is scanned once).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedserve.gateway.reasoning import partial_tag
from pagedserve.gateway.openai.tool_calls import (
    CLOSE_TAG,
    OPEN_TAG,
    Tools,
    _tagged,
    parse,
)

HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
PYTHON_TAG = "<|python_tag|>"


class _JsonEnd:
    """Where the JSON object or array starting at `text[start]` ends, found incrementally."""

    def __init__(self, start: int):
        self.start, self.at, self.depth, self.in_str, self.esc = start, start, 0, False, False

    def end(self, text: str) -> int | None:
        for i in range(self.at, len(text)):
            ch = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.at = i + 1
                    return i + 1
        self.at = len(text)
        return None


@dataclass
class _Call:
    name: str
    args_start: int
    sent: str = ""


class ToolStream:
    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""
        self.at = 0  # text[:at] is dealt with
        self.mode = "between" if tools.forced else "start"
        self.calls: list[_Call] = []
        self.sent_content = ""
        self.block = 0  # where the latest `<tool_call>` began
        self._obj: _JsonEnd | None = None  # the call object being read
        self._args: _JsonEnd | None = None  # its arguments

    def feed(self, text: str) -> list[dict]:
        self.text += text
        out: list[dict] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[dict]) -> bool:
        """Advance one state if the text allows; False when it must wait for more."""
        text, mode = self.text, self.mode
        if mode == "start":
            head = text.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return False
            self.mode = "hold" if head.startswith(("{", PYTHON_TAG)) else "content"
            return True
        if mode == "content":
            k = text.find(OPEN_TAG, self.at)
            end = k if k >= 0 else len(text) - partial_tag(text, OPEN_TAG)
            self._content(out, text[self.at:end])
            self.at = end
            if k < 0:
                return False
            self.block, self.at, self.mode = k, k + len(OPEN_TAG), "call"
            return True
        if mode in ("call", "between"):  # find the call object's `{`
            rest = text[self.at:]
            skip = " \t\r\n" + ("[]," if mode == "between" else "")
            i = next((j for j, ch in enumerate(rest) if ch not in skip), None)
            if i is None:
                self.at = len(text)
                return False
            self.at += i
            if rest[i] != "{":
                return self._hold()
            self._obj, self.mode = _JsonEnd(self.at), "header" if mode == "call" else "json header"
            return True
        if mode.endswith("header"):
            m = HEADER.match(text, self.at)
            if m is None:
                if self._obj.end(text) is not None or CLOSE_TAG in text[self.at:]:
                    return self._hold()
                return False
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                name = None
            if name not in self.tools.names:
                return self._hold()
            if m.end() >= len(text):
                return False
            if text[m.end()] != "{":  # arguments as a string
                return self._hold()
            index = len(self.calls)
            self.calls.append(_Call(name, m.end()))
            out.append({"tool_calls": [{"index": index, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            self._args, self.mode = _JsonEnd(m.end()), "args" if mode == "header" else "json args"
            return True
        if mode.endswith("args"):
            call = self.calls[-1]
            end = self._args.end(text)
            upto = len(text) if end is None else end
            fragment = text[call.args_start + len(call.sent):upto]
            if fragment:
                call.sent += fragment
                out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]})
            if end is None:
                return False
            self.at, self.mode = end, "tail" if mode == "args" else "json tail"
            return True
        if mode == "tail":  # skip to the end of the `<tool_call>` block
            k = text.find(CLOSE_TAG, self.at)
            if k < 0:
                return False
            self.at, self.mode = k + len(CLOSE_TAG), "content"
            return True
        if mode == "json tail":  # skip to the end of the call object
            end = self._obj.end(text)
            if end is None:
                return False
            self.at, self.mode = end, "between"
            return True
        return False  # hold: all at the end

    def _hold(self) -> bool:
        """A call this stream cannot follow: the rest (from its `<tool_call>`) waits for the end."""
        if not self.tools.forced:
            self.at = self.block
        self.mode = "hold"
        return True

    def _content(self, out: list[dict], text: str) -> None:
        if text:
            self.sent_content += text
            out.append({"content": text})

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas: the end of each call's arguments, calls the stream could not
        follow, content held back; and whether the output called tools."""
        _, calls = parse(self.text, self.tools)
        out: list[dict] = []
        if not calls:
            rest = self.text[len(self.sent_content):] if self.text.startswith(self.sent_content) else ""
            self._content(out, rest)
            return out, False
        for i, call in enumerate(calls):
            if i < len(self.calls) and self.calls[i].name == call["function"]["name"]:
                rest = self._rest_of_args(self.calls[i])
                if rest:
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": rest}}]})
            elif i >= len(self.calls):
                out.append({"tool_calls": [{"index": i, **call}]})
        tail = self.text[self.at:]
        if self.mode == "hold":
            tail = _tagged(tail)[1] if OPEN_TAG in tail else ""
        if self.mode in ("content", "hold") and tail.strip():
            self._content(out, tail)
        return out, True

    def _rest_of_args(self, call: _Call) -> str:
        try:
            _, end = json.JSONDecoder().raw_decode(self.text, call.args_start)
        except (ValueError, RecursionError):
            return ""
        raw = self.text[call.args_start:end]
        return raw[len(call.sent):] if raw.startswith(call.sent) else ""
