"""Preemption by swap and by recompute: outputs never change, each kind happens when asked,
swap space running out falls back to recompute, and no block stays referenced afterwards."""
import random

import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.request_intake import derive_seed
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.cost_model import CostModel
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.memsvc.preemption_policy import PreemptionPolicy
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.reserve_messages import Plan, PlanEntry
from tests.support.fake_executor import FakeExecutor
from tests.support.fake_loop import expected, prompts, run_all


class FixedCosts(CostModel):
    """A cost model that ignores measurements, so auto's choices are reproducible."""

    def __init__(self, seconds_per_block: float, seconds_per_token: float):
        super().__init__(seconds_per_block=seconds_per_block)
        self._per_token = seconds_per_token

    def observe_copy(self, num_blocks, seconds):
        pass

    @property
    def seconds_per_token(self):
        return self._per_token


SWAP_IS_CHEAPER = FixedCosts(1e-6, 1e-3)
RECOMPUTE_IS_CHEAPER = FixedCosts(1e-3, 1e-6)


def make_loop(mode, *, num_blocks=24, block_size=4, host_blocks=None, costs=None, prefix=False,
              max_tokens_step=64):
    ex = FakeExecutor(block_size)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, prefix_caching=prefix,
                                     preemption_mode=mode, num_host_blocks=host_blocks))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    if costs is not None:
        mem.policy.costs = costs
    loop = BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_tokens_step, overlap=False))
    return loop, mem


def run_requests(loop, ps, max_tokens=30):
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7))
    out = run_all(loop)
    return [out[(str(i), 0)] for i in range(len(ps))]


def assert_clean(mem):
    mem.check_integrity()
    stats = mem.stats()
    assert stats.snapshot["blocks_referenced"] == 0 and stats.num_sequences == 0
    assert stats.preemption["host_blocks_free"] == stats.preemption["host_blocks"]


@pytest.mark.parametrize("mode, host_blocks, costs, kinds", [
    ("recompute", None, None, {"recompute"}),
    ("swap", None, None, {"swap"}),
    ("swap", 6, None, {"swap", "fallback"}),  # the swap space runs out
    ("auto", None, SWAP_IS_CHEAPER, {"swap"}),
    ("auto", None, RECOMPUTE_IS_CHEAPER, {"recompute"}),
    ("auto", 6, SWAP_IS_CHEAPER, {"swap", "fallback"}),
])
def test_outputs_are_the_same_whatever_preempts(mode, host_blocks, costs, kinds):
    ps = prompts(8, lo=10, hi=20, seed=3)
    loop, mem = make_loop(mode, host_blocks=host_blocks, costs=costs)
    assert run_requests(loop, ps) == [expected(p, 30, 7) for p in ps]
    s = mem.stats().preemption
    assert (s["num_swapped_out"] > 0) == ("swap" in kinds)
    assert s["num_swapped_in"] == s["num_swapped_out"]  # every swapped sequence came back
    assert (s["num_swap_fallbacks"] > 0) == ("fallback" in kinds)
    assert (s["num_recomputed"] > 0) == bool(kinds & {"recompute", "fallback"})
    assert s["num_recomputed"] + s["num_swapped_out"] == mem.num_preemptions
    assert loop.scheduler.num_swapped_out == s["num_swapped_out"]
    assert_clean(mem)


def test_swap_with_prefix_caching_samples_and_priorities():
    """Shared prefixes, n > 1 forks, priorities and chunked prefill, in a tiny pool."""
    rng = random.Random(5)
    system = [rng.randrange(998) for _ in range(13)]
    loop, mem = make_loop("swap", num_blocks=32, host_blocks=8, prefix=True, max_tokens_step=16)
    reqs = []
    for i in range(10):
        p = system + [rng.randrange(998) for _ in range(rng.randint(1, 12))]
        sp = SamplingParams(max_tokens=rng.randint(8, 30), temperature=1.0, seed=i, n=rng.choice([1, 1, 3]))
        loop.add_request(str(i), p, sp, priority=rng.randint(0, 2))
        reqs.append((p, sp))
    out = run_all(loop)
    for i, (p, sp) in enumerate(reqs):
        for j in range(sp.n):
            assert out[(str(i), j)] == expected(p, sp.max_tokens, derive_seed(sp.seed, j)), (i, j)
    s = mem.stats().preemption
    assert s["num_swapped_out"] > 0 and s["num_swap_fallbacks"] > 0
    assert mem.stats().prefix_cache_hits > 0
    assert_clean(mem)


def test_swapped_sequences_resume_before_new_admissions():
    mem = MemoryManager(MemoryConfig(num_blocks=6, preemption_mode="swap", prefix_caching=False))
    mem.register_executor(FakeExecutor(4).info.kv)
    new = [PlanEntry(s, [1] * 8, True, 24) for s in ("a", "b")]
    assert len(mem.reserve(Plan(new)).grants) == 2  # 4 blocks
    grow = [PlanEntry("a", [2] * 5, False, 24), PlanEntry("b", [3] * 5, False, 24)]
    r = mem.reserve(Plan(grow))
    assert [(p.seq_id, p.mode) for p in r.preempted] == [("b", "swap")]
    assert mem.allocator.is_swapped("b")
    # "a" finishes; "b" (swapped, 2 host blocks) comes back before "c" is admitted
    r = mem.reserve(Plan([PlanEntry("b", [4], False, 24), PlanEntry("c", [5] * 9, True, 24)], free=["a"]))
    assert r.resumed == ["b"] and [g.seq_id for g in r.grants] == ["b", "c"]
    assert r.grants[0].start_pos == 8
    # a swapped sequence that cannot come back keeps later admissions waiting
    r = mem.reserve(Plan([PlanEntry("c", [6] * 8, False, 24), PlanEntry("b", [4], False, 24)]))
    assert [(p.seq_id, p.mode) for p in r.preempted] == [("b", "swap")]
    r = mem.reserve(Plan([PlanEntry("b", [4], False, 24), PlanEntry("d", [1], True, 24)]))
    assert r.resumed == [] and r.waiting == ["d"] and not r.grants
    mem.check_integrity()


def test_watermark_keeps_admission_from_filling_the_pool():
    mem = MemoryManager(MemoryConfig(num_blocks=10, watermark=0.2, prefix_caching=False))
    mem.register_executor(FakeExecutor(4).info.kv)
    assert mem.reserve(Plan([PlanEntry("a", [1] * 16, True, 40)])).grants  # empty pool: no watermark
    r = mem.reserve(Plan([PlanEntry("b", [1] * 17, True, 40)]))  # 5 blocks + 2 kept free > 6
    assert r.waiting == ["b"]
    assert mem.reserve(Plan([PlanEntry("c", [1] * 12, True, 40)])).grants


def test_auto_compares_copy_time_with_recompute_time():
    costs = CostModel(seconds_per_block=1.0)
    policy = PreemptionPolicy("auto", costs)
    assert policy.choose(4, 64, True).mode == "recompute"  # no step priced a token yet
    for tokens in (100, 300):  # seconds = 0.5 + 0.01 * tokens: marginal 10 ms a token
        costs.observe_step(tokens, 0.5 + 0.01 * tokens)
    assert costs.seconds_per_token == pytest.approx(0.01)
    assert policy.choose(4, 64, True).mode == "recompute"  # 8 s of copies > 0.64 s
    assert policy.choose(4, 1000, True).mode == "swap"  # 8 s < 10 s
    assert policy.choose(4, 1000, False) == ("recompute", True)  # no room: fall back
    assert policy.crossover_tokens(16) is None  # 2 s per 16-token block > 0.16 s
    assert policy.crossover_tokens(1024) == 200
    assert PreemptionPolicy("swap", costs).choose(4, 1, True).mode == "swap"
    assert PreemptionPolicy("recompute", costs).choose(4, 10**6, True).mode == "recompute"
    costs.observe_copy(10, 1.0)  # 0.1 s a block, weighted in
    assert costs.seconds_per_block == pytest.approx(0.82)
    with pytest.raises(ValueError, match="preemption mode"):
        PreemptionPolicy("sometimes")


def test_memsvc_flags(monkeypatch):
    import argparse

    from pagedserve import service_cmds

    def parse(argv):
        parser = argparse.ArgumentParser()
        service_cmds.add_parsers(parser.add_subparsers(dest="command", required=True))
        return service_cmds.config_from("memsvc", parser.parse_args(argv)).memory

    config = parse(["memsvc", "--preemption-mode", "swap", "--swap-space", "0.5"])
    assert config.preemption_mode == "swap" and config.swap_space == 0.5
    assert parse(["memsvc"]).preemption_mode == "auto"
    monkeypatch.setenv("PAGEDSERVE_PREEMPTION_MODE", "recompute")
    assert parse(["memsvc"]).preemption_mode == "recompute"


class _OverTheWire:
    """memsvc as a gateway session sees it: plans and answers through protobuf, ids namespaced."""

    def __init__(self, mem, session="gw-1"):
        self.mem, self.session = mem, session

    def reserve(self, plan):
        from pagedserve.wire import step_convert

        request = step_convert.plan_to_proto(plan, self.session)
        request = type(request).FromString(request.SerializeToString())
        result = self.mem.reserve(step_convert.plan_from_proto(request), request.session_id)
        response = step_convert.reserve_result_to_proto(result)
        return step_convert.reserve_result_from_proto(type(response).FromString(response.SerializeToString()))

    def fork(self, parent_id, child_id):
        self.mem.fork(parent_id, child_id, self.session)


def test_swap_and_forks_through_a_session_over_the_wire():
    ex = FakeExecutor(4)
    mem = MemoryManager(MemoryConfig(num_blocks=24, preemption_mode="swap", prefix_caching=False))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    loop = BatchLoop(_OverTheWire(mem), ex, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, overlap=False))
    ps = prompts(6, lo=10, hi=20, seed=4)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=1.0, seed=i, n=2))
    out = run_all(loop)
    for i, p in enumerate(ps):
        assert [out[(str(i), j)] for j in range(2)] == [expected(p, 20, derive_seed(i, j)) for j in range(2)]
    s = mem.stats().preemption
    assert s["num_swapped_out"] > 0 and s["num_swapped_in"] == s["num_swapped_out"]
    assert s["recompute_seconds_per_token"] > 0  # the step reports crossed the wire
    assert mem.sessions.num_sequences() == 0
    assert_clean(mem)
