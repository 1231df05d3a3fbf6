"""What preemption costs on this machine, measured while memsvc runs.

- `seconds_per_block`: one block copied one way between the pool and the host swap space.
  Timed at start-up (the memory manager copies a few blocks out and back) and updated
  with every swap it performs: an exponentially weighted mean of run seconds / run blocks.
- `seconds_per_token`: the cost of computing one more token. The gateway reports each
  step's computed tokens and the executor's wall seconds for it (Plan.step_tokens,
  Plan.step_seconds). A line seconds = a + b * tokens is fitted by exponentially weighted
  least squares; b is the cost of a recomputed token, since recomputed tokens join steps
  that run anyway (the fixed part a is not paid again). While the steps seen do not fix a
  slope (nearly all the same size) or it is not positive, the mean seconds per token is
  used instead (an upper bound). With no report yet it is unknown (None).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    block_alpha: float = 0.2  # weight of the newest swap in seconds_per_block
    step_decay: float = 0.99  # weight kept by older steps at each new one (~100 steps)
    seconds_per_block: float | None = None
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.block_alpha <= 1:
            raise ValueError(f"block_alpha must be in (0, 1], got {self.block_alpha}")
        if not 0 < self.step_decay < 1:
            raise ValueError(f"step_decay must be in (0, 1), got {self.step_decay}")

    def observe_copy(self, num_blocks: int, seconds: float) -> None:
        """A run of `num_blocks` one-way block copies took `seconds`."""
        if num_blocks < 1 or seconds < 0:
            return
        sample = seconds / num_blocks
        old = self.seconds_per_block
        self.seconds_per_block = sample if old is None else old + self.block_alpha * (sample - old)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` tokens in `seconds` (the executor's wall time)."""
        if tokens < 1 or seconds <= 0:
            return
        d = self.step_decay
        self._w = d * self._w + 1
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    @property
    def seconds_per_token(self) -> float | None:
        if self._w == 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x >= 1.0:  # token counts vary by at least one token
            slope = (self._xy / self._w - mean_x * mean_y) / var_x
            if slope > 0:
                return slope
        return mean_y / mean_x

    def swap_seconds(self, num_blocks: int) -> float:
        """Out now and back in later; 0 while unmeasured."""
        return 2 * num_blocks * (self.seconds_per_block or 0.0)

    def recompute_seconds(self, num_tokens: int) -> float:
        """0 while no step has been reported."""
        return num_tokens * (self.seconds_per_token or 0.0)
