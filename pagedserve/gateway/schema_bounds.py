"""Bounds on what a JSON schema leaves unbounded, so that a constrained output can close
within a few hundred tokens: `bound(schema)` returns a copy whose instances are a subset of
the original's (every output valid against the bounded schema is valid against the
original), with

- maxLength on strings that have no length, pattern, format, enum or const (MAX_STRING),
- maxItems on arrays that have none (MAX_ITEMS, at least minItems and the prefixItems),
- maxProperties on objects that admit undeclared keys (the declared ones + MAX_EXTRA_KEYS),
- minimum / maximum on integers and numbers that have none (+-MAX_NUMBER, widened to the
  other bound).

Why: a small model under greedy decoding repeats itself, and an unbounded string, array or
number lets it repeat until max_tokens (see docs/benchmark-history.md, "Real-world schemas").
"""
from __future__ import annotations

import copy

from pagedserve.gateway.schema_walk import walk

MAX_STRING = 48
MAX_ITEMS = 4
MAX_EXTRA_KEYS = 4
MAX_NUMBER = 10 ** 9


def bound(schema: dict) -> dict:
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        types = _types(node)
        if types is None or any(k in node for k in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")):
            continue
        if "string" in types and not any(k in node for k in ("maxLength", "pattern", "format")):
            node["maxLength"] = max(_int(node.get("minLength")), MAX_STRING)
        if "array" in types and "maxItems" not in node:
            prefix = node.get("prefixItems")
            node["maxItems"] = max(_int(node.get("minItems")), len(prefix) if isinstance(prefix, list) else 0,
                                   MAX_ITEMS)
        if "object" in types and "maxProperties" not in node and (
                node.get("additionalProperties") not in (None, False) or node.get("patternProperties")):
            declared = node.get("properties")
            node["maxProperties"] = max(_int(node.get("minProperties")),
                                        (len(declared) if isinstance(declared, dict) else 0) + MAX_EXTRA_KEYS)
        if types & {"integer", "number"}:
            low = _num(node.get("minimum", node.get("exclusiveMinimum")))
            high = _num(node.get("maximum", node.get("exclusiveMaximum")))
            if low is None:
                node["minimum"] = min(-MAX_NUMBER, high if high is not None else 0)
            if high is None:
                node["maximum"] = max(MAX_NUMBER, low if low is not None else 0)
    return schema


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _num(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
