"""Host swap space: a store of host-side blocks with its own free list.

Pure bookkeeping: it hands out host block ids and takes them back; the caller moves the
bytes (the allocator returns (src, dst) copy pairs for that). Host blocks are never shared
and never prefix-cached, so a plain LIFO free list is enough. Ids never handed out are not
listed (a swap space of gigabytes may hold millions of small blocks): they are taken in
order after the freed ones.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedserve.memsvc.block_pool import DoubleFree, IntegrityError, NoFreeBlocks


class SwapSpace:
    """`num_blocks` host blocks (0 is allowed: no swapping)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = []  # freed ids; pop() gives the most recently freed
        self._fresh = 0  # ids >= this were never handed out
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(
                f"swap space needs {n} host blocks, {self.num_free} of {self.num_blocks} free"
            )
        out = [self._free.pop() for _ in range(min(n, len(self._free)))]
        take = n - len(out)
        out.extend(range(self._fresh, self._fresh + take))
        self._fresh += take
        self._used.update(out)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        block_ids = list(block_ids)
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"host block {b} is out of range [0, {self.num_blocks})")
            if b not in self._used:
                raise DoubleFree(f"host block {b} freed twice")
        if len(set(block_ids)) != len(block_ids):
            raise DoubleFree("the same host block appears twice in one free call")
        for b in reversed(block_ids):
            self._used.discard(b)
            self._free.append(b)

    def check(self, held: Iterable[int]) -> None:
        """`held`: every host block the sequences hold; each used block exactly once."""
        held = list(held)
        if len(set(held)) != len(held):
            raise IntegrityError(f"host blocks held twice: {sorted(b for b in set(held) if held.count(b) > 1)}")
        used = self._used
        if used != set(held):
            raise IntegrityError(
                f"host blocks in use {sorted(used)} differ from those held {sorted(held)}"
            )
        free = set(self._free)
        if (len(free) != len(self._free) or free & used or any(b >= self._fresh for b in free | used)
                or len(free) + len(used) != self._fresh):
            raise IntegrityError("host free list and used blocks do not partition the space")
