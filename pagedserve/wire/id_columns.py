"""Columns on the wire: a column of sequence ids travels as one string, the ids joined by
newlines (in its repeated field when an id holds a newline); a column whose every value is
the same in a steady step travels as a flag, the column empty.
"""
from __future__ import annotations


def join_ids(ids: list[str]) -> tuple[list[str], str]:
    """(repeated, joined): a column of ids for its two proto fields. Joined by newlines
    unless an id holds one (or the column is [""], which would join to nothing)."""
    joined = "\n".join(ids)
    if joined and joined.count("\n") == len(ids) - 1:
        return [], joined
    return ids, ""


def split_ids(repeated, joined: str) -> list[str]:
    """The column `join_ids` sent."""
    return joined.split("\n") if joined else list(repeated)


def constant(column: list[int], value: int, n: int) -> bool:
    """`column` is n > 0 values, each `value`: it travels as its flag, empty."""
    return n > 0 and len(column) == n and column.count(value) == n


def column(repeated, flag: bool, value: int, n: int, name: str) -> list[int]:
    """The column `repeated` sent, or where its flag is set, n values `value`."""
    if not flag:
        return list(repeated)
    if repeated:
        raise ValueError(f"{name} must be empty where its flag says each of its values is {value}")
    return [value] * n
