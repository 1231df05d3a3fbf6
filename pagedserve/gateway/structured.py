"""Structured-output requests into SamplingParams.guided_kind / guided_spec, checked here so a
bad schema, regex or grammar is a 400 / INVALID_ARGUMENT, never a failed step. The executor
compiles and applies them (pagedserve.executor.logits_mask, xgrammar).

OpenAI: response_format {"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}; extensions (vLLM's names): structured_outputs {"json",
"regex", "choice", "grammar", "json_object", "structural_tag"} (vLLM's form since it
removed guided_*), equal in effect to guided_json (a schema), guided_regex, guided_choice
(list of strings), guided_grammar (EBNF/GBNF), and response_format {"type":
"structural_tag"}. At most one. `strict` false is accepted and enforced all the same (the
output always follows the schema). A structural tag is xgrammar's ({"format": ...}) or
vLLM's older form ({"structures": [{"begin", "schema", "end"}], "triggers"}), rewritten
into xgrammar's. structured_outputs' options: disable_fallback and disable_any_whitespace
are what this server always does (no fallback engine; JSON without free whitespace) and are
accepted either way; any other option that would change the output is refused by name.

Every spec is checked within a budget (pagedserve.gateway.grammar_budget: its size, and the time to
check and compile it, on a few worker threads) and compiled as the executor will compile it
(pagedserve.gateway.grammar_compile). A JSON schema is sent to the executor as `prepare` makes it:
normalized and checked (pagedserve.gateway.schema_support: a keyword the grammar engine would not enforce exactly is a 400
naming it) and bounded (pagedserve.gateway.schema_bounds: strings, arrays, numbers and open objects get
limits, so that an output can close within max_tokens; its outputs stay valid against the
schema the client sent).
"""
from __future__ import annotations

import json

from pagedserve.gateway import (
    grammar_budget,
    grammar_compile,
    schema_bounds,
    schema_support,
)

GUIDED_PARAMS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs' constraints, each the kind a guided_* field gives
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object", "structural_tag": "structural_tag"}
# structured_outputs' options: the values this server honours (its only behaviour)
STRUCTURED_OPTIONS = {"disable_fallback": (True, False), "disable_any_whitespace": (True, False),
                      "disable_additional_properties": (False,), "whitespace_pattern": (),
                      "backend": ("xgrammar", "auto")}


class GuidedError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check(kind: str, spec: str) -> None:
    """Raise ValueError if (kind, spec) does not compile: parsed, and with the model's
    tokenizer bound (pagedserve.gateway.grammar_compile) compiled as the executor will."""
    if kind:
        grammar_compile.compile_with_tokenizer(grammar_compile.grammar_of(kind, spec))


def from_openai(body: dict) -> tuple[str, str]:
    """(guided_kind, guided_spec) of an OpenAI request body; ("", "") when unconstrained."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        found += _response_format(rf)
    found += _structured_outputs(body.get("structured_outputs"))
    for name in GUIDED_PARAMS:
        value = body.get(name)
        if value is not None:
            kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                    "guided_grammar": "grammar"}[name]
            found.append((kind, _spec(kind, value, name), name))
    if not found:
        return "", ""
    if len(found) > 1:
        raise GuidedError(f"give one of response_format, structured_outputs and {', '.join(GUIDED_PARAMS)}, "
                          f"not {' and '.join(p for _, _, p in found)}", found[1][2])
    kind, spec, param = found[0]
    try:
        return kind, prepare(kind, spec)
    except grammar_budget.GrammarBusy:
        raise  # not the request's fault: the caller answers "busy, retry"
    except ValueError as e:
        raise GuidedError(f"{param}: {e}", param) from None


def _response_format(rf) -> list[tuple[str, str, str]]:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema", "structural_tag"):
        raise GuidedError("response_format.type must be text, json_object, json_schema or structural_tag",
                          "response_format")
    if rf["type"] == "json_object":
        return [("json_object", "", "response_format")]
    if rf["type"] == "structural_tag":
        return [("structural_tag", _spec("structural_tag", rf, "response_format"), "response_format")]
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise GuidedError("response_format.json_schema must be an object with a schema",
                              "response_format")
        if "name" in js and not isinstance(js["name"], str):
            raise GuidedError("response_format.json_schema.name must be a string", "response_format")
        return [("json_schema", json.dumps(js.get("schema") or {}), "response_format")]
    return []


def _structured_outputs(so) -> list[tuple[str, str, str]]:
    """The constraints of vLLM's structured_outputs object (at most one is allowed)."""
    if so is None:
        return []
    if not isinstance(so, dict):
        raise GuidedError("structured_outputs must be an object", "structured_outputs")
    found = []
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if value is None:
            continue
        if key in STRUCTURED_KINDS:
            if key == "json_object":
                if not isinstance(value, bool):
                    raise GuidedError(f"{param} must be a boolean", param)
                if value:
                    found.append(("json_object", "", param))
                continue
            kind = STRUCTURED_KINDS[key]
            found.append((kind, _spec(kind, value, param), param))
        elif key in STRUCTURED_OPTIONS:
            allowed = STRUCTURED_OPTIONS[key]
            if value not in allowed:
                can = (f"it may be {' or '.join(json.dumps(a) for a in allowed)}" if allowed
                       else "leave it out")
                raise GuidedError(f"{param}={json.dumps(value)} is not supported by this server: {can}", param)
        else:
            raise GuidedError(f"{param} is not a structured_outputs field this server knows: give one of "
                              f"{', '.join(STRUCTURED_KINDS)}", param)
    return found


def _spec(kind: str, value, param: str) -> str:
    """The spec text of one constraint as a request gives it."""
    if kind == "json_schema":
        return json.dumps(_json_object(value, param, "a JSON schema"))
    if kind == "choice":
        return json.dumps(value)
    if kind == "structural_tag":
        return structural_tag(value, param)
    if not isinstance(value, str) or not value:
        raise GuidedError(f"{param} must be a non-empty string", param)
    return value


def _json_object(value, param: str, what: str) -> dict:
    """`value` as a JSON object, given as one or as its text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise GuidedError(f"{param} must be {what} (JSON)", param) from None
    if not isinstance(value, dict):
        raise GuidedError(f"{param} must be {what} object", param)
    return value


def structural_tag(value, param: str) -> str:
    """A structural tag as xgrammar's JSON: given so ({"format": ...}), or rewritten from vLLM's
    older form ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})."""
    value = _json_object(value, param, "a structural tag")
    if "format" in value:
        return json.dumps({"type": "structural_tag", "format": value["format"]})
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
            isinstance(t, dict) and isinstance(t.get("begin"), str) and isinstance(t.get("end"), str)
            and isinstance(t.get("schema", {}), dict) for t in structures):
        raise GuidedError(f"{param} must hold format, or structures (each begin, schema, end) and triggers",
                          param)
    tags = [{"type": "tag", "begin": t["begin"], "end": t["end"],
             "content": {"type": "json_schema", "json_schema": t.get("schema") or {}}} for t in structures]
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}})


def prepare(kind: str, spec: str) -> str:
    """The spec to send to the executor for (kind, spec): a JSON schema normalized, checked
    and bounded, anything else as given; ValueError (naming the keyword) when it cannot be
    enforced exactly or does not compile, or (naming the budget and its flag) when it is
    over the grammar budget. Blocks the calling thread while a grammar worker does the work
    (pagedserve.gateway.grammar_budget), at most --grammar-compile-timeout seconds."""
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
