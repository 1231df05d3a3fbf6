"""Equivalent forms of a JSON schema that the grammar engine enforces exactly, for
pagedserve.gateway.schema_support.normalize: keywords beside an anyOf/oneOf pushed into each branch,
allOf merged into one schema, a `$ref` with keywords beside it inlined (pagedserve.gateway.schema_merge),
if/then/else on one property's value split into an anyOf on that value, and a oneOf's object
branches told apart by their required properties. Each rewrite accepts only values the
original accepts; it narrows only as the engine already does (strict mode: no property
written that a schema does not declare). What cannot be rewritten so is left for
schema_support.check to refuse by name.
"""
from __future__ import annotations

import json

from pagedserve.gateway.schema_errors import Unsatisfiable, UnsupportedKeyword
from pagedserve.gateway.schema_merge import ANNOTATIONS, CHOICES, Merger
from pagedserve.gateway.schema_walk import LISTS, MAPS, SINGLE

PASSES = 6  # an inlined target is rewritten by the next pass


def rewrite(schema: dict) -> dict:
    """`schema` (a copy the caller owns) rewritten in place where it can be; returned."""
    for _ in range(PASSES):
        before = repr(schema)
        schema = _visit(schema, "#", Merger(schema))
        if repr(schema) == before:
            break
    return json.loads(json.dumps(schema))  # no object shared by two places: later passes edit in place


def _visit(node: dict, path: str, m: Merger) -> dict:
    for key in ("$defs", "definitions") + tuple(k for k in MAPS if k not in ("$defs", "definitions")):
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                if isinstance(sub, dict):
                    node[key][name] = _visit(sub, f"{path}/{key}/{name}", m)
    for key in SINGLE:
        if isinstance(node.get(key), dict):
            node[key] = _visit(node[key], f"{path}/{key}", m)
    for key in LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_visit(sub, f"{path}/{key}/{i}", m) if isinstance(sub, dict) else sub
                         for i, sub in enumerate(node[key])]
    try:
        return _simplify(node, path, m)
    except Unsatisfiable as e:
        raise UnsupportedKeyword("schema", path, f"can never hold ({e})") from None


def _simplify(node: dict, path: str, m: Merger) -> dict:
    keep = {k: v for k, v in node.items() if k in ANNOTATIONS}
    if isinstance(node.get("allOf"), list) and all(isinstance(p, dict) for p in node["allOf"]):
        merged = {k: v for k, v in node.items() if k != "allOf"}
        for i, part in enumerate(node["allOf"]):
            merged = m.merge(merged, part, f"{path}/allOf/{i}")
        node = {**merged, **keep}
    if "$ref" in node and _assertions(node, "$ref"):
        node = {**m.inline(node, path), **keep}
    if isinstance(node.get("if"), dict):
        node = _if_then_else(node, path, m, keep)
    kinds = [k for k in CHOICES if isinstance(node.get(k), list)]
    if len(kinds) == 1 and _assertions(node, kinds[0]):
        kind = kinds[0]
        rest = {k: v for k, v in node.items() if k != kind and k not in ANNOTATIONS}
        node = {kind: m.branches(kind, rest, node[kind], path), **keep}
    if isinstance(node.get("oneOf"), list):
        node["oneOf"] = _told_apart(node["oneOf"])
    return node


def _if_then_else(node: dict, path: str, m: Merger, keep: dict) -> dict:
    """{if: {properties: {k: S}}, then: T, else: E} beside a schema that lets k take only the
    values of a finite enum: anyOf [k absent or in S, and T; k present and not in S, and E]."""
    cond = node["if"]
    props = cond.get("properties") if set(cond) == {"properties"} else None
    if not isinstance(props, dict) or len(props) != 1:
        return node
    (key, test), = props.items()
    allowed = _finite(test)
    domain = _finite(node.get("properties", {}).get(key)) if isinstance(node.get("properties"), dict) else None
    if allowed is None or domain is None:
        return node
    rest = {k: v for k, v in node.items() if k not in ("if", "then", "else") and k not in ANNOTATIONS}
    then, other = node.get("then", {}), node.get("else", {})
    out = []
    for cond_, part in (({"properties": {key: {"enum": [v for v in domain if v in allowed]}}}, then),
                        ({"properties": {key: {"enum": [v for v in domain if v not in allowed]}},
                          "required": [key]}, other)):
        if not cond_["properties"][key]["enum"] or not isinstance(part, dict):
            continue
        try:
            out.append(m.merge(m.merge(rest, cond_, path), part, path))
        except Unsatisfiable:
            pass
    if not out:
        raise Unsatisfiable(f"{path}: neither then nor else can hold")
    return {"anyOf": out, **keep}


def _finite(node) -> list | None:
    """The values a schema allows when it names them all (const, enum, an anyOf of those, type null)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    if node.get("type") == "null" and len(node) == 1:
        return [None]
    if isinstance(node.get("anyOf"), list) and set(node) == {"anyOf"}:
        parts = [_finite(p) for p in node["anyOf"]]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    return None


def _told_apart(branches: list) -> list:
    """oneOf object branches, each requiring a property another does not: that branch stops
    declaring the properties only the others require, so (strict mode) no output of one
    branch can meet another's required. Returned unchanged where this cannot be done."""
    if not all(isinstance(b, dict) and b.get("type") == "object" and isinstance(b.get("required"), list)
               and isinstance(b.get("properties", {}), dict) and not b.get("patternProperties")
               and b.get("additionalProperties", False) is False for b in branches):
        return branches
    out = [dict(b, properties=dict(b.get("properties", {}))) for b in branches]
    for i, b in enumerate(branches):
        for j, other in enumerate(out):
            if i == j or any(r not in other["properties"] and r not in other["required"] for r in b["required"]):
                continue
            only_b = [r for r in b["required"] if r not in other["required"]]
            if not only_b:
                return branches
            del other["properties"][only_b[0]]
    return out


def _assertions(node: dict, but: str) -> bool:
    return any(k != but and k not in ANNOTATIONS for k in node)
