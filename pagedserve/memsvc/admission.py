"""Admission answers: can this request start now, later, or never?

`never` means no amount of waiting helps (the request exceeds the whole pool) and carries
a message naming the limit; `wait` means it would fit once others finish; `yes` means its
first step's blocks are free now. The allocator answers, the scheduler acts on it.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.memsvc.block_table import blocks_for

ADMISSION_KINDS = ("yes", "wait", "never")


@dataclass
class Admission:
    """kind: "yes" | "wait" | "never"; reason: "" for yes, else what limit is in the way."""

    kind: str
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ADMISSION_KINDS:
            raise ValueError(f"kind must be one of {ADMISSION_KINDS}, got {self.kind!r}")
        if self.kind == "yes" and self.reason:
            raise ValueError("a 'yes' admission carries no reason")
        if self.kind != "yes" and not self.reason:
            raise ValueError(f"a {self.kind!r} admission needs a reason")

    @property
    def ok(self) -> bool:
        return self.kind == "yes"


def check_request(prompt_len: int, max_len: int) -> None:
    """ValueError for a malformed request (a caller bug, not an admission answer)."""
    if prompt_len < 1:
        raise ValueError("the prompt must hold at least one token")
    if max_len < prompt_len:
        raise ValueError(f"max_len {max_len} is shorter than the prompt ({prompt_len} tokens)")


def _describe(prompt_len: int, max_len: int) -> str:
    return f"{max_len} tokens (prompt {prompt_len} + max_tokens {max_len - prompt_len})"


def paged_admission(
    *,
    prompt_len: int,
    max_len: int,
    block_size: int,
    num_blocks: int,
    cached_blocks: int,
    free_blocks: int,
) -> Admission:
    """Paged: never if the whole sequence exceeds the pool; wait unless the prompt's
    uncached blocks are free now. `free_blocks` excludes the cached blocks the prompt
    itself would revive (they leave the free queue when it attaches them)."""
    check_request(prompt_len, max_len)
    total = blocks_for(max_len, block_size)
    if total > num_blocks:
        return Admission(
            "never",
            f"needs {total} blocks of {block_size} tokens for {_describe(prompt_len, max_len)}"
            f" but the pool has {num_blocks} blocks",
        )
    needed = blocks_for(prompt_len, block_size) - cached_blocks
    if needed > free_blocks:
        return Admission(
            "wait",
            f"the prompt needs {needed} free blocks ({cached_blocks} more cached)"
            f" but {free_blocks} are free now",
        )
    return Admission("yes")


def contiguous_admission(
    *,
    prompt_len: int,
    max_len: int,
    policy: str,
    reservation_blocks: int,
    block_size: int,
    num_blocks: int,
    largest_free_run: int,
) -> Admission:
    """Contiguous: never if the reservation exceeds the pool; wait unless one free run
    of consecutive blocks is long enough for it now."""
    check_request(prompt_len, max_len)
    if reservation_blocks > num_blocks:
        return Admission(
            "never",
            f"{policy} reserves {reservation_blocks} blocks of {block_size} tokens for "
            f"{_describe(prompt_len, max_len)} but the pool has {num_blocks} blocks",
        )
    if reservation_blocks > largest_free_run:
        return Admission(
            "wait",
            f"{policy} needs a run of {reservation_blocks} consecutive free blocks"
            f" but the longest free run is {largest_free_run} blocks",
        )
    return Admission("yes")
