"""A tensor-parallel rank that holds its own KV pool (issue 29, a rank on another node:
pagedserve.executor.tp_pools, pagedserve.memsvc.held_pools): given the name "" it allocates a zeroed pool of the
group's shape itself, and its runner applies each step's block copies before the forward
pass; a runner over memsvc's pool leaves them to memsvc. A copy outside the pool is
refused before anything changes."""
from types import SimpleNamespace

import pytest
import torch

from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.tp_group import GroupLayout
from pagedserve.executor.tp_pools import own_pool
from pagedserve.step.whole_seqs import Seq, batch_of
from tests.support.tiny_models import make_tiny_model, paged_batches

SHAPE = [8, 2, 2, 4, 2, 8]


def test_the_ranks_of_other_nodes_hold_their_pools():
    assert GroupLayout(4, nodes=2).holds_own_pool == [False, False, True, True]
    assert GroupLayout(2).holds_own_pool == [False, False]


def test_a_rank_named_no_segment_allocates_its_own_pool():
    plan = SimpleNamespace(world=2, rank=1, kv_heads=2)
    pool, holds = own_pool([("seg", SHAPE, "float32"), ("", SHAPE, "bfloat16")], plan, None)
    assert holds and list(pool.shape) == SHAPE and pool.dtype == torch.bfloat16 and not pool.any()
    mapped = torch.zeros(SHAPE)
    assert own_pool([torch.zeros(SHAPE), mapped], plan, None) == (mapped, False)


def runner(tmp_path, holds: bool) -> ModelRunner:
    make_tiny_model(tmp_path, "llama3")
    model, config = load_model(str(tmp_path))
    pool = torch.zeros(16, config.num_layers, 2, 4, config.num_kv_heads, config.head_dim)
    return ModelRunner(model, config, pool, holds)


def prefill_then_copy():
    """'a' prefills 6 tokens (its second block half full); then 'a' decodes one token into a
    copy of that block, as after a fork's copy-on-write."""
    [prefill] = paged_batches([[("a", list(range(3, 9)))]], block_size=4, num_blocks=16)
    table = prefill.block_tables[0, :prefill.table_lens[0]].tolist()
    src, dst = table[1], next(b for b in range(16) if b not in table)
    decode = batch_of([Seq("a", [9], 6, [table[0], dst])], 4, copies=[(src, dst)])
    assert decode.slot_mapping.tolist() == [dst * 4 + 2]
    return prefill, decode, src, dst


@pytest.mark.parametrize("holds", [True, False])
def test_a_runner_that_holds_its_pool_applies_the_copies_first(tmp_path, holds):
    r = runner(tmp_path, holds)
    prefill, decode, src, dst = prefill_then_copy()
    r.execute(prefill)
    before = r.kv_pool[src].clone()
    r.execute(decode)
    pool = r.kv_pool
    assert torch.equal(pool[src], before)  # the source is read, never written
    copied = torch.equal(pool[dst][:, :, :2], before[:, :, :2])  # the 2 tokens before the new one
    assert copied == holds
    assert pool[dst][:, :, 2].abs().sum() > 0  # the step wrote its token into the copy


@pytest.mark.parametrize("holds", [True, False])  # every rank refuses it alike
def test_a_copy_outside_the_pool_is_refused_before_anything_runs(tmp_path, holds):
    r = runner(tmp_path, holds)
    prefill, decode, src, _ = prefill_then_copy()
    r.execute(prefill)
    before = r.kv_pool.clone()
    decode.copies = [(src, 16)]
    with pytest.raises(ValueError, match="outside the pool's 16"):
        r.execute(decode)
    assert torch.equal(r.kv_pool, before)
