"""Ranks that hold their own KV pools (issue 29, ranks on other nodes: pagedserve.memsvc.held_pools).
memsvc holds no pool for them and says "" for their segment; it preempts by recompute only
and keeps no host tier (a setting asking otherwise is refused naming it); every
copy-on-write copy comes back in the answer (`block_copies`, also over the wire and in
columns) and is applied to memsvc's own pools; the group registering again drops every
sequence, cached block and session under a new pool epoch."""
import grpc
import pytest

from pagedserve.memsvc.config import MemoryConfig
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.memsvc.pool_stats import preemption_stats
from pagedserve.memsvc.server import MemoryService
from pagedserve.wire import convert, step_convert
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry
from pagedserve.wire.v1 import memory_pb2
from tests.support.servicer_context import Aborted, Context

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=4, head_size=8, block_size=4)  # 2 ranks x 2 heads
HOLDS = [False, True]


def manager(**kw) -> MemoryManager:
    return MemoryManager(MemoryConfig(**{"num_blocks": 8, "max_model_len": 64, **kw}))


def forked(m: MemoryManager, session: str = ""):
    """a (6 tokens: a partial second block) forked into b, then both append one token."""
    [grant] = m.reserve(Plan([PlanEntry("a", list(range(6)), True, 32)]), session).grants
    m.fork("a", "b", session)
    result = m.reserve(Plan([PlanEntry("a", [6], False, 32), PlanEntry("b", [6], False, 32)]), session)
    return list(grant.new_blocks), result


def test_a_held_rank_gets_no_pool_and_its_copies_come_back_with_the_answer():
    m = manager()
    pools = m.register_executor(GEOMETRY, ranks=2, holds_pool=HOLDS)
    assert pools[1] is None and list(pools[0].shape) == [8, 2, 2, 4, 2, 8] and m.pools == [pools[0]]
    assert preemption_stats(m)["preemption_mode"] == "recompute"
    assert preemption_stats(m)["host_blocks"] == 0
    [grant] = m.reserve(Plan([PlanEntry("a", list(range(6)), True, 32)])).grants
    blocks = list(grant.new_blocks)
    pools[0][blocks[1]] = 7.0
    m.fork("a", "b")
    result = m.reserve(Plan([PlanEntry("a", [6], False, 32), PlanEntry("b", [6], False, 32)]))
    copied = [b for g in result.grants for b in g.new_blocks if b not in blocks]
    assert result.block_copies == [(blocks[1], copied[0])]  # the shared partial block, once
    assert pools[0][copied[0]].eq(7.0).all()  # and memsvc's own pool got it as before
    m.check_integrity()


def test_without_held_ranks_no_copy_goes_back():
    m = manager()
    m.register_executor(GEOMETRY, ranks=2)
    _, result = forked(m)
    assert result.block_copies == []


def test_a_plan_made_ahead_that_would_copy_is_deferred_then_copies_in_full():
    m = manager()
    m.register_executor(GEOMETRY, ranks=2, holds_pool=HOLDS)
    m.reserve(Plan([PlanEntry("a", list(range(6)), True, 32)]), "s")
    m.fork("a", "b", "s")
    assert m.reserve(Plan(run_ids=["a", "b"], run_counts=[1, 1], run_tokens=[6, 6], ahead=True), "s").deferred
    result = m.reserve(Plan([PlanEntry("a", [6], False, 32), PlanEntry("b", [6], False, 32)]), "s")
    assert len(result.block_copies) == 1


def test_the_copies_survive_the_wire():
    m = manager()
    m.register_executor(GEOMETRY, ranks=2, holds_pool=HOLDS)
    _, result = forked(m)
    back = step_convert.reserve_result_from_proto(step_convert.reserve_result_to_proto(result))
    assert back.block_copies == result.block_copies and len(back.block_copies) == 1
    bad = step_convert.reserve_result_to_proto(result)
    bad.copy_dst.append(3)
    with pytest.raises(ValueError, match="copy_src has 1 blocks, copy_dst 2"):
        step_convert.reserve_result_from_proto(bad)


def test_registering_again_starts_a_new_epoch_with_nothing_held():
    m = manager(prefix_caching=True)
    m.register_executor(GEOMETRY, ranks=2, holds_pool=HOLDS)
    epoch = m.pool_epoch
    blocks, _ = forked(m, "s")
    m.free(["b"], "s")
    assert m.stats().num_sequences == 1
    pools = m.register_executor(GEOMETRY, ranks=2, holds_pool=HOLDS)  # the group restarted
    assert pools[1] is None and m.pool_epoch != epoch
    assert m.stats().num_sequences == 0 and m.stats().num_sessions == 0
    assert m.allocator.snapshot().as_dict()["blocks_free"] == 8  # nothing referenced or cached
    m.check_integrity()
    # a running entry of the old epoch comes back preempted for recompute; its prompt is not a hit
    result = m.reserve(Plan([PlanEntry("a", [7], False, 32)]), "s")
    assert [(p.seq_id, p.mode) for p in result.preempted] == [("a", "recompute")]
    result = m.reserve(Plan([PlanEntry("c", list(range(6)), True, 32)]))
    assert result.grants[0].num_cached_tokens == 0 and result.pool_epoch == m.pool_epoch


def test_a_group_without_held_ranks_keeps_its_epoch():
    m = manager()
    m.register_executor(GEOMETRY, ranks=2)
    epoch = m.pool_epoch
    m.reserve(Plan([PlanEntry("a", list(range(6)), True, 32)]))
    m.register_executor(GEOMETRY, ranks=2)
    assert m.pool_epoch == epoch and m.stats().num_sequences == 1


@pytest.mark.parametrize("kw, holds, match", [
    ({"preemption_mode": "swap"}, HOLDS, "--preemption-mode swap: ranks on other nodes"),
    ({"kv_offload": 1.0, "prefix_caching": True}, HOLDS, "--kv-offload: ranks on other nodes"),
    ({}, [True, False], "rank 0 runs beside memsvc"),
    ({}, [False], "rank_holds_pool has 1 entries for 2 ranks"),
])
def test_what_held_ranks_cannot_have_is_refused_naming_it(kw, holds, match):
    with pytest.raises(ValueError, match=match):
        manager(**kw).register_executor(GEOMETRY, ranks=2, holds_pool=holds)


def test_a_restart_with_other_held_ranks_names_both():
    m = manager()
    m.register_executor(GEOMETRY, ranks=2, holds_pool=HOLDS)
    with pytest.raises(ValueError, match=r"2 ranks, ranks \[1\] holding their own pools\); this "
                                         r"executor sent .* \(2 ranks\)"):
        m.register_executor(GEOMETRY, ranks=2)


def test_register_over_grpc_names_no_segment_for_a_held_rank():
    s = MemoryService(MemoryManager(MemoryConfig(num_blocks=8, shared=True, max_model_len=64)))
    try:
        response = s.RegisterExecutor(memory_pb2.RegisterExecutorRequest(
            geometry=convert.geometry_to_proto(GEOMETRY), device="cpu", rank_devices=["cpu", "cpu"],
            rank_holds_pool=HOLDS), Context())
        names = list(response.pool.rank_shm_names)
        assert len(names) == 2 and names[0] == response.pool.shm_name and names[1] == ""
        assert list(response.pool.shape) == [8, 2, 2, 4, 2, 8] and len(s.manager.shms) == 1
        context = Context()
        with pytest.raises(Aborted, match="rank 0 runs beside memsvc"):
            s.RegisterExecutor(memory_pb2.RegisterExecutorRequest(
                geometry=convert.geometry_to_proto(GEOMETRY), device="cpu",
                rank_devices=["cpu", "cpu"], rank_holds_pool=[True, False]), context)
        assert context.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        s.close()
