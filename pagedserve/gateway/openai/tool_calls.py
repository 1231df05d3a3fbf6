"""Tool calling on the chat API: tools and tool_choice in, tool calls parsed out.

Contract:
- `parse_tools(body)` checks `tools` (function tools: name, description, parameters as a
  JSON schema), `tool_choice` (auto by default when tools are given; none; required; or
  {"type": "function", "function": {"name"}}) and `parallel_tool_calls` (default true).
- `render(messages, tools, tokenizer)` renders the conversation through the model's chat
  template, `tool` role messages and assistant `tool_calls` included: a template that
  knows tools gets them (`tools=`, `tool_calls` on messages); for one that does not, the
  tools are described in the system message in the Hermes/Qwen format (each call as
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>), and earlier calls are written
  the same way into the assistant's content.
- `guided(tools)`: with tool_choice required or a named function, the grammar (a JSON
  schema) that forces the output to be the call(s) as JSON: a named call is one object
  {"name", "arguments"}; required is a list of them (one item unless parallel calls).
- `parse(text, tools)` -> (content, calls): forced choices parse the JSON; auto finds the
  model's own format: Qwen2.5/Qwen3/Hermes `<tool_call>{...}</tool_call>` blocks, or Llama
  3.x JSON `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`, several
  separated by `;`). Calls to unknown functions are left in the content as text. Linear in
  the output's length.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pagedserve.gateway.openai.errors import bad_request


@dataclass
class Tools:
    functions: list[dict]  # [{"name", "description", "parameters"}]
    choice: str = "auto"  # auto | none | required | named
    name: str | None = None  # the named function
    parallel: bool = True
    names: set[str] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def parse_tools(body: dict) -> Tools | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list of function tools", "tools")
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}",
                              "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              "tools")
        functions.append({"name": fn["name"], "description": fn.get("description") or "",
                          "parameters": params})
    names = {f["name"] for f in functions}
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    out = Tools(functions, parallel=parallel is not False, names=names)
    if choice is None or choice in ("auto", "none", "required"):
        out.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict) and choice["function"].get("name") in names:
        out.choice, out.name = "named", choice["function"]["name"]
    else:
        raise bad_request("tool_choice must be auto, none, required or {type: function, function: "
                          "{name}} naming one of the tools", "tool_choice")
    return out


def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def guided(tools: Tools) -> tuple[str, str]:
    """(guided_kind, guided_spec) forcing the call(s); ("", "") for auto and none."""
    if tools.choice == "named":
        fn = next(f for f in tools.functions if f["name"] == tools.name)
        return "json_schema", json.dumps(_call_schema(fn))
    if tools.choice == "required":
        item = {"anyOf": [_call_schema(f) for f in tools.functions]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if not tools.parallel:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema)
    return "", ""


def system_prompt(tools: Tools) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in tools.functions)
    return ("You are a function calling AI model. You may call one or more functions to assist "
            "with the user query. The functions are described within <tools></tools>:\n<tools>\n"
            f"{listed}\n</tools>\nFor each function call, return a JSON object with the function name "
            "and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render(messages: list[dict], tools: Tools | None, tokenizer,
           template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the conversation (OpenAI message dicts) through the chat template, with
    the request's chat_template_kwargs."""
    template = getattr(tokenizer, "chat_template", None) or ""
    knows_tools = "tools" in template
    knows_calls = "tool_calls" in template
    msgs = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            norm = []
            for c in calls:
                fn = c.get("function", {}) if isinstance(c, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                norm.append({"name": fn.get("name", ""), "arguments": args, "id": c.get("id")})
            if knows_calls:
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}}
                                   for c in norm]
            else:
                m.pop("tool_calls")
                text = "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]})
                                 + "\n</tool_call>" for c in norm)
                m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + text)
        if m.get("role") == "tool" and not knows_calls:
            m = {"role": "tool", "content": "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"}
        if m.get("content") is None:
            m["content"] = ""
        msgs.append(m)
    kwargs = dict(template_kwargs or {})
    if tools is not None and tools.active:
        if knows_tools:
            kwargs["tools"] = [{"type": "function", "function": f} for f in tools.functions]
        else:
            prompt = system_prompt(tools)
            if msgs and msgs[0].get("role") == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + prompt}
            else:
                msgs.insert(0, {"role": "system", "content": prompt})
    try:
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **kwargs))
    except Exception as e:
        raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None


def _call(name: str, arguments) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


def _tagged(text: str) -> tuple[list[str], str]:
    """The `<tool_call>` blocks of `text`, stripped (the last may run to the end, unclosed),
    and the text outside them; one pass, with no regex (which backtracked quadratically over
    long runs of whitespace)."""
    blocks, outside, at = [], [], 0
    while (start := text.find(OPEN_TAG, at)) != -1:
        outside.append(text[at:start])
        body = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body)
        if end == -1:
            blocks.append(text[body:].strip())
            at = len(text)
            break
        blocks.append(text[body:end].strip())
        at = end + len(CLOSE_TAG)
    outside.append(text[at:])
    return blocks, "".join(outside)


def _from_obj(obj, tools: Tools) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    return _call(obj["name"], args)


def parse(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a completed assistant output."""
    if tools.forced:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            return text, []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [c for c in (_from_obj(o, tools) for o in objs) if c]
        return (None, calls) if calls else (text, [])
    calls, rest = [], text
    if OPEN_TAG in text:  # Qwen2.5 / Qwen3 / Hermes
        blocks, outside = _tagged(text)
        for block in blocks:
            try:
                call = _from_obj(json.loads(block), tools)
            except (ValueError, RecursionError):
                call = None
            if call:
                calls.append(call)
        if calls:
            rest = outside.strip()
            if "<think>" in rest or "</think>" in rest:
                rest = rest.strip()
            return rest or None, calls
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if body.startswith("{"):  # Llama 3.x JSON tool calls, `;`-separated
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return text, []
            call = _from_obj(obj, tools)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return None, calls
    return text, []
