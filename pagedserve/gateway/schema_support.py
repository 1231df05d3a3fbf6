"""Which JSON schemas the grammar engine (xgrammar, strict mode, pagedserve.executor.logits_mask)
enforces exactly: `normalize(schema)` rewrites the forms it misreads into equivalent ones it
reads right, and `check(schema)` raises UnsupportedKeyword for a keyword it would ignore or
only approximate, so that the gateway refuses the request (400) instead of enforcing less.

Found by probing xgrammar 0.2.9 (tests/unit/gateway/test_schema_support.py keeps the
probes): it ignores not, if/then/else, dependencies, dependent*, contains, uniqueItems,
multipleOf on numbers, lookahead in patterns, minLength/maxLength beside pattern or format,
siblings of $ref / anyOf / oneOf / allOf, a required property that `properties` does not
declare, and string or number keywords in a schema without a type; it reads oneOf as anyOf
and allOf loosely. The formats JSON Schema defines that it does not check are refused;
other formats are annotations (as the specification says).
"""
from __future__ import annotations

import copy
import re

from pagedserve.gateway.schema_errors import UnsupportedKeyword
from pagedserve.gateway.schema_rewrite import rewrite
from pagedserve.gateway.schema_walk import resolve, walk

__all__ = ["UnsupportedKeyword", "check", "normalize"]

IGNORED = ("not", "if", "then", "else", "dependencies", "dependentRequired", "dependentSchemas", "contains",
           "minContains", "maxContains", "unevaluatedItems", "$dynamicRef", "$recursiveRef")
ASSERTIONS = frozenset((
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "additionalItems", "minItems",
    "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "unevaluatedProperties", "$ref", "anyOf", "oneOf",
    "allOf") + IGNORED)
COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
UNCHECKED_FORMATS = ("idn-email", "idn-hostname", "iri", "iri-reference", "regex")
CHECKED_FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                   "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer")
TYPED = ("minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
         "multipleOf")
LOOKAROUND = re.compile(r"\(\?<?[=!]")


def normalize(schema: dict) -> dict:
    """An equivalent copy that the engine reads right: draft-04 boolean exclusiveMinimum /
    exclusiveMaximum as numbers, draft-04 tuple `items` as prefixItems, the rewrites of
    pagedserve.gateway.schema_rewrite (keywords beside a combinator or a `$ref`, allOf), and each
    required property that `properties` lacks declared with the schema extra properties
    must follow."""
    schema = copy.deepcopy(schema)
    for path, node in walk(schema):
        for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(bound), bool):
                if node.pop(bound) and limit in node:
                    node[bound] = node.pop(limit)
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            extra = node.pop("additionalItems", None)
            if extra is not None:
                node["items"] = extra
    schema = rewrite(schema)
    for path, node in walk(schema):
        required = node.get("required")
        if isinstance(required, list) and not any(k in node for k in COMBINATORS):
            props = node.setdefault("properties", {}) if isinstance(node.get("properties", {}), dict) else None
            for name in required:
                if props is None or not isinstance(name, str) or name in props:
                    continue
                extra = node.get("additionalProperties", True)
                if extra is False:
                    raise UnsupportedKeyword("required", path, f"names {name!r}, which additionalProperties "
                                             "false forbids (no output can be valid)")
                if node.get("patternProperties"):  # its patterns are not run here: a client's regex
                    raise UnsupportedKeyword("required", path, f"names {name!r} beside patternProperties "
                                             "but not in properties (declare it in properties)")
                props[name] = extra if isinstance(extra, dict) else {}
    return schema


def check(schema: dict) -> None:
    """Raise UnsupportedKeyword for the first keyword, reachable from the root, that the
    engine would not enforce exactly."""
    todo, roots, seen = [schema], set(), set()
    while todo:
        root = todo.pop()
        if id(root) in roots:
            continue
        roots.add(id(root))
        for path, node in walk(root, with_defs=False, seen=seen):
            _check_node(path, node, schema)
            if "$ref" in node:
                target = resolve(schema, node["$ref"])
                if target is not None:
                    todo.append(target)


def _check_node(path: str, node: dict, root: dict) -> None:
    for key in IGNORED:
        if key in node:
            raise UnsupportedKeyword(key, path, "is ignored by the grammar engine")
    combinators = [k for k in COMBINATORS if k in node]
    if combinators:
        others = sorted(k for k in node if k in ASSERTIONS and k != combinators[0])
        if others:
            raise UnsupportedKeyword(others[0], path, f"beside {combinators[0]} is ignored by the grammar engine")
    if "type" not in node and "enum" not in node and "const" not in node:
        typed = [k for k in TYPED if k in node] + (["format"] if node.get("format") in CHECKED_FORMATS else [])
        if typed:
            raise UnsupportedKeyword(typed[0], path, "without a type is ignored by the grammar engine (add "
                                     "the type it applies to)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise UnsupportedKeyword("allOf", path, "with more than one schema is only approximated")
    if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], root):
        raise UnsupportedKeyword("oneOf", path, "whose schemas may overlap is read as anyOf")
    if node.get("uniqueItems") is True and not (isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1):
        raise UnsupportedKeyword("uniqueItems", path, "is ignored by the grammar engine")
    if "multipleOf" in node and not (node.get("type") == "integer" and isinstance(node["multipleOf"], int)):
        raise UnsupportedKeyword("multipleOf", path, "is enforced on integers only")
    if node.get("format") in UNCHECKED_FORMATS:
        raise UnsupportedKeyword("format", path, f"{node['format']!r} is not checked by the grammar engine")
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    patterns += list(node.get("patternProperties", {}) if isinstance(node.get("patternProperties"), dict) else [])
    if isinstance(node.get("propertyNames"), dict) and isinstance(node["propertyNames"].get("pattern"), str):
        patterns.append(node["propertyNames"]["pattern"])
    for p in patterns:
        if LOOKAROUND.search(p):
            raise UnsupportedKeyword("pattern", path, f"{p!r} has a lookaround, which the grammar engine ignores")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        which = "minLength" if "minLength" in node else "maxLength"
        raise UnsupportedKeyword(which, path, "beside pattern or format is ignored by the grammar engine")


def _types(node: dict) -> set[str] | None:
    """The JSON types a schema's instances can have, when it says (type, const, enum)."""
    def of(v):
        return {bool: "boolean", type(None): "null", str: "string", dict: "object", list: "array"}.get(
            type(v), "number")
    if "const" in node:
        return {of(node["const"])}
    if isinstance(node.get("enum"), list):
        return {of(v) for v in node["enum"]}
    t = node.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) and all(
        isinstance(x, str) for x in t) else None
    if types and "integer" in types:
        types = (types - {"integer"}) | {"number"}
    return types


def _disjoint(branches: list, root: dict) -> bool:
    """True when no output the engine generates can match two of `branches`: their types
    or their const / enum values differ, they are objects that each require one property
    whose const / enum values differ, or objects each of which requires a property that no
    other declares (the engine, strict, writes no property a schema does not declare)."""
    branches = [_target(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [_types(b) for b in branches]
    if all(t is not None for t in types) and _pairwise_disjoint(types):
        return True
    values = [_values(b) for b in branches]
    if all(v is not None for v in values) and _pairwise_disjoint(values):
        return True
    for key in _common_required(branches):
        values = [_values(_target(b["properties"][key], root)) for b in branches]
        if all(v is not None for v in values) and _pairwise_disjoint(values):
            return True
    return _own_required(branches)


def _target(node, root: dict):
    """A branch as the schema it stands for: a lone local `$ref` followed."""
    for _ in range(32):
        if not (isinstance(node, dict) and set(node) - {"description", "title"} == {"$ref"}):
            return node
        node = resolve(root, node["$ref"])
    return None


def _own_required(branches: list) -> bool:
    """Each branch is an object schema requiring a property that no other branch lets the
    engine write (declared in its properties, or allowed by a patternProperties /
    additionalProperties schema)."""
    def writable(b: dict) -> set[str] | None:
        if b.get("patternProperties") or isinstance(b.get("additionalProperties"), dict) \
                or b.get("additionalProperties") is True:
            return None
        return set(b.get("properties", {})) if isinstance(b.get("properties", {}), dict) else None

    if not all(b.get("type") == "object" and isinstance(b.get("required"), list) for b in branches):
        return False
    can = [writable(b) for b in branches]
    if any(c is None for c in can):
        return False
    for i, b in enumerate(branches):
        for j in range(len(branches)):
            if i != j and not any(isinstance(r, str) and r not in can[j] and r not in branches[j]["required"]
                                  for r in b["required"]):
                return False
    return True


def _pairwise_disjoint(sets: list[set]) -> bool:
    """No element in two of `sets` (linear: their sizes add up to their union's)."""
    return sum(len(s) for s in sets) == len(set().union(*sets))


def _common_required(branches: list) -> set[str]:
    sets = [{r for r in b.get("required", []) if isinstance(r, str)} & set(b.get("properties", {}))
            if isinstance(b, dict) and isinstance(b.get("required", []), list)
            and isinstance(b.get("properties", {}), dict) else set() for b in branches]
    return set.intersection(*sets) if sets else set()


def _values(node) -> set | None:
    import json

    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {json.dumps(node["const"], sort_keys=True)}
    if isinstance(node.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in node["enum"]}
    return None
