"""What memsvc lets the prefix cache's host tier take: an evicted cached block is offloaded
only when the copy pays, and never one that a step still in flight may write.

`offload_pays`: a copy out now and back at a hit costs less than computing the block's
tokens again (pagedserve.memsvc.cost_model), or `offload_policy` is "always".
`begin_offload`: stamps each Reserve for the tier; the last Reserve of every other session,
and of this one when its plan is made ahead, may still be running, so the blocks keyed by
them are dropped, not offloaded, and a plan made ahead restores nothing. The tier itself:
pagedserve.memsvc.prefix_offload; docs/ARCHITECTURE.md, "Prefix cache, sharing and
preemption".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.memsvc.memory_manager import MemoryManager
    from pagedserve.memsvc.prefix_offload import PrefixOffload


def offload_pays(mm: MemoryManager) -> bool:
    """A copy out now and in at a hit costs less than computing the block's tokens."""
    if mm.config.offload_policy == "always":
        return True
    costs = mm.policy.costs
    return (costs.seconds_per_token is not None and costs.seconds_per_block is not None
            and costs.swap_seconds(1) <= costs.recompute_seconds(mm.geometry.block_size))


def begin_offload(mm: MemoryManager, offload: PrefixOffload, session_id: str, ahead: bool) -> None:
    """Stamp this Reserve. A session's last step may still run unless this plan is its
    own and not made ahead: blocks keyed by those Reserves are not offloaded now, and
    a plan made ahead restores nothing (the step in flight may write a freed block)."""
    live = mm.sessions.by_id
    mm.last_stamps = {s: st for s, st in mm.last_stamps.items() if s == "" or s in live}
    unsafe = [st for s, st in mm.last_stamps.items() if s != session_id or ahead]
    mm.last_stamps[session_id] = offload.begin(unsafe, restore_allowed=not ahead)
