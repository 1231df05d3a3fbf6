"""The paged allocator's fast paths for a step (grow_running, fill_all over columns) give
exactly what the reference gives, one sequence at a time (grow_if_fits, fill), on random
workloads: plans made ahead with pending tokens and fills, forks and copy-on-write,
preemption by swap and recompute, resumption, prefix-cache hits, a sliding window, with
and without prefix caching and sessions. Results, tables, pool and unconfirmed keys must
agree after every plan, and the pool's integrity check must pass on both."""
import copy
import functools
import random

import pytest

from pagedserve.memsvc.allocator import KVAllocator
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.memsvc.step_stamps import StepStamps
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry

BS = 4
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [2, 2, 2, 2]]


def manager(reference: bool, *, window: int, caching: bool, mode: str) -> MemoryManager:
    mem = MemoryManager(MemoryConfig(num_blocks=30, num_host_blocks=10, prefix_caching=caching,
                                     preemption_mode=mode, watermark=0.0))
    mem.register_executor(KVGeometry(1, 1, 1, BS, window=window))
    mem.stamps = StepStamps(start=1)
    mem.pool_epoch = "epoch"
    if reference:  # one sequence at a time: the paths the fast ones must match
        alloc = mem.allocator
        alloc.grow_running = lambda *args: None
        alloc.steady_fills = lambda *args: None
        alloc.fill_all = functools.partial(KVAllocator.fill_all, alloc)
    return mem


def state(mem: MemoryManager):
    a = mem.allocator
    tables = {s: (t.num_tokens, t.block_ids, t.block_keys, t.tail_tokens, t.synced, t.released,
                  t.swapped, t.host_blocks, t.written) for s, t in a._seqs.items()}
    unwritten = {stamp: [(t.seq_id, i, b.block_id, gen, key) for t, i, b, gen, key in records]
                 for stamp, records in a.unwritten.by_stamp.items()}
    cached = {key: b.block_id for key, b in a.pool.cached.items()}
    free = [b.block_id for b in a.pool.free_queue]
    return tables, unwritten, cached, free, a.blocks_released, a.prefix_stats


class Gateway:
    """A random gateway: what it believes of each sequence, and the plans it sends."""

    def __init__(self, rng: random.Random, steady: bool = False):
        self.rng = rng
        self.steady = steady  # mostly every pending token filled, in running order (a steady step)
        self.running: list[str] = []  # priority order
        self.pending: dict[str, list[int]] = {}  # positions of tokens sent as PENDING
        self.swapped: set[str] = set()
        self.next_id = 0
        self.last_stamp = 0
        self.bad = False  # send a bad fill now and then

    def plan(self) -> Plan:
        rng = self.rng
        ahead = rng.random() < (0.95 if self.steady else 0.6)
        if self.steady and rng.random() < 0.9:
            fills = [(s, p, rng.randrange(3)) for s in self.running for p in self.pending.get(s, ())]
        else:
            fills = [(s, p, rng.randrange(3)) for s, ps in self.pending.items() for p in ps if rng.random() < 0.85]
        for s, p, _ in fills:
            self.pending[s].remove(p)
        if rng.random() < 0.1:
            rng.shuffle(fills)
        if rng.random() < 0.05:
            fills.append(("ghost", 3, 1))  # one memsvc does not hold: skipped
        if self.bad and fills and rng.random() < 0.2:  # refused alike, at the same fill
            s, p, t = rng.choice(fills)
            fills.insert(rng.randrange(len(fills) + 1), rng.choice([(s, p, -2), (s, p + 1, 1), (s, p, 0)]))
        free = [s for s in self.running if rng.random() < (0.01 if self.steady else 0.06)]
        for s in free:
            self._forget(s)
        forks = []
        if not ahead and rng.random() < 0.2:
            parents = [s for s in self.running if s not in self.swapped and not self.pending.get(s)]
            if parents:
                child = self._new_id()
                forks.append((rng.choice(parents), child))
                self.running.append(child)
        entries = []
        for s in self.running:
            n = 1 if rng.random() < (0.98 if self.steady else 0.8) else rng.randrange(0, 5)
            tokens = [rng.randrange(3) for _ in range(n)]
            if ahead and tokens and rng.random() < (0.95 if self.steady else 0.7):
                tokens[-1] = PENDING
            entries.append(PlanEntry(s, tokens, False, 64))
        for _ in range(rng.choice([0] * 12 + [1, 2] if self.steady else [0, 0, 0, 1, 2])):
            prompt = rng.choice(PREFIXES) + [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
            entries.append(PlanEntry(self._new_id(), prompt, True, 64, salt=rng.choice([None, None, "x"])))
        return Plan(entries, free=free, forks=forks, ahead=ahead, fills=fills, written=self.last_stamp)

    def heard(self, plan: Plan, result) -> None:
        self.last_stamp = result.stamp
        if result.deferred:
            return
        tokens = dict(zip(plan.run_ids, _split(plan.run_tokens, plan.run_counts)))
        for g in result.grants:
            if g.seq_id not in tokens:  # a new one: its whole prompt was granted
                self.running.append(g.seq_id)
            elif g.num_tokens and tokens[g.seq_id][-1] == PENDING:
                self.pending.setdefault(g.seq_id, []).append(g.start_pos + g.num_tokens - 1)
        for p in result.preempted:
            if p.mode == "swap":
                self.swapped.add(p.seq_id)
            else:
                self._forget(p.seq_id)
        self.swapped.difference_update(result.resumed)
        for s in list(self.running):  # long enough: finished
            if self.rng.random() < 0.02:
                self._forget(s)

    def _forget(self, seq_id: str) -> None:
        if seq_id in self.running:
            self.running.remove(seq_id)
        self.pending.pop(seq_id, None)
        self.swapped.discard(seq_id)

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"


def _split(tokens, counts):
    at = 0
    for n in counts:
        yield tokens[at:at + n]
        at += n


def _untouched_plan(plan: Plan) -> Plan:
    """What the gateway sent (memsvc rewrites a plan's ids in its session's namespace)."""
    return copy.deepcopy(plan)


@pytest.mark.parametrize("window", [0, 2, 7])  # 2: a block leaves the window before its last token is filled
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("session", ["", "g"])
@pytest.mark.parametrize("steady", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_the_fast_paths_match_the_reference(seed, steady, session, mode, caching, window):
    rng = random.Random(seed * 1000 + steady * 500 + len(session) * 10 + (mode == "swap") * 3 + caching + window)
    fast, ref = (manager(r, window=window, caching=caching, mode=mode) for r in (False, True))
    gateway = Gateway(rng, steady)
    fast_steps = 0
    checked = []  # the steady fills the fast manager's check let through
    check = fast.allocator.steady_fills
    fast.allocator.steady_fills = lambda *args: checked.append(check(*args)) or checked[-1]
    for step in range(160):
        gateway.bad = step >= 140
        plan = gateway.plan()
        got = []
        for mem in (fast, ref):
            try:
                got.append(mem.reserve(_untouched_plan(plan), session))
            except (ValueError, KeyError) as e:  # both refuse alike, or neither does
                got.append(type(e))
        assert got[0] == got[1]
        assert state(fast) == state(ref)
        fast.check_integrity()
        ref.check_integrity()
        if isinstance(got[0], type):
            break
        gateway.heard(plan, got[0])
        fast_steps += bool(plan.run_ids) and not got[0].deferred
    assert fast_steps > 20
    if steady and caching:  # the steady fills were taken often
        assert sum(c is not None for c in checked) > 10


def test_the_fast_path_serves_the_steady_step():
    """The steady step (each running sequence +1 pending token, its last filled) is served by
    grow_running: the reference loop is never reached."""
    mem = manager(False, window=0, caching=True, mode="recompute")
    mem.reserve(Plan([PlanEntry(f"s{i}", [i, 1, 2, 3, 4], True, 64) for i in range(3)], written=0))
    mem.planner._grow_each = lambda plan, out: pytest.fail("the reference loop ran")
    fills = []
    for step in range(9):
        plan = Plan([PlanEntry(f"s{i}", [PENDING], False, 64) for i in range(3)], ahead=True, fills=fills)
        r = mem.reserve(plan)
        assert not r.deferred and [g.start_pos for g in r.grants] == [5 + step] * 3
        fills = [(f"s{i}", 5 + step, step % 3) for i in range(3)]
        mem.check_integrity()


@pytest.mark.parametrize("bad", ["position", "token", "twice", "unknown", "freed", "order"])
def test_steady_fills_that_do_not_hold_are_refused_alike(bad):
    """A fill the steady check cannot take (not the pending last token, a negative id, a
    sequence not held, freed in the same plan, out of order) leaves it to the reference:
    both managers answer, or refuse, alike."""
    fast, ref = (manager(r, window=0, caching=True, mode="recompute") for r in (False, True))
    ids = ["a", "b", "c"]
    results = []
    for mem in (fast, ref):
        mem.reserve(Plan([PlanEntry(s, [i, 1, 2, 3, 4, 5, 6], True, 64) for i, s in enumerate(ids)]), "g")
        mem.reserve(Plan([PlanEntry(s, [PENDING], False, 64) for s in ids], ahead=True), "g")
        fills = [(s, 7, 1) for s in ids]
        free = []
        if bad == "position":
            fills[1] = ("b", 6, 1)
        elif bad == "token":
            fills[2] = ("c", 7, -3)
        elif bad == "twice":
            mem.reserve(Plan(ahead=True, fills=[("b", 7, 2)]), "g")
        elif bad == "unknown":
            mem.free(["c"], "g")
        elif bad == "freed":
            free = ["b"]
        else:
            fills[0], fills[1] = fills[1], fills[0]
        plan = Plan([PlanEntry(s, [PENDING], False, 64) for s in ids], ahead=True, fills=fills, free=free)
        try:
            results.append(mem.reserve(plan, "g"))
        except ValueError as e:
            results.append(str(e))
        mem.check_integrity()
    assert results[0] == results[1]
    assert state(fast) == state(ref)
