"""The steps reserved so far ran: what tests that drive memsvc's allocator by hand say
before they expect a prefix-cache hit (pagedserve.memsvc.unwritten_keys: a keyed block is a hit only
once its step is confirmed)."""
from __future__ import annotations


def ran(alloc) -> None:
    """Confirm every act of `alloc` (a PagedAllocator, or a MemoryManager's) so far."""
    alloc = getattr(alloc, "allocator", alloc)
    alloc.confirm_written(sorted(alloc.unwritten.by_stamp))


class Steps:
    """Reserves on a MemoryManager whose steps run, each before the next plan: every plan
    says so (`Plan.written`: the stamp of the last Reserve of its session)."""

    def __init__(self, mem) -> None:
        self.mem = mem
        self.last: dict[str, int] = {}

    def reserve(self, plan, session: str = ""):
        plan.written = self.last.get(session, 0)
        result = self.mem.reserve(plan, session)
        self.last[session] = result.stamp
        return result
