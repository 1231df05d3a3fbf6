"""Preemption policy: move a victim's blocks to the host, or drop them for recompute.

Modes:
- "recompute": always free the victim's blocks; it prefills again later.
- "swap": copy its blocks to the host swap space when they fit there.
- "auto" (default): swap when the estimated copy time (out now and back in later) is at most
  the estimated time to compute its tokens again (pagedserve.memsvc.cost_model, both measured). Until
  a step report has priced a token, it recomputes (vLLM's choice for a single sequence).
Every mode falls back to recompute when the swap space cannot hold the victim.
The policy only answers; the step planner acts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagedserve.memsvc.cost_model import CostModel

PREEMPTION_MODES = ("recompute", "swap", "auto")


class Choice(NamedTuple):
    mode: str  # "swap" or "recompute"
    fallback: bool  # swap was wanted but the swap space is full


@dataclass
class PreemptionPolicy:
    mode: str = "auto"
    costs: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.mode!r}")

    def wants_swap(self, num_blocks: int, num_tokens: int) -> bool:
        if self.mode == "recompute":
            return False
        if self.mode == "swap":
            return True
        if self.costs.seconds_per_token is None:
            return False
        return self.costs.swap_seconds(num_blocks) <= self.costs.recompute_seconds(num_tokens)

    def choose(self, num_blocks: int, num_tokens: int, swap_fits: bool) -> Choice:
        """How to preempt a victim holding `num_blocks` blocks for `num_tokens` tokens."""
        if not self.wants_swap(num_blocks, num_tokens):
            return Choice("recompute", False)
        if not swap_fits:
            return Choice("recompute", True)
        return Choice("swap", False)

    def crossover_tokens(self, block_size: int, max_tokens: int = 1 << 20) -> int | None:
        """The shortest sequence that "auto" swaps rather than recomputes (None: none up to
        `max_tokens`), under the current estimates."""
        lo, hi = 1, max_tokens
        if not self.wants_swap(-(-hi // block_size), hi):
            return None
        while lo < hi:  # swap's advantage grows with length: binary search the first
            mid = (lo + hi) // 2
            if self.wants_swap(-(-mid // block_size), mid):
                hi = mid
            else:
                lo = mid + 1
        return lo
