"""MemoryManager: memsvc's service object. It owns the pool and makes every memory decision.

Contract (the same in process and across gRPC): an executor registers its KV geometry and
a budget and gets the pool; `reserve(plan)` grants slots in plan order, performs every
block copy it decided (copy-on-write, swap-out to the host swap space, swap-in) before it
returns, and reports preemptions (by swap or recompute, see pagedserve.memsvc.preemption_policy) and
resumed sequences; `free`, `fork` and `stats` act on sequences by id. Every ReserveResult
carries this manager's `pool_epoch` (docs/ARCHITECTURE.md, "The pool epoch") and its
`stamp`: a block keyed by that Reserve is a prefix-cache hit only once a later plan of the
session confirms the stamp's step ran (`Plan.written`; `Plan.void` and `Plan.failed` say
what did not: pagedserve.memsvc.step_stamps, pagedserve.memsvc.unwritten_keys).

The host swap space (`swap_space`) is a block-major tensor like the pool (pinned when
the pool is on a GPU); block-copy time is measured when it is allocated and with every
swap, and the recompute cost is learned from the step reports in each plan (see
pagedserve.memsvc.cost_model).

The prefix cache's host tier (`kv_offload`, off by default) is a second host tensor of
the same layout, separate from the swap space: evicted cached blocks are copied there when
the cost model says a hit pays, and prefix hits there are copied back in, both before
Reserve answers (pagedserve.memsvc.prefix_offload; docs/ARCHITECTURE.md).

A tensor-parallel group registers with `ranks` > 1: memsvc holds one pool per rank (and
one swap space and host tier per rank) of the same block geometry, 1/ranks of the KV heads
each (pagedserve.memsvc.kv_pool.rank_geometry); every decision is made once, on block ids, and every
block copy is applied to every rank's pools. Capacity and budgets count all ranks' bytes.
A rank that holds its own pool (`holds_pool`: a rank on another node) gets none here: memsvc
preempts by recompute alone and keeps no host tier, and each answer's copy-on-write copies
go back in `block_copies` for that rank to apply before the step; the group registering
again means those pools are new and empty, so everything memsvc held is dropped under a
new `pool_epoch` (pagedserve.memsvc.held_pools).

With `MemoryConfig.shared`, the pool lives where another process can map it: a POSIX
shared-memory segment on the CPU (`shm_pool`), a CUDA IPC allocation on a GPU named by
UUID (`cuda_ipc`). Calls that carry a `session_id` act in that session's namespace of
sequence ids and renew its lease; `expire_sessions` frees what lapsed sessions owned; a
session holding its share of the pool admits no new sequence (pagedserve.memsvc.fair_share).

Not thread-safe: memsvc's server serializes every call with one lock.
"""
from __future__ import annotations

import functools
import uuid

import torch

from pagedserve.kernels import copy_blocks
from pagedserve.memsvc import make_allocator
from pagedserve.memsvc.config import CPU_KV_GIB, GIB, MemoryConfig
from pagedserve.memsvc.fair_share import over_share
from pagedserve.memsvc.held_pools import check_holds, held_copies, held_text
from pagedserve.memsvc.host_pool import (allocate_host_pool, finish_copies, host_blocks_for, measure_block_copy,
                              timed_copy)
from pagedserve.memsvc.kv_pool import allocate_pool, num_blocks_for_budget, rank_geometry
from pagedserve.memsvc.preemption_policy import PreemptionPolicy
from pagedserve.memsvc.sessions import Sessions
from pagedserve.memsvc.step_planner import StepPlanner, check_plan
from pagedserve.memsvc.step_stamps import StepStamps
from pagedserve.wire.protocol import KVGeometry, Plan, PoolStats, Preemption, ReserveResult


HOST_TIER_FIELDS = ("host_tier_blocks", "host_tier_blocks_used", "host_tier_lookups", "host_tier_hits",
                    "host_tier_hit_rate", "host_tier_offloaded", "host_tier_restored",
                    "host_tier_dropped", "host_tier_evicted", "host_tier_tokens_restored")


def _without(plan: Plan, gone: set[str]) -> Plan:
    """`plan` less the running sequences in `gone`."""
    ids, counts, tokens = [], [], []
    at = 0
    for seq_id, n in zip(plan.run_ids, plan.run_counts):
        if seq_id not in gone:
            ids.append(seq_id)
            counts.append(n)
            tokens += plan.run_tokens[at:at + n]
        at += n
    return Plan(plan.entries, plan.free, plan.step_tokens, plan.step_seconds,
                run_ids=ids, run_counts=counts, run_tokens=tokens)


class MemoryManager:
    def __init__(self, config: MemoryConfig):
        self.config = config
        self.geometry: KVGeometry | None = None
        self.pool: torch.Tensor | None = None  # rank 0's pool (the only one without TP)
        self.pools: list[torch.Tensor] = []  # the pools memsvc holds: every rank's but held ones
        self.ranks = 1
        self.holds_pool: list[bool] = []  # per rank: it holds its own pool (pagedserve.memsvc.held_pools)
        self.pool_device: str | None = None  # what the executor asked for
        self.shm = None  # pagedserve.pool_share.shm_pool.ShmPool when the CPU pool is shared (rank 0's)
        self.shms: list = []  # every rank's ShmPool
        self.cuda_handle = None  # pagedserve.pool_share.cuda_ipc.CudaIpcHandle when the GPU pool is shared
        self.allocator = None
        self.planner: StepPlanner | None = None
        self.sessions = Sessions(config.session_lease)
        self.num_preemptions = 0
        self.host_pool: torch.Tensor | None = None
        self.tier_pool: torch.Tensor | None = None  # the prefix cache's host tier
        self.host_pools: list[torch.Tensor] = []  # per rank (host_pool is rank 0's)
        self.tier_pools: list[torch.Tensor] = []
        self._last_stamp: dict[str, int] = {}  # session -> stamp of its last Reserve
        self.policy = PreemptionPolicy(config.preemption_mode)
        self.pool_epoch = uuid.uuid4().hex  # names this manager's pool in every ReserveResult
        self.stamps = StepStamps()

    def register_executor(self, geometry: KVGeometry, budget_bytes: int = 0,
                          device: str | None = None, max_model_len: int = 0, ranks: int = 1,
                          holds_pool: list[bool] | None = None):
        """Allocate the pool for this geometry (once) and return it; with `ranks` > 1 (a
        tensor-parallel group, `geometry` holding all its KV heads) the list of every rank's
        pool, rank r's at r (None for a rank that `holds_pool` itself: pagedserve.memsvc.held_pools).

        A later executor (a restart, a replica) with the same geometry, device and ranks gets
        the same pool; a different one is a ValueError. Size: `config.num_blocks`, else
        `config.kv_tokens`, else `config.kv_memory`, else `budget_bytes` (the executor's, from
        its --gpu-memory-utilization; none on a GPU is a ValueError), else CPU_KV_GIB; bytes
        count all ranks.
        `max_model_len` 0 means `config.max_model_len`.
        """
        device = device or self.config.device
        holds = check_holds(holds_pool, ranks, self.config)
        if self.pool is not None:
            if (geometry != self.geometry or device != self.pool_device or ranks != self.ranks
                    or holds != self.holds_pool):
                raise ValueError(f"the pool exists for {self.geometry} on {self.pool_device} "
                                 f"({self.ranks} ranks{held_text(self.holds_pool)}); this executor "
                                 f"sent {geometry} on {device} ({ranks} ranks{held_text(holds)})")
            if any(holds):  # the group restarted: its ranks' own pools are new and empty
                self._new_epoch()
            return self._rank_pools()
        per_rank = rank_geometry(geometry, ranks)
        cfg = self.config
        self.holds_pool = holds
        if any(holds):
            self.policy = PreemptionPolicy("recompute")
        num_blocks = cfg.num_blocks
        if num_blocks is None and cfg.kv_tokens is not None:
            num_blocks = cfg.kv_tokens // geometry.block_size
            if num_blocks < 1:
                raise ValueError(f"kv_tokens={cfg.kv_tokens} holds no block of {geometry.block_size} tokens")
        if num_blocks is None:
            if cfg.kv_memory is None and not budget_bytes and device != "cpu":
                raise ValueError(f"the executor found no memory left on {device} for the KV pool (its "
                                 "log says what the weights and a step take): lower what else runs "
                                 "there, raise the executor's --gpu-memory-utilization, or size the "
                                 "pool with memsvc's --kv-memory or --kv-tokens")
            if cfg.kv_memory is not None or not budget_bytes:
                budget_bytes = int((cfg.kv_memory or CPU_KV_GIB) * GIB)
            num_blocks = num_blocks_for_budget(geometry, budget_bytes)
        self.pools = [self._allocate(per_rank, num_blocks, device, r) for r in range(ranks) if not holds[r]]
        self.pool, self.ranks = self.pools[0], ranks
        self.geometry, self.pool_device = geometry, device
        num_host = 0
        if cfg.policy == "paged" and self.policy.mode != "recompute":
            num_host = cfg.num_host_blocks
            if num_host is None:
                num_host = host_blocks_for(geometry, int(cfg.swap_space * GIB))
        num_tier = 0
        if cfg.policy == "paged" and cfg.prefix_caching and not any(holds):
            num_tier = cfg.num_offload_blocks
            if num_tier is None:
                num_tier = host_blocks_for(geometry, int(cfg.kv_offload * GIB))
        self._new_allocator = functools.partial(
            make_allocator, cfg.policy, num_blocks, geometry.block_size,
            max_model_len=max_model_len or cfg.max_model_len, enable_prefix_caching=cfg.prefix_caching,
            num_host_blocks=num_host, window=geometry.window or None, num_offload_blocks=num_tier)
        self.allocator = self._new_allocator()
        if num_host:
            self.host_pools = [allocate_host_pool(per_rank, num_host, p) for p in self.pools]
            self.host_pool = self.host_pools[0]
        if num_tier:
            self.tier_pools = [allocate_host_pool(per_rank, num_tier, p) for p in self.pools]
            for tier in self.tier_pools:
                tier.zero_()  # its pages faulted in now, not by offloads in Reserve
            self.tier_pool = self.tier_pools[0]
            self.allocator.offload.pays = self._offload_pays
        host = self.host_pool if self.host_pool is not None else self.tier_pool
        if host is not None:
            seconds = measure_block_copy(self.pool, host)
            if seconds is not None:  # a block copy moves every rank's part
                self.policy.costs.observe_copy(1, seconds * ranks)
        self.planner = StepPlanner(self.allocator, self.policy, int(cfg.watermark * num_blocks))
        return self._rank_pools()

    def _rank_pools(self):
        """rank 0's pool alone, or every rank's (None where the rank holds its own)."""
        if self.ranks == 1:
            return self.pool
        own = iter(self.pools)
        return [None if held else next(own) for held in self.holds_pool]

    def _new_epoch(self) -> None:
        """Forget every sequence, cached block and session under a new pool epoch, as a new
        memsvc process would, keeping the pools memsvc holds (their contents go unread)."""
        self.pool_epoch = uuid.uuid4().hex
        self.allocator = self._new_allocator()
        self.planner = StepPlanner(self.allocator, self.policy, self.planner.watermark_blocks)
        self.sessions = Sessions(self.config.session_lease)
        self._last_stamp = {}
        self.stamps = StepStamps()

    def _allocate(self, geometry: KVGeometry, num_blocks: int, device: str, rank: int = 0) -> torch.Tensor:
        from pagedserve.pool_share.cuda_ipc import allocate_cuda_pool, is_gpu_uuid

        if not self.config.shared:
            return allocate_pool(geometry, num_blocks, device)
        if is_gpu_uuid(device) and rank > 0:
            raise ValueError("rank_devices: one pool per GPU for a tensor-parallel group is not "
                             "built yet (only CPU ranks, each with a shared-memory pool)")
        if is_gpu_uuid(device):
            pool, self.cuda_handle = allocate_cuda_pool(geometry, num_blocks, device)
            return pool
        if device != "cpu":
            raise ValueError(f"a shared pool lives on 'cpu' or a GPU named by UUID, not {device!r}")
        from pagedserve.pool_share.shm_pool import ShmPool

        name = self.config.shm_name
        if name and rank:
            name = f"{name}-rank{rank}"
        shm = ShmPool(geometry, num_blocks, name)
        self.shms.append(shm)
        self.shm = self.shms[0]
        return shm.tensor

    def reserve(self, plan: Plan, session_id: str = "") -> ReserveResult:
        """Grant slots for one step; see StepPlanner.

        With a session, the plan's ids are rewritten in place, and a running entry that
        memsvc no longer holds (its session lapsed, memsvc restarted) comes back preempted
        for recompute instead of failing the step.
        """
        planner = self._planner()
        check_plan(plan)
        stamp = self._begin_act(session_id, plan.written, plan.void, plan.failed)
        try:
            result = self._reserve(planner, plan, session_id)
        except BaseException:
            self.allocator.drop_unwritten([stamp])
            raise
        result.stamp = stamp
        return result

    def _reserve(self, planner: StepPlanner, plan: Plan, session_id: str) -> ReserveResult:
        self._begin_offload(session_id, plan.ahead)
        lost = []
        back = self.sessions.enter(session_id, plan) if session_id else None
        self._fill(plan.fills, session_id, back)
        if plan.forks:  # first; a parent memsvc no longer holds leaves its child lost (recompute)
            has = self.allocator.has_sequence
            for parent, child in plan.forks:
                if has(parent) and not has(child):
                    self.allocator.fork(parent, child)
                    if session_id:
                        self.sessions.own(session_id, child)
            plan.forks = []
        if session_id:
            has = self.allocator.has_sequence
            lost = [] if plan.ahead else [s for s in plan.run_ids if not has(s)]
            if lost:  # (a plan made ahead that names them is deferred instead)
                plan = _without(plan, set(lost))
            held_back = [e.seq_id for e in plan.entries] if plan.entries and over_share(self, session_id) else []
            if held_back:  # this session holds its share of a shared pool: no new sequence now
                plan.entries = []
        self.policy.costs.observe_step(plan.step_tokens, plan.step_seconds)
        reservation = planner.reserve(plan)
        self._copy(reservation.copies)
        result = reservation.result
        result.pool_epoch = self.pool_epoch
        if self.ranks > len(self.pools):
            result.block_copies = held_copies(reservation.copies)
        result.preempted[:0] = [Preemption(s, "recompute") for s in lost]
        if session_id:
            result.waiting.extend(held_back)
        self.num_preemptions += len(reservation.result.preempted)
        if session_id:
            self.sessions.leave(session_id, plan, lost, result, self.allocator.has_sequence, back)
        return result

    def _begin_act(self, session_id: str, written: int, void: bool, failed: list[str]) -> int:
        """Settle what the session says of its earlier steps, then stamp this Reserve."""
        if session_id:
            failed = [self.sessions.internal(session_id, s) for s in failed]
        return self.stamps.begin_act(self.allocator, session_id, written, void, failed)

    def _offload_pays(self) -> bool:
        """A copy out now and in at a hit costs less than computing the block's tokens."""
        if self.config.offload_policy == "always":
            return True
        costs = self.policy.costs
        return (costs.seconds_per_token is not None and costs.seconds_per_block is not None
                and costs.swap_seconds(1) <= costs.recompute_seconds(self.geometry.block_size))

    def _begin_offload(self, session_id: str, ahead: bool) -> None:
        """Stamp this Reserve. A session's last step may still run unless this plan is its
        own and not made ahead: blocks keyed by those Reserves are not offloaded now, and
        a plan made ahead restores nothing (the step in flight may write a freed block)."""
        offload = getattr(self.allocator, "offload", None)
        if offload is None:
            return
        live = self.sessions.by_id
        self._last_stamp = {s: st for s, st in self._last_stamp.items() if s == "" or s in live}
        unsafe = [st for s, st in self._last_stamp.items() if s != session_id or ahead]
        self._last_stamp[session_id] = offload.begin(unsafe, restore_allowed=not ahead)

    def _fill(self, fills: list[tuple[str, int, int]], session_id: str, back) -> None:
        """Token ids an earlier plan sent as pending, its ids in the session's namespace; a
        sequence memsvc no longer holds (freed, lost with a session or a restart) is skipped."""
        if fills:
            self.allocator.fill_all(fills, self.sessions.fill_ids(session_id, fills, back) if session_id else None)

    def _copy(self, copies: list[tuple[str, int, int]]) -> None:
        """Perform the planner's copies in order, one copy_blocks per run of one kind; time
        the swaps for the cost model."""
        i = 0
        while i < len(copies):
            kind = copies[i][0]
            j = i
            while j < len(copies) and copies[j][0] == kind:
                j += 1
            src = [c[1] for c in copies[i:j]]
            dst = [c[2] for c in copies[i:j]]
            if kind == "cow":  # every rank's pool: the same block ids on each
                for pool in self.pools:
                    copy_blocks(pool, pool, torch.tensor(src, dtype=torch.long),
                                torch.tensor(dst, dtype=torch.long))
            else:
                hosts = self.tier_pools if kind in ("offload", "restore") else self.host_pools
                seconds = 0.0
                for pool, host in zip(self.pools, hosts):
                    pair = (pool, host) if kind in ("out", "offload") else (host, pool)
                    seconds += timed_copy(*pair, src, dst)
                self.policy.costs.observe_copy(j - i, seconds)
            i = j
        if copies:  # complete before Reserve answers: the executor reads from another context
            for pool in self.pools:
                finish_copies(pool)

    def free(self, seq_ids: list[str], session_id: str = "") -> None:
        for seq_id in seq_ids:
            if session_id:
                seq_id = self.sessions.internal(session_id, seq_id)
                self.sessions.disown(session_id, seq_id)
            if self.allocator is not None and self.allocator.has_sequence(seq_id):
                self.allocator.free(seq_id)

    def tables(self, seq_ids: list[str], session_id: str = "") -> list[list[int]]:
        """Each sequence's whole block table ([] for one memsvc does not hold): what an
        executor that lost its state is sent again (pagedserve.wire.step_delta.encode_delta)."""
        alloc = self._planner().allocator
        out = []
        for seq_id in seq_ids:
            if session_id:
                seq_id = self.sessions.internal(session_id, seq_id)
            out.append(alloc.block_table(seq_id) if alloc.has_sequence(seq_id) else [])
        return out

    def fork(self, parent_id: str, child_id: str, session_id: str = "") -> None:
        self._planner()
        if session_id:
            parent_id = self.sessions.internal(session_id, parent_id)
            child_id = self.sessions.internal(session_id, child_id)
        self.allocator.fork(parent_id, child_id)
        if session_id:
            self.sessions.own(session_id, child_id)

    def expire_sessions(self, now: float | None = None) -> dict[str, int]:
        """Free the sequences of sessions not heard from for a lease: {session: freed}."""
        freed = {}
        for session in self.sessions.lapsed(now):
            alive = [s for s in session.seqs if self.allocator is not None and self.allocator.has_sequence(s)]
            for seq_id in alive:
                self.allocator.free(seq_id)
            if self.allocator is not None:
                self.allocator.drop_unwritten(self.stamps.end(session.session_id))
            freed[session.session_id] = len(alive)
        return freed

    def stats(self) -> PoolStats:
        self._planner()
        alloc = self.allocator
        return PoolStats(
            snapshot=alloc.snapshot().as_dict(),
            prefix_cache_queries=getattr(alloc, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(alloc, "prefix_cache_hits", 0),
            num_preemptions=self.num_preemptions,
            num_sequences=len(alloc.sequence_ids()) if hasattr(alloc, "sequence_ids") else 0,
            num_sessions=len(self.sessions.by_id),
            preemption=self.preemption_stats(),
        )

    def preemption_stats(self) -> dict:
        counts, costs = self._planner().counts, self.policy.costs
        swap = getattr(self.allocator, "swap_space", None)
        return {
            "preemption_mode": self.policy.mode,
            "num_swapped_out": counts.swapped_out, "num_swapped_in": counts.swapped_in,
            "num_recomputed": counts.recomputed, "num_swap_fallbacks": counts.swap_fallbacks,
            "host_blocks": swap.num_blocks if swap else 0,
            "host_blocks_free": swap.num_free if swap else 0,
            "swap_seconds_per_block": costs.seconds_per_block or 0.0,
            "recompute_seconds_per_token": costs.seconds_per_token or 0.0,
            **self.host_tier_stats(),
        }

    def host_tier_stats(self) -> dict:
        """The prefix cache's host tier (zeros when off): occupancy in blocks, its hit rate
        over the blocks looked up past the pool's hits, blocks offloaded / restored /
        dropped / evicted, and prompt tokens not recomputed thanks to it."""
        offload = getattr(self.allocator, "offload", None)
        if offload is None:
            return dict.fromkeys(HOST_TIER_FIELDS, 0)
        tier, s = offload.tier, offload.tier.stats
        return {"host_tier_blocks": tier.num_blocks, "host_tier_blocks_used": tier.num_used,
                "host_tier_lookups": s.lookups, "host_tier_hits": s.hits,
                "host_tier_hit_rate": s.hit_rate, "host_tier_offloaded": s.offloaded,
                "host_tier_restored": s.restored, "host_tier_dropped": s.dropped,
                "host_tier_evicted": s.evicted, "host_tier_tokens_restored": offload.tokens_restored}

    def check_integrity(self) -> None:
        self._planner()
        self.allocator.check_integrity()

    def close(self) -> None:
        """Give up the pool's name (shared memory is unlinked; mappings stay valid)."""
        for shm in self.shms:
            shm.unlink()

    def _planner(self) -> StepPlanner:
        if self.planner is None:
            raise RuntimeError("no executor has registered: the pool does not exist yet")
        return self.planner
