"""The host tier through the MemoryManager and the batching loop, with the model-free
executor (which reads every context back through the block table, so a block restored
with the wrong contents changes the output): multi-turn chats give the reference outputs
with the tier on and off, fewer tokens computed with it on, no block left held, the tier
in Stats and /metrics, the cost model's say, and a memsvc restart that loses the tier."""
import random

import pytest
from prometheus_client import generate_latest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.cost_model import CostModel
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.memsvc.server import MemoryService
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry
from tests.support.fake_executor import FakeExecutor
from tests.support.fake_loop import expected, greedy, run_all

BS = 4


def make_loop(tier, *, num_blocks=24, policy="always", mode="recompute", host_blocks=None):
    ex = FakeExecutor(BS)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, num_offload_blocks=tier,
                                     offload_policy=policy, preemption_mode=mode,
                                     num_host_blocks=host_blocks))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    return BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, overlap=False)), mem, ex


def chat(loop, mem, *, conversations=4, turns=4, seed=0, salts=False):
    """Every turn's prompt is the whole history; integrity checked after every step."""
    rng = random.Random(seed)
    system = [rng.randrange(998) for _ in range(10)]
    history = {c: list(system) for c in range(conversations)}
    outputs = []
    for turn in range(turns):
        for c in range(conversations):
            history[c] += [rng.randrange(998) for _ in range(rng.randint(3, 7))]
            loop.add_request(f"{c}-{turn}", list(history[c]), greedy(6),
                             salt=f"tenant-{c % 2}" if salts else None)
        got = {}
        while loop.has_work():
            for d in loop.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
            mem.check_integrity()
        for c in range(conversations):
            tokens = got[f"{c}-{turn}"]
            assert tokens == expected(history[c], 6, 7), (c, turn)
            history[c] += tokens
            outputs.append(tokens)
    return outputs


def assert_clean(mem):
    mem.check_integrity()
    stats = mem.stats()
    assert stats.snapshot["blocks_referenced"] == 0 and stats.num_sequences == 0


@pytest.mark.parametrize("salts", [False, True])
def test_multi_turn_outputs_are_the_same_with_the_tier_and_it_computes_less(salts):
    off_loop, off_mem, off_ex = make_loop(0)
    on_loop, on_mem, on_ex = make_loop(64)
    assert chat(off_loop, off_mem, salts=salts) == chat(on_loop, on_mem, salts=salts)
    assert on_ex.num_executed_tokens < 0.7 * off_ex.num_executed_tokens
    p = on_mem.stats().preemption
    assert p["host_tier_offloaded"] > 0 and p["host_tier_restored"] > 0
    assert p["host_tier_tokens_restored"] == p["host_tier_restored"] * BS
    assert on_mem.stats().prefix_cache_hits > off_mem.stats().prefix_cache_hits
    assert off_mem.stats().preemption["host_tier_blocks"] == 0
    assert_clean(on_mem)
    assert_clean(off_mem)


@pytest.mark.parametrize("tier, num_blocks, mode, host_blocks", [
    (1, 24, "recompute", None),  # a tier of one block
    (6, 16, "swap", 8),  # tiny pool, preemption by swap beside the tier
    (40, 12, "auto", None),
])
def test_outputs_hold_for_small_tiers_and_pools_with_preemption(tier, num_blocks, mode, host_blocks):
    loop, mem, _ = make_loop(tier, num_blocks=num_blocks, mode=mode, host_blocks=host_blocks)
    ref_loop, ref_mem, _ = make_loop(0, num_blocks=num_blocks, mode=mode, host_blocks=host_blocks)
    assert chat(loop, mem, conversations=5, turns=3, seed=4) == chat(ref_loop, ref_mem, conversations=5,
                                                                     turns=3, seed=4)
    assert_clean(mem)


class Priced(CostModel):
    def __init__(self, per_block, per_token):
        super().__init__(seconds_per_block=per_block)
        self._per_token = per_token

    def observe_copy(self, num_blocks, seconds):
        pass

    @property
    def seconds_per_token(self):
        return self._per_token


@pytest.mark.parametrize("costs, offloads", [(Priced(1e-6, 1e-3), True), (Priced(1e-2, 1e-6), False),
                                             (Priced(1e-6, None), False)])
def test_auto_offloads_only_when_the_cost_model_says_a_hit_pays(costs, offloads):
    loop, mem, _ = make_loop(64, policy="auto")
    mem.policy.costs = costs
    chat(loop, mem, turns=3)
    p = mem.stats().preemption
    assert (p["host_tier_offloaded"] > 0) == offloads
    assert (p["host_tier_dropped"] > 0) == (not offloads)
    assert_clean(mem)


def new(seq_id, prompt):
    return PlanEntry(seq_id, list(prompt), True, len(prompt) + 3, max_new_tokens=len(prompt))


def test_a_plan_made_ahead_neither_restores_nor_offloads_what_the_step_in_flight_may_write():
    mem = MemoryManager(MemoryConfig(num_blocks=4, num_offload_blocks=8, offload_policy="always",
                                     watermark=0))
    mem.register_executor(KVGeometry(1, 1, 1, BS))
    a, b = list(range(100, 113)), list(range(300, 313))
    r = mem.reserve(Plan([new("a", a)]), "s1")
    # "a" is cancelled while its prefill may still run; the next plan is made ahead: a's
    # blocks are not known to be written, so they hold no key to offload
    r = mem.reserve(Plan([new("b", b)], free=["a"], ahead=True), "s1")
    p = mem.stats().preemption
    assert p["host_tier_offloaded"] == 0
    r = mem.reserve(Plan([], free=["b"], written=r.stamp), "s1")  # b's prefill ran
    r = mem.reserve(Plan([new("c", list(range(500, 513)))], written=r.stamp), "s1")  # serial: b's blocks are final
    assert mem.stats().preemption["host_tier_offloaded"] == 3
    r = mem.reserve(Plan([], free=["c"], written=r.stamp), "s1")
    r = mem.reserve(Plan([new("d", b)], ahead=True, written=r.stamp), "s1")
    assert r.grants[0].num_cached_tokens == 0  # ahead: the tier is not read
    r = mem.reserve(Plan([], free=["d"], written=r.stamp), "s1")
    r = mem.reserve(Plan([new("e", b)], written=r.stamp), "s1")
    assert r.grants[0].num_cached_tokens == 12
    mem.check_integrity()


def test_stats_and_metrics_show_the_tier():
    loop, mem, _ = make_loop(64)
    chat(loop, mem, turns=3)
    text = generate_latest(MemoryService(mem).metrics.registry).decode()
    p = mem.stats().preemption
    assert f'pagedserve:host_tier_blocks{{state="used"}} {float(p["host_tier_blocks_used"])}' in text
    for name in ("lookups", "hits", "offloaded", "restored", "tokens_restored"):
        assert f"pagedserve:host_tier_{name}_total {float(p[f'host_tier_{name}'])}" in text
    assert 0 < p["host_tier_hit_rate"] <= 1


def test_a_restarted_memsvc_has_an_empty_tier_and_serves_the_same():
    loop, mem, ex = make_loop(64)
    first = chat(loop, mem, turns=2)
    assert mem.stats().preemption["host_tier_blocks_used"] > 0
    fresh = MemoryManager(mem.config)  # what a memsvc killed and started again holds
    ex.attach_pool(fresh.register_executor(ex.info.kv))
    loop2 = BatchLoop(fresh, ex, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, overlap=False))
    assert fresh.stats().preemption["host_tier_blocks_used"] == 0
    assert chat(loop2, fresh, turns=2) == first
    assert_clean(fresh)
