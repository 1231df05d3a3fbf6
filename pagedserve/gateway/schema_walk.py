"""The subschemas of a JSON schema: where in a schema object other schemas sit (JSON Schema
2020-12 and draft-04's tuple `items`), for the structured-output checks and rewrites
(pagedserve.gateway.schema_support, pagedserve.gateway.schema_bounds)."""
from __future__ import annotations

from typing import Iterator

MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SINGLE = ("additionalProperties", "items", "additionalItems", "not", "if", "then", "else", "contains",
          "propertyNames", "unevaluatedProperties", "unevaluatedItems")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def children(node: dict, with_defs: bool = True) -> Iterator[tuple[str, dict]]:
    """(path suffix, subschema) of each schema object directly under `node` (booleans are
    skipped: nothing to check or bound in them)."""
    for key in MAPS:
        if not with_defs and key in ("$defs", "definitions"):
            continue
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield f"{key}/{name}", sub
    for key in SINGLE:
        if isinstance(node.get(key), dict):
            yield key, node[key]
    for key in LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                if isinstance(sub, dict):
                    yield f"{key}/{i}", sub


def walk(schema: dict, with_defs: bool = True, seen: set[int] | None = None) -> Iterator[tuple[str, dict]]:
    """(JSON pointer, subschema) of `schema` and every schema object inside it, each once:
    none whose id is in `seen`, which gets the ids of those walked (shared by several walks,
    each object is walked once in all)."""
    seen = set() if seen is None else seen
    stack = [("#", schema)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        stack.extend((f"{path}/{suffix}", sub) for suffix, sub in reversed(list(children(node, with_defs))))


def resolve(root: dict, ref: str) -> dict | None:
    """The subschema a local `$ref` ("#/...") points at; None when it is not local or missing."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None
