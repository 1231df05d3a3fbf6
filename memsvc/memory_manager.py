"""MemoryManager: memsvc's service object. It owns the pool and makes every memory decision.

Contract (the same across gRPC later): an executor registers its KV geometry and a budget
and gets the pool; `reserve(plan)` grants slots in plan order, performs the block copies
it decided (copy-on-write) on the pool before it returns, and reports preemptions;
`free`, `fork` and `stats` act on sequences by id.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import copy_blocks
from memsvc import make_allocator
from memsvc.kv_pool import allocate_pool, num_blocks_for_budget
from memsvc.step_planner import StepPlanner
from pagedserve.protocol import KVGeometry, Plan, ReserveResult


@dataclass
class MemoryConfig:
    policy: str = "paged"
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # wins over kv_budget_bytes when set
    kv_budget_bytes: int = 2 << 30
    max_model_len: int = 8192
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass
class MemoryStats:
    snapshot: dict
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class MemoryManager:
    def __init__(self, config: MemoryConfig):
        self.config = config
        self.geometry: KVGeometry | None = None
        self.pool: torch.Tensor | None = None
        self.allocator = None
        self.planner: StepPlanner | None = None
        self.num_preemptions = 0

    def register_executor(self, geometry: KVGeometry) -> torch.Tensor:
        """Allocate the pool for this geometry (once) and return it."""
        if self.pool is not None:
            if geometry != self.geometry:
                raise ValueError(f"pool exists with geometry {self.geometry}, executor sent {geometry}")
            return self.pool
        cfg = self.config
        num_blocks = cfg.num_blocks or num_blocks_for_budget(geometry, cfg.kv_budget_bytes)
        self.geometry = geometry
        self.pool = allocate_pool(geometry, num_blocks, cfg.device)
        self.allocator = make_allocator(
            cfg.policy, num_blocks, geometry.block_size,
            max_model_len=cfg.max_model_len, enable_prefix_caching=cfg.enable_prefix_caching,
        )
        self.planner = StepPlanner(self.allocator)
        return self.pool

    def reserve(self, plan: Plan) -> ReserveResult:
        reservation = self._planner().reserve(plan)
        if reservation.copies:
            src = torch.tensor([s for s, _ in reservation.copies], dtype=torch.long)
            dst = torch.tensor([d for _, d in reservation.copies], dtype=torch.long)
            copy_blocks(self.pool, self.pool, src, dst)
        self.num_preemptions += len(reservation.result.preempted)
        return reservation.result

    def free(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            if self.allocator.has_sequence(seq_id):
                self.allocator.free(seq_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        self._planner()
        self.allocator.fork(parent_id, child_id)

    def stats(self) -> MemoryStats:
        self._planner()
        alloc = self.allocator
        return MemoryStats(
            snapshot=alloc.snapshot().as_dict(),
            prefix_cache_queries=getattr(alloc, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(alloc, "prefix_cache_hits", 0),
            num_preemptions=self.num_preemptions,
        )

    def check_integrity(self) -> None:
        self._planner()
        self.allocator.check_integrity()

    def _planner(self) -> StepPlanner:
        if self.planner is None:
            raise RuntimeError("no executor has registered: the pool does not exist yet")
        return self.planner
