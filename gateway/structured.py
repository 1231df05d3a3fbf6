"""Structured-output requests into SamplingParams.guided_kind / guided_spec, checked here so a
bad schema, regex or grammar is a 400 / INVALID_ARGUMENT, never a failed step. The executor
compiles and applies them (executor.logits_mask, xgrammar).

OpenAI: response_format {"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}; extensions (vLLM's names): guided_json (a schema),
guided_regex, guided_choice (list of strings), guided_grammar (EBNF/GBNF). At most one.
`strict` false is accepted and enforced all the same (the output always follows the schema).

Every spec is checked within a budget (gateway.grammar_budget: its size, and the time to
check and compile it, on a few worker threads) and compiled as the executor will compile it
(gateway.grammar_compile). A JSON schema is sent to the executor as `prepare` makes it:
normalized and checked (gateway.schema_support: a keyword the grammar engine would not enforce exactly is a 400
naming it) and bounded (gateway.schema_bounds: strings, arrays, numbers and open objects get
limits, so that an output can close within max_tokens; its outputs stay valid against the
schema the client sent).
"""
from __future__ import annotations

import json

from gateway import grammar_budget, grammar_compile, schema_bounds, schema_support

GUIDED_PARAMS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class GuidedError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check(kind: str, spec: str) -> None:
    """Raise ValueError if (kind, spec) does not compile: parsed, and with the model's
    tokenizer bound (gateway.grammar_compile) compiled as the executor will."""
    if kind:
        grammar_compile.compile_with_tokenizer(grammar_compile.grammar_of(kind, spec))


def from_openai(body: dict) -> tuple[str, str]:
    """(guided_kind, guided_spec) of an OpenAI request body; ("", "") when unconstrained."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise GuidedError("response_format.type must be text, json_object or json_schema",
                              "response_format")
        if rf["type"] == "json_object":
            found.append(("json_object", "", "response_format"))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise GuidedError("response_format.json_schema must be an object with a schema",
                                  "response_format")
            if "name" in js and not isinstance(js["name"], str):
                raise GuidedError("response_format.json_schema.name must be a string", "response_format")
            schema = js.get("schema") or {}
            found.append(("json_schema", json.dumps(schema), "response_format"))
    for name in GUIDED_PARAMS:
        value = body.get(name)
        if value is None:
            continue
        if name == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise GuidedError("guided_json must be a JSON schema", name) from None
            if not isinstance(value, dict):
                raise GuidedError("guided_json must be a JSON schema object", name)
            found.append(("json_schema", json.dumps(value), name))
        elif name == "guided_choice":
            found.append(("choice", json.dumps(value), name))
        elif not isinstance(value, str) or not value:
            raise GuidedError(f"{name} must be a non-empty string", name)
        else:
            found.append(("regex" if name == "guided_regex" else "grammar", value, name))
    if not found:
        return "", ""
    if len(found) > 1:
        raise GuidedError(f"give one of response_format and {', '.join(GUIDED_PARAMS)}, not "
                          f"{' and '.join(p for _, _, p in found)}", found[1][2])
    kind, spec, param = found[0]
    try:
        return kind, prepare(kind, spec)
    except grammar_budget.GrammarBusy:
        raise  # not the request's fault: the caller answers "busy, retry"
    except ValueError as e:
        raise GuidedError(f"{param}: {e}", param) from None


def prepare(kind: str, spec: str) -> str:
    """The spec to send to the executor for (kind, spec): a JSON schema normalized, checked
    and bounded, anything else as given; ValueError (naming the keyword) when it cannot be
    enforced exactly or does not compile, or (naming the budget and its flag) when it is
    over the grammar budget. Blocks the calling thread while a grammar worker does the work
    (gateway.grammar_budget), at most --grammar-compile-timeout seconds."""
    return grammar_budget.checks().run(kind, spec, _prepare)


def _prepare(kind: str, spec: str) -> str:
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"the schema is not JSON: {e}") from None
        except RecursionError:
            raise ValueError("the schema nests too deeply") from None
        if not isinstance(schema, dict):
            raise ValueError("the schema must be a JSON object")
        try:
            schema = schema_support.normalize(schema)
            schema_support.check(schema)
            spec = json.dumps(schema_bounds.bound(schema))
        except RecursionError:
            raise ValueError("the schema nests too deeply") from None
    check(kind, spec)
    return spec
