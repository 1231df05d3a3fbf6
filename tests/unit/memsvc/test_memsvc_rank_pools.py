"""memsvc's pools for a tensor-parallel group (issue 29): one pool per rank with the same
block geometry and 1/ranks of the KV heads each; a block copy memsvc decides (copy-on-write
after a fork, swap out and in) reaches every rank's pool; the budget counts all ranks'
bytes; a geometry that does not split, or a restart with other ranks, names the numbers."""
import pytest
import torch

from pagedserve.memsvc.config import MemoryConfig
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.memsvc.pool_stats import host_tier_stats, preemption_stats
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry
from tests.support.written import Steps

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=4, head_size=8, block_size=4)  # 2 ranks x 2 heads


def manager(**kw) -> MemoryManager:
    return MemoryManager(MemoryConfig(**{"num_blocks": 8, "num_host_blocks": 8, "max_model_len": 64,
                                         "preemption_mode": "swap", **kw}))


def table(grant) -> list[int]:
    assert grant.table_start == 0
    return list(grant.new_blocks)


def test_one_pool_per_rank_and_copy_on_write_reaches_every_rank():
    m = manager()
    pools = m.register_executor(GEOMETRY, ranks=2)
    assert [list(p.shape) for p in pools] == [[8, 2, 2, 4, 2, 8]] * 2
    assert pools[0].data_ptr() != pools[1].data_ptr() and m.pool is pools[0]
    [grant] = m.reserve(Plan([PlanEntry("a", list(range(6)), True, 32)])).grants
    blocks = table(grant)
    for r, pool in enumerate(pools):  # what each rank's model wrote
        pool[blocks[1]] = float(10 + r)
    m.fork("a", "b")
    result = m.reserve(Plan([PlanEntry("a", [6], False, 32), PlanEntry("b", [6], False, 32)]))
    copied = [b for g in result.grants if g.new_blocks for b in g.new_blocks if b not in blocks]
    assert len(copied) == 1, result.grants  # the shared partial block, copied once for one of them
    for r, pool in enumerate(pools):
        assert torch.equal(pool[copied[0]], pool[blocks[1]]) and pool[copied[0]].eq(10 + r).all()
    m.check_integrity()


def test_swap_out_and_in_move_every_ranks_blocks():
    m = manager(num_blocks=6)
    pools = m.register_executor(GEOMETRY, ranks=2)
    [a] = m.reserve(Plan([PlanEntry("a", list(range(12)), True, 24)])).grants
    a_blocks = table(a)
    for r, pool in enumerate(pools):
        pool[a_blocks] = torch.arange(len(a_blocks), dtype=pool.dtype).view(-1, 1, 1, 1, 1, 1) + 100 * r
    before = [p[a_blocks].clone() for p in pools]
    # b takes the other 3 blocks; a's next token needs one more: a (the tail) is swapped out
    m.reserve(Plan([PlanEntry("b", list(range(50, 62)), True, 24)]))
    result = m.reserve(Plan([PlanEntry("b", [1], False, 24), PlanEntry("a", [1], False, 24)]))
    assert [(p.seq_id, p.mode) for p in result.preempted] == [("a", "swap")]
    assert preemption_stats(m)["num_swapped_out"] == 1
    for r, host in enumerate(m.host_pools):
        assert any(torch.equal(host[i], before[r][0]) for i in range(host.shape[0]))
    m.free(["b"])
    result = m.reserve(Plan([PlanEntry("a", [1], False, 24)]))
    assert result.resumed == ["a"]
    back = table(result.grants[0])[:3]
    for r, pool in enumerate(pools):
        assert torch.equal(pool[back], before[r])
    m.check_integrity()


def test_the_budget_counts_every_ranks_bytes():
    m = MemoryManager(MemoryConfig(max_model_len=64, preemption_mode="recompute"))
    pools = m.register_executor(GEOMETRY, budget_bytes=10 * GEOMETRY.bytes_per_block, ranks=2)
    assert [p.shape[0] for p in pools] == [10, 10]  # half the budget's bytes on each rank
    assert sum(p.numel() * p.element_size() for p in pools) == 10 * GEOMETRY.bytes_per_block


def test_bad_rank_counts_name_the_numbers():
    with pytest.raises(ValueError, match=r"num_kv_heads \(4\) is not a multiple of the 3 ranks"):
        manager().register_executor(GEOMETRY, ranks=3)
    m = manager()
    m.register_executor(GEOMETRY, ranks=2)
    assert len(m.register_executor(GEOMETRY, ranks=2)) == 2  # a restarted group: the same pools
    with pytest.raises(ValueError, match=r"\(2 ranks\); this executor sent .* \(1 ranks\)"):
        m.register_executor(GEOMETRY)


def test_shared_pools_are_one_segment_per_rank_all_unlinked_at_close(tmp_path):
    import os
    import secrets

    name = f"pagedserve-kv-test-{secrets.token_hex(4)}"
    m = manager(shared=True, shm_name=name)
    m.register_executor(GEOMETRY, ranks=2)
    assert [s.name for s in m.shms] == [name, f"{name}-rank1"]
    assert all(os.path.exists(s.path) for s in m.shms)
    m.close()
    assert not any(os.path.exists(s.path) for s in m.shms)


def test_the_host_tier_offloads_and_restores_every_ranks_blocks():
    m = manager(num_blocks=4, num_offload_blocks=8, offload_policy="always", preemption_mode="recompute")
    pools = m.register_executor(GEOMETRY, ranks=2)
    steps = Steps(m)
    assert len(m.tier_pools) == 2 and m.tier_pools[0].data_ptr() != m.tier_pools[1].data_ptr()
    prompt = list(range(9))  # two full blocks, keyed
    [a] = steps.reserve(Plan([PlanEntry("a", prompt, True, 16)])).grants
    blocks = table(a)
    for r, pool in enumerate(pools):
        for i, b in enumerate(blocks[:2]):
            pool[b] = float(100 * r + i)
    steps.reserve(Plan([], free=["a"]))
    steps.reserve(Plan([PlanEntry("b", list(range(50, 66)), True, 16)]))  # takes all 4 blocks: a's go out
    assert host_tier_stats(m)["host_tier_offloaded"] == 2
    for r in range(2):
        pools[r].zero_()
    steps.reserve(Plan([], free=["b"]))
    [c] = steps.reserve(Plan([PlanEntry("c", prompt, True, 16)])).grants
    assert c.num_cached_tokens == 8 and host_tier_stats(m)["host_tier_restored"] == 2
    for r, pool in enumerate(pools):
        for i, b in enumerate(table(c)[:2]):
            assert pool[b].eq(100 * r + i).all(), (r, i)
    m.check_integrity()
