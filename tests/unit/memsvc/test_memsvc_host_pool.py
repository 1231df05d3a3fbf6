"""Host swap space copies: runs of host ids, copies between pool and host on the CPU (the GPU
path is scripts/gpu_check.py's), and that waiting touches only the pool's GPU."""
import torch

from pagedserve.memsvc import host_pool
from pagedserve.wire.protocol import KVGeometry


def test_runs_of_consecutive_ids():
    assert host_pool._runs([]) == []
    assert host_pool._runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]


def test_swap_copy_both_ways_on_the_cpu():
    geometry = KVGeometry(num_layers=2, num_kv_heads=1, head_size=4, block_size=2, dtype="float32")
    pool = torch.randn(geometry.pool_shape(6))
    host = host_pool.allocate_host_pool(geometry, 5, pool)
    assert not host.is_pinned()
    host_pool.swap_copy(pool, host, [5, 0, 3], [1, 2, 4])
    for s, d in ((5, 1), (0, 2), (3, 4)):
        assert torch.equal(host[d], pool[s])
    back = pool.clone()
    seconds = host_pool.timed_copy(host, back, [1, 2], [0, 5])
    assert seconds >= 0 and torch.equal(back[0], pool[5]) and torch.equal(back[5], pool[0])
    host_pool.finish_copies(pool)  # nothing to wait for on the CPU


def test_timed_copy_waits_on_the_gpu_of_the_pool_only(monkeypatch):
    synced, copied = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: synced.append(index))
    monkeypatch.setattr(host_pool, "swap_copy", lambda *a: copied.append(a[2:]))

    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 3)

    class FakeHost:
        is_cuda = False
        device = torch.device("cpu")

    host_pool.timed_copy(FakeCuda(), FakeHost(), [1], [2])
    host_pool.finish_copies(FakeCuda())
    assert copied == [([1], [2])]
    assert synced == [3, 3, 3]
