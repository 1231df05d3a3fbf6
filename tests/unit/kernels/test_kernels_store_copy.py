"""pagedserve.kernels.store_kv and pagedserve.kernels.copy_blocks (torch path) on the strided views of a block-major pool."""
import pytest
import torch

from pagedserve.kernels import copy_blocks, store_kv


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes: a second thread only adds waiting when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_pool(num_blocks, dtype=torch.float32, seed=0, num_layers=3, block_size=8, num_kv_heads=2, head_size=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_size, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_lands_in_block_and_offset(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    pool = random_pool(6, dtype)
    before = pool.clone()
    layer, block_size = 2, pool.shape[3]
    slots = torch.randperm(6 * block_size, generator=gen)[:10]
    slots[[2, 5, 9]] = torch.tensor([-1, -3, -1])
    key = torch.randn(10, 2, 4, generator=gen).to(dtype)
    value = torch.randn(10, 2, 4, generator=gen).to(dtype)
    store_kv(key, value, pool[:, layer, 0], pool[:, layer, 1], slots.to(slot_dtype))
    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, layer, 0, slot % block_size] = key[t]
            expected[slot // block_size, layer, 1, slot % block_size] = value[t]
    assert torch.equal(pool, expected)
    assert not torch.equal(pool, before)


def test_store_kv_all_padding_and_empty():
    pool = random_pool(3)
    before = pool.clone()
    key = torch.randn(4, 2, 4)
    store_kv(key, key, pool[:, 0, 0], pool[:, 0, 1], torch.full((4,), -1))
    store_kv(key[:0], key[:0], pool[:, 0, 0], pool[:, 0, 1], torch.empty(0, dtype=torch.int32))
    assert torch.equal(pool, before)


def test_copy_blocks_within_one_pool():
    pool = random_pool(10)
    before = pool.clone()
    copy_blocks(pool, pool, [3, 0, 7], [5, 9, 1])
    expected = before.clone()
    for src, dst in [(3, 5), (0, 9), (7, 1)]:
        expected[dst] = before[src]
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_copy_blocks_across_pools(as_tensor):
    src = random_pool(6, seed=1)
    dst = random_pool(9, seed=2)
    src_before, dst_before = src.clone(), dst.clone()
    src_ids, dst_ids = [5, 1, 2, 0], [0, 8, 3, 4]
    if as_tensor:
        src_ids, dst_ids = torch.tensor(src_ids, dtype=torch.int32), torch.tensor(dst_ids)
    copy_blocks(src, dst, src_ids, dst_ids)
    expected = dst_before.clone()
    for s, d in [(5, 0), (1, 8), (2, 3), (0, 4)]:
        expected[d] = src_before[s]
    assert torch.equal(dst, expected)
    assert torch.equal(src, src_before)


def test_copy_blocks_nothing_to_copy():
    pool = random_pool(4)
    before = pool.clone()
    copy_blocks(pool, pool, [], [])
    assert torch.equal(pool, before)
