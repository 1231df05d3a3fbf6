"""First-fit allocation of runs of consecutive block ids (for the contiguous baselines).

Free space is a sorted list of disjoint, non-adjacent free runs (start, length). Allocate
takes the lowest-addressed run that is long enough and splits it; free puts a run back and
merges it with its neighbours. Holes appear exactly as they would in a real allocator:
a freed run between two live runs can only be reused by a request that fits in it.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from pagedserve.memsvc.block_pool import DoubleFree, IntegrityError, NoFreeBlocks


@dataclass(frozen=True)
class Run:
    """Blocks start .. start + length - 1."""

    start: int
    length: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 1:
            raise ValueError(f"a run needs start >= 0 and length >= 1, got {self}")

    @property
    def end(self) -> int:
        return self.start + self.length


class RunAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[Run] = [Run(0, num_blocks)]

    @property
    def num_free(self) -> int:
        return sum(r.length for r in self._free)

    def free_runs(self) -> list[Run]:
        return list(self._free)

    def largest_free_run(self) -> int:
        return max((r.length for r in self._free), default=0)

    def allocate(self, n: int) -> Run:
        """The first (lowest-addressed) free run of at least `n` blocks, split off its front."""
        if n < 1:
            raise ValueError(f"a run needs at least 1 block, got {n}")
        for i, r in enumerate(self._free):
            if r.length >= n:
                if r.length == n:
                    del self._free[i]
                else:
                    self._free[i] = Run(r.start + n, r.length - n)
                return Run(r.start, n)
        raise NoFreeBlocks(
            f"no run of {n} consecutive free blocks (longest {self.largest_free_run()},"
            f" {self.num_free} free in {len(self._free)} runs)"
        )

    def free(self, run: Run) -> None:
        """Return `run`; DoubleFree if any of its blocks is already free."""
        if run.end > self.num_blocks:
            raise ValueError(f"{run} lies outside the pool of {self.num_blocks} blocks")
        starts = [r.start for r in self._free]
        i = bisect.bisect_left(starts, run.start)
        prev = self._free[i - 1] if i > 0 else None
        nxt = self._free[i] if i < len(self._free) else None
        if (prev is not None and prev.end > run.start) or (nxt is not None and nxt.start < run.end):
            raise DoubleFree(f"blocks of {run} are already free")
        start, end = run.start, run.end
        lo, hi = i, i
        if prev is not None and prev.end == start:
            start, lo = prev.start, i - 1
        if nxt is not None and nxt.start == end:
            end, hi = nxt.end, i + 1
        self._free[lo:hi] = [Run(start, end - start)]

    def check(self, used: list[Run]) -> None:
        """Free runs and `used` runs tile [0, num_blocks) exactly; free runs are merged."""
        for a, b in zip(self._free, self._free[1:]):
            if a.end >= b.start:
                raise IntegrityError(f"free runs {a} and {b} overlap or are not merged")
        cover = sorted([(r.start, r.end, "free") for r in self._free]
                       + [(r.start, r.end, "used") for r in used])
        pos = 0
        for start, end, kind in cover:
            if start != pos:
                what = "overlaps" if start < pos else "leaves a gap before"
                raise IntegrityError(f"{kind} run [{start}, {end}) {what} block {pos}")
            pos = end
        if pos != self.num_blocks:
            raise IntegrityError(f"runs cover [0, {pos}) of {self.num_blocks} blocks")
