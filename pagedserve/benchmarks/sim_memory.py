"""memsvc's decisions without a pool, for the simulations (`bench kv`, `bench sharing`):
nothing to copy. Each Reserve is an act as in pagedserve.memsvc.memory_manager with one session:
stamped, with what the plan says of the steps before settled first (pagedserve.memsvc.step_stamps),
and with a host tier a PrefixOffload act."""
from __future__ import annotations

from pagedserve.memsvc.step_planner import StepPlanner
from pagedserve.memsvc.step_stamps import StepStamps


class SimMemory:
    def __init__(self, allocator):
        self.allocator = allocator
        self.planner = StepPlanner(allocator)
        self.stamps = StepStamps()
        self._last_offload = None

    def reserve(self, plan):
        stamp = self.stamps.begin_act(self.allocator, "", plan.written, plan.void, plan.failed)
        offload = getattr(self.allocator, "offload", None)
        if offload is not None:
            unsafe = [self._last_offload] if plan.ahead and self._last_offload is not None else []
            self._last_offload = offload.begin(unsafe, restore_allowed=not plan.ahead)
        result = self.planner.reserve(plan).result
        result.stamp = stamp
        return result

    def fork(self, parent_id: str, child_id: str) -> None:
        self.allocator.fork(parent_id, child_id)
