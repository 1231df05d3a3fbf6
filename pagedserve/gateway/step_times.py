"""The wall time the batching loop (pagedserve.gateway.batch_loop) spends per phase of a step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimes:
    """Wall seconds the loop spent per phase, summed over `steps` (perf_counter, cheap
    enough to stay on): scheduling (plan, applying memsvc's answer), Reserve (forks
    included: the wire and memsvc), Execute (the wire and the executor) and outputs (applying the
    tokens, detokenizing, stop rules, deltas)."""

    steps: int = 0
    schedule: float = 0.0
    reserve: float = 0.0
    execute: float = 0.0
    output: float = 0.0

    def clear(self) -> None:
        self.steps, self.schedule, self.reserve, self.execute, self.output = 0, 0.0, 0.0, 0.0, 0.0
