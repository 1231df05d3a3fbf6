"""Host swap space: a store of host-side blocks with its own free list.

Pure bookkeeping: it hands out host block ids and takes them back; the caller moves the
bytes (the allocator returns (src, dst) copy pairs for that). Host blocks are never shared
and never prefix-cached, so a plain LIFO free list is enough.
"""
from __future__ import annotations

from collections.abc import Iterable

from memsvc.block_pool import DoubleFree, IntegrityError, NoFreeBlocks


class SwapSpace:
    """`num_blocks` host blocks (0 is allowed: no swapping)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id first
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(
                f"swap space needs {n} host blocks, {len(self._free)} of {self.num_blocks} free"
            )
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._used[b] = True
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        block_ids = list(block_ids)
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"host block {b} is out of range [0, {self.num_blocks})")
            if not self._used[b]:
                raise DoubleFree(f"host block {b} freed twice")
        if len(set(block_ids)) != len(block_ids):
            raise DoubleFree("the same host block appears twice in one free call")
        for b in reversed(block_ids):
            self._used[b] = False
            self._free.append(b)

    def check(self, held: Iterable[int]) -> None:
        """`held`: every host block the sequences hold; each used block exactly once."""
        held = list(held)
        if len(set(held)) != len(held):
            raise IntegrityError(f"host blocks held twice: {sorted(b for b in set(held) if held.count(b) > 1)}")
        used = {b for b in range(self.num_blocks) if self._used[b]}
        if used != set(held):
            raise IntegrityError(
                f"host blocks in use {sorted(used)} differ from those held {sorted(held)}"
            )
        if len(self._free) + len(used) != self.num_blocks or set(self._free) & used:
            raise IntegrityError("host free list and used blocks do not partition the space")
