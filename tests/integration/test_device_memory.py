"""The KV pool's budget from the device's memory (pagedserve.executor.device_memory): the
arithmetic, its error, the profiling step on a scratch pool, and memsvc's order of sizes."""
import pytest
import torch

from pagedserve.executor import Executor, device_memory
from pagedserve.executor.device_memory import DeviceMemory
from pagedserve.memsvc.config import CPU_KV_GIB, GIB, MemoryConfig
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import KVGeometry

GB = 1 << 30


def test_budget_is_utilization_less_what_is_used():
    m = DeviceMemory(total=100 * GB, in_use=20 * GB, step_peak=5 * GB, graph_reserve=1 * GB)
    assert m.budget(0.9) == int(90 * GB) - 26 * GB
    assert "KV pool budget 64.00 GiB" in m.describe(0.9)


@pytest.mark.parametrize("utilization", [0.0, 1.5, -0.1])
def test_budget_refuses_a_utilization_outside_0_1(utilization):
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        DeviceMemory(100, 0, 0, 0).budget(utilization)


def test_budget_is_0_when_nothing_is_left():
    """As after a restart of the executor, when memsvc's pool holds the room: no error here."""
    assert DeviceMemory(total=10 * GB, in_use=8 * GB, step_peak=GB, graph_reserve=GB).budget(0.9) == 0


def test_memsvc_refuses_a_new_gpu_pool_without_a_budget():
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, block_size=16)
    with pytest.raises(ValueError, match="no memory left on cuda:0 .* --kv-memory or --kv-tokens"):
        MemoryManager(MemoryConfig()).register_executor(geometry, 0, device="cuda:0")


@pytest.fixture(scope="module")
def executor(default_model_dir):
    return Executor(None)


def test_cpu_has_no_budget(executor):
    assert device_memory.measure(executor) is None
    assert executor.kv_budget(0.9) == 0


def test_profile_step_runs_on_a_scratch_pool_and_detaches_it(executor):
    geometry = executor.kv_geometry()
    scratch = device_memory.profile_step(executor, tokens=100, seqs=3)
    blocks = 3 * -(-34 // geometry.block_size)  # 34 + 33 + 33 tokens: 3 blocks each
    assert scratch == blocks * geometry.bytes_per_block
    assert executor.runner is None
    with pytest.raises(RuntimeError, match="no KV pool attached"):
        executor.execute(batch_of([Seq("s", [1, 2], 0, [0])], geometry.block_size))
    pool = torch.zeros(geometry.pool_shape(4))  # a real pool after it: steps run as before
    executor.attach_pool(pool)
    try:
        out = executor.execute(batch_of([Seq("s", [1, 2, 3], 0, [0])], geometry.block_size))
        assert len(out) == 1 and out[0].sampled
    finally:
        executor.detach_pool()


def test_measure_subtracts_the_scratch_pool_from_the_peak(monkeypatch):
    """With torch.cuda's memory calls stood in: the peak counts the step's activations only."""
    calls = {"allocated": 3 * GB, "peak": 10 * GB, "info": (40 * GB, 100 * GB)}
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: calls["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: calls["info"])
    monkeypatch.setattr(device_memory, "profile_step", lambda ex, t, s: 2 * GB)

    class OnCuda:
        device = torch.device("cuda", 0)

    m = device_memory.measure(OnCuda())
    assert (m.total, m.in_use, m.step_peak) == (100 * GB, 60 * GB, 5 * GB)


def _blocks(config: MemoryConfig, budget: int) -> tuple[int, int]:
    geometry = KVGeometry(num_layers=32, num_kv_heads=8, head_size=128, block_size=16)  # 4 MiB a block
    manager = MemoryManager(config)
    manager.register_executor(geometry, budget)
    return manager.allocator.num_blocks, geometry.bytes_per_block


@pytest.mark.parametrize("kv_memory, budget, expect_bytes", [
    (None, 0, int(CPU_KV_GIB * GIB)),  # nothing given: the CPU's default
    (None, 12 << 20, 12 << 20),  # the executor's budget
    (0.05, 12 << 20, int(0.05 * GIB)),  # --kv-memory wins over the executor's budget
])
def test_memsvc_sizes_the_pool_in_order(kv_memory, budget, expect_bytes):
    blocks, per_block = _blocks(MemoryConfig(kv_memory=kv_memory), budget)
    assert blocks == expect_bytes // per_block


def test_kv_tokens_wins_over_the_budget():
    blocks, _ = _blocks(MemoryConfig(kv_tokens=64), 12 << 20)
    assert blocks == 64 // 16
