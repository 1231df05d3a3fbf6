"""Why structured output refuses a JSON schema (pagedserve.gateway.schema_support, pagedserve.gateway.schema_merge)."""
from __future__ import annotations


class UnsupportedKeyword(ValueError):
    def __init__(self, keyword: str, path: str, why: str):
        super().__init__(f"{path}: {keyword} {why}; structured output cannot enforce it exactly, so "
                         f"remove it or express it with supported keywords")
        self.keyword = keyword
        self.path = path


class Unsatisfiable(ValueError):
    """No JSON value can meet the schemas that must all hold."""
