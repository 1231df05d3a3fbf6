"""MemoryManager: memsvc's service object. It owns the pool and makes every memory decision.

Contract (the same in process and across gRPC): an executor registers its KV geometry and
a budget and gets the pool (pagedserve.memsvc.pool_registration: its size, one pool per
tensor-parallel rank, shared or held pools); `reserve(plan)` grants slots in plan order
(pagedserve.memsvc.step_planner), performs every block copy it decided (copy-on-write,
swap-out to the host swap space, swap-in, the prefix cache's host tier: pagedserve.memsvc.pool_copies)
before it returns, and reports preemptions (by swap or recompute, see
pagedserve.memsvc.preemption_policy) and resumed sequences; `free`, `fork` and `tables`
act on sequences by id; `stats` reads them all (pagedserve.memsvc.pool_stats). Every
ReserveResult carries this manager's `pool_epoch` (docs/ARCHITECTURE.md, "The pool epoch")
and its `stamp`: a block keyed by that Reserve is a prefix-cache hit only once a later plan
of the session confirms the stamp's step ran (`Plan.written`; `Plan.void` and `Plan.failed`
say what did not: pagedserve.memsvc.step_stamps, pagedserve.memsvc.unwritten_keys). The
recompute cost is learned from the step reports in each plan (pagedserve.memsvc.cost_model);
what the host tier may take, from pagedserve.memsvc.offload_decisions.

Calls that carry a `session_id` act in that session's namespace of sequence ids and renew
its lease; `expire_sessions` frees what lapsed sessions owned; a session holding its share
of the pool admits no new sequence (pagedserve.memsvc.fair_share).

Not thread-safe: memsvc's server serializes every call with one lock.
"""
from __future__ import annotations

import uuid

import torch

from pagedserve.memsvc import pool_stats
from pagedserve.memsvc.config import MemoryConfig
from pagedserve.memsvc.fair_share import over_share
from pagedserve.memsvc.held_pools import held_copies
from pagedserve.memsvc.offload_decisions import begin_offload
from pagedserve.memsvc.pool_copies import perform_copies
from pagedserve.memsvc.pool_registration import register
from pagedserve.memsvc.preemption_policy import PreemptionPolicy
from pagedserve.memsvc.sessions import Sessions
from pagedserve.memsvc.step_planner import StepPlanner, check_plan
from pagedserve.memsvc.step_stamps import StepStamps
from pagedserve.wire.protocol import KVGeometry, PoolStats
from pagedserve.wire.reserve_messages import Fills, Plan, Preemption, ReserveResult


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
        self.last_stamps: dict[str, int] = {}  # session -> stamp of its last Reserve (offload_decisions)
        self.policy = PreemptionPolicy(config.preemption_mode)
        self.pool_epoch = uuid.uuid4().hex  # names this manager's pool in every ReserveResult
        self.stamps = StepStamps()

    def register_executor(self, geometry: KVGeometry, budget_bytes: int = 0,
                          device: str | None = None, max_model_len: int = 0, ranks: int = 1,
                          holds_pool: list[bool] | None = None):
        """The pool for this geometry, allocated once; every rank's with `ranks` > 1
        (pagedserve.memsvc.pool_registration.register)."""
        return register(self, geometry, budget_bytes, device, max_model_len, ranks, holds_pool)

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
        offload = getattr(self.allocator, "offload", None)
        if offload is not None:
            begin_offload(self, offload, session_id, plan.ahead)
        lost = []
        back = self.sessions.enter(session_id, plan) if session_id else None
        steady = self._steady_fills(plan, back)  # else the fills go first, one by one
        if steady is None:
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
            lost = [] if plan.ahead or steady else [s for s in plan.run_ids if not has(s)]
            if lost:  # (a plan made ahead that names them is deferred instead)
                plan = _without(plan, set(lost))
            held_back = [e.seq_id for e in plan.entries] if plan.entries and over_share(self, session_id) else []
            if held_back:  # this session holds its share of a shared pool: no new sequence now
                plan.entries = []
        self.policy.costs.observe_step(plan.step_tokens, plan.step_seconds)
        reservation = planner.reserve(plan, steady, checked=True)  # (by reserve)
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

    def _fill(self, fills: Fills, session_id: str, back) -> None:
        """Token ids an earlier plan sent as pending, its ids in the session's namespace; a
        sequence memsvc no longer holds (freed, lost with a session or a restart) is skipped."""
        if fills:
            self.allocator.fill_all(fills, self.sessions.fill_ids(session_id, fills, back) if session_id else None)

    def _steady_fills(self, plan: Plan, back):
        """The fills of a steady step, checked for the growth to apply in its pass over the
        running tables (pagedserve.memsvc.steady_fills): one per running sequence, in plan
        order, no fork, no free of a running one; None otherwise."""
        fills, ids = plan.fills, plan.run_ids
        if not fills or len(fills) != len(ids) or plan.forks:
            return None
        if fills.seq_ids != (ids if back is None else back.ids):
            return None
        if plan.free and not set(plan.free).isdisjoint(ids):
            return None
        return self.allocator.steady_fills(ids, fills.positions, fills.token_ids)

    def _copy(self, copies: list[tuple[str, int, int]]) -> None:
        if copies:
            perform_copies(self, copies)

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
        return pool_stats.stats(self)

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
