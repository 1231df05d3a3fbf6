"""The conjunction of JSON schemas as one schema, for the structured-output rewrites
(pagedserve.gateway.schema_support.normalize). `Merger(root).merge(a, b)` accepts exactly what both
`a` and `b` accept: keywords each side bounds are intersected, a local `$ref` is inlined, an
anyOf/oneOf on one side takes the other side into each branch (a branch that cannot hold is
dropped). What it cannot combine exactly (two different patterns, a recursive `$ref`, an
anyOf against a oneOf) raises UnsupportedKeyword naming the keyword; an empty intersection
raises Unsatisfiable. A property no value can meet is dropped (it must be absent) and the merged
schema closed (additionalProperties false: the engine, strict, writes no undeclared property
anyway, and a later merge cannot declare the dropped one again).
"""
from __future__ import annotations

import json

from pagedserve.gateway.schema_errors import Unsatisfiable, UnsupportedKeyword
from pagedserve.gateway.schema_walk import resolve

LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "example", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$schema", "$id", "id", "markdownDescription", "$defs",
                         "definitions"))
CHOICES = ("anyOf", "oneOf")
MAX_BRANCHES = 64  # a product of two combinators larger than this is refused, not expanded
MAX_INLINE = 32  # $refs inlined within one merge: past it the $ref is taken as recursive


class Merger:
    def __init__(self, root: dict):
        self.root = root
        self.inlined = 0

    def inline(self, node: dict, path: str) -> dict:
        """`node` with its local `$ref` replaced by the target's keywords and its own."""
        while "$ref" in node:
            target = resolve(self.root, node["$ref"])
            self.inlined += 1
            if target is None or self.inlined > MAX_INLINE:
                raise UnsupportedKeyword("$ref", path, f"{node['$ref']!r} beside other keywords is not local "
                                         "or is recursive, so it cannot be inlined")
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = self.merge(dict(target), rest, path) if rest else dict(target)
        return node

    def merge(self, a: dict, b: dict, path: str) -> dict:
        if a == b or not _asserts(b):
            return a
        if not _asserts(a):
            return b
        a, b = self.inline(a, path), self.inline(b, path)
        for one, other in ((a, b), (b, a)):
            kind = _choice(one)
            if kind and not _choice(other) and _asserts(other):
                rest = {k: v for k, v in one.items() if k != kind}
                base = self.merge(rest, other, path) if _asserts(rest) else other
                return {kind: self.branches(kind, base, one[kind], path)}
        out = dict(a)
        for key, value in b.items():
            if key not in out:
                out[key] = value
            elif key not in ANNOTATIONS and out[key] != value:
                out[key] = self._both(key, out[key], value, path)
        if any(k in s for s in (a, b) for k in ("properties", "additionalProperties", "patternProperties")):
            self._objects(out, a, b, path)
        return out

    def branches(self, kind: str, base: dict, items: list, path: str) -> list:
        """Each branch of `items` merged with `base`; those that cannot hold dropped."""
        out = []
        for i, br in enumerate(items):
            try:
                out.append(self.merge(base, br, f"{path}/{kind}/{i}") if isinstance(br, dict) else br)
            except Unsatisfiable:
                pass
        if not out:
            raise Unsatisfiable(f"{path}: no {kind} branch can hold")
        return out

    def _both(self, key: str, x, y, path: str):
        if key == "type":
            return _types(x, y, path)
        if key in LOWER:
            return max(x, y)
        if key in UPPER:
            return min(x, y)
        if key == "required":
            return list(dict.fromkeys(list(x) + list(y)))
        if key == "enum":
            ys = {_canon(v) for v in y}
            both = [v for v in x if _canon(v) in ys]
            if not both:
                raise Unsatisfiable(f"{path}: the enums do not meet")
            return both
        if key == "const":
            raise Unsatisfiable(f"{path}: two different const values")
        if key in ("properties", "additionalProperties"):
            return x  # _objects decides
        if key == "items" and isinstance(x, dict) and isinstance(y, dict):
            return self.merge(x, y, f"{path}/items")
        if key in CHOICES and isinstance(x, list) and isinstance(y, list):
            return self._product(key, x, y, path)
        raise UnsupportedKeyword(key, path, "has two different values in schemas that must both hold")

    def _product(self, kind: str, x: list, y: list, path: str) -> list:
        """anyOf x and anyOf y as one anyOf of the pairs (for oneOf too: exactly one pair holds
        if and only if exactly one schema of each side does)."""
        if len(x) * len(y) > MAX_BRANCHES:
            raise UnsupportedKeyword(kind, path, f"on both sides of schemas that must both hold makes "
                                     f"{len(x) * len(y)} branches (at most {MAX_BRANCHES})")
        out = []
        for p in x:
            try:
                out += self.branches(kind, p, y, path)
            except Unsatisfiable:
                pass
        if not out:
            raise Unsatisfiable(f"{path}: no {kind} branch can hold")
        return out

    def _objects(self, out: dict, a: dict, b: dict, path: str) -> None:
        """Each property's schema is what both sides say of it: a side's own schema for it
        where it declares it, that side's additionalProperties where not."""
        if "patternProperties" in a or "patternProperties" in b:
            if a.get("patternProperties") != b.get("patternProperties") and (_declares(a) and _declares(b)):
                raise UnsupportedKeyword("patternProperties", path, "in schemas that must both hold is not merged")
            return
        pa, pb = a.get("properties", {}), b.get("properties", {})
        props, dropped = {}, []
        for name in dict.fromkeys(list(pa) + list(pb)):
            sa, sb = _property(a, pa, name), _property(b, pb, name)
            if sa is None or sb is None:
                continue  # one side forbids it
            try:
                props[name] = {} if sa is True and sb is True else sa if sb is True else sb if sa is True else \
                    self.merge(sa, sb, f"{path}/properties/{name}")
            except Unsatisfiable:
                if name in out.get("required", []):
                    raise
                dropped.append(name)  # no value meets both: the property must be absent
        ea, eb = _extra(a), _extra(b)
        if dropped and ea is not None and eb is not None and (ea is not True or eb is not True):
            raise UnsupportedKeyword("properties", f"{path}/properties/{dropped[0]}", "must be absent (no value "
                                     "meets both schemas) but additionalProperties would let it be written")
        if ea is None or eb is None:
            forbidden = [r for r in out.get("required", []) if r not in props]
            if forbidden:
                raise Unsatisfiable(f"{path}: required {forbidden[0]!r} is forbidden by one of the schemas")
        if props or "properties" in out:
            out["properties"] = props
        out.pop("additionalProperties", None)
        if ea is None or eb is None or dropped:  # dropped: a later merge must not declare it again
            out["additionalProperties"] = False
        elif ea is not True or eb is not True:
            out["additionalProperties"] = eb if ea is True else ea if eb is True else self.merge(
                ea, eb, f"{path}/additionalProperties")


def _choice(node: dict) -> str | None:
    kinds = [k for k in CHOICES if isinstance(node.get(k), list)]
    return kinds[0] if len(kinds) == 1 else None


def _asserts(node: dict) -> bool:
    return any(k not in ANNOTATIONS for k in node)


def _declares(node: dict) -> bool:
    return bool(node.get("properties")) or "additionalProperties" in node


def _types(x, y, path: str):
    xs = set(x) if isinstance(x, list) else {x}
    ys = set(y) if isinstance(y, list) else {y}
    both = xs & ys
    if ("integer" in xs and "number" in ys) or ("number" in xs and "integer" in ys):
        both.add("integer")
    if not both:
        raise Unsatisfiable(f"{path}: types {sorted(xs)} and {sorted(ys)} do not meet")
    return next(iter(both)) if len(both) == 1 else sorted(both)


def _property(side: dict, props: dict, name: str):
    if name in props:
        return True if props[name] in ({}, True) else None if props[name] is False else props[name]
    return _extra(side)


def _extra(side: dict):
    """What `side` lets an undeclared property be: a schema, True (anything) or None (nothing)."""
    extra = side.get("additionalProperties", True)
    if extra is False:
        return None
    return True if extra in (True, {}) else extra


def _canon(v) -> str:
    return json.dumps(v, sort_keys=True)
