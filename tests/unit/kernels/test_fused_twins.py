"""The C++ kernels added beside their torch references (pagedserve/kernels/fused_ref.py): SiLU-and-multiply
(kernels/fused_cpu.silu_and_mul_) and rotary applied in the K/V store
(pagedserve/kernels/rotary_store_cpu), each against its reference, threaded and not."""
import pytest
import torch

from pagedserve.kernels import fused_cpu, rotary_store_cpu
from pagedserve.kernels.fused_ref import rotary_store_kv_ref, silu_and_mul_ref
from tests.unit.kernels.test_kernels_cpu import two_threads  # noqa: F401 (autouse: rows split over two threads)


# 1 x 1536 stays on one thread, 64 x 1536 takes two; 3 x 5 is not a multiple of the vector width
@pytest.mark.parametrize("rows,n", [(1, 1536), (64, 1536), (3, 5)])
def test_silu_and_mul(rows, n):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * n + 3, generator=g) * 6
    gate_up = wide[:, : 2 * n]  # rows with a stride
    extremes = torch.tensor([-200.0, -90.0, -87.5, 0.0, 88.5, 200.0])[:n]  # gates past exp's clamp
    gate_up[0, : len(extremes)] = extremes
    want, right = silu_and_mul_ref(gate_up), wide[:, 2 * n:].clone()
    got = fused_cpu.silu_and_mul_(gate_up)
    assert got.shape == (rows, n) and got.data_ptr() == gate_up.data_ptr()  # over the gate half
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(wide[:, 2 * n:], right)  # past the row's 2n columns: untouched


def pool_views(blocks, block_size, kv_heads, dim, layers=2, layer=1, seed=0):
    """A layer's K and V caches as the pool's strided views, filled with noise."""
    pool = torch.randn(blocks, layers, 2, block_size, kv_heads, dim, generator=torch.Generator().manual_seed(seed))
    return pool, pool[:, layer, 0], pool[:, layer, 1]


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (70, 9, 3, 64), (5, 2, 1, 6)])
def test_rotary_store_matches_the_reference(tokens, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=g) * 50
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    block_size, blocks = 4, tokens // 4 + 3
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[tokens // 2] = -1  # padding: skipped
    pool, k_cache, v_cache = pool_views(blocks, block_size, kv_heads, dim)
    ref_pool, ref_k, ref_v = pool_views(blocks, block_size, kv_heads, dim)
    expected_q = rotary_store_kv_ref(qk.clone(), v, cos, sin, ref_k, ref_v, slots, heads)
    k_before = qk[:, heads:].clone()
    assert rotary_store_cpu.applies(qk, k_cache, v_cache)
    q = rotary_store_cpu.rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slots)
    assert q.shape == (tokens, heads, dim) and q.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-6)  # the other layer and slots untouched too
    assert torch.equal(qk[:, heads:], k_before)  # K is read from the cache, left as it was here


def test_rotary_store_refuses_a_slot_past_the_pool():
    _, k_cache, v_cache = pool_views(2, 4, 1, 8)
    qk, v = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    cos = sin = torch.ones(2, 4)
    with pytest.raises(ValueError, match="slots past the cache's 8"):
        rotary_store_cpu.rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, torch.tensor([3, 8]))


def test_rotary_store_applies_to_float32_pool_views_only():
    _, k_cache, v_cache = pool_views(2, 4, 1, 8)
    qk = torch.randn(2, 3, 8)
    assert not rotary_store_cpu.applies(qk.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())
    assert not rotary_store_cpu.applies(qk, k_cache, v_cache.contiguous())


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])  # q and k side by side; q/k normed, then joined
def test_the_model_stores_through_it_and_matches_transformers(tmp_path, monkeypatch, arch):
    from pagedserve.executor.model_loader import load_model
    from tests.support.tiny_models import make_tiny_model
    from tests.unit.executor.test_linear_backend import TOL, worst_logit_difference

    hf = make_tiny_model(tmp_path, arch)
    model, config = load_model(str(tmp_path))
    calls, real = [], rotary_store_cpu.rotary_store_kv_
    monkeypatch.setattr(rotary_store_cpu, "rotary_store_kv_", lambda *a: calls.append(1) or real(*a))
    assert worst_logit_difference(hf, model, config) <= TOL
    assert calls


@pytest.mark.parametrize("arch", ["llama3", "phi3"])  # gate and up fused in the checkpoint (phi3) or by the loader
def test_the_model_takes_silu_and_mul_and_matches_transformers(tmp_path, monkeypatch, arch):
    from pagedserve.executor.model_loader import load_model
    from tests.support.tiny_models import make_tiny_model
    from tests.unit.executor.test_linear_backend import TOL, worst_logit_difference

    hf = make_tiny_model(tmp_path, arch)
    model, config = load_model(str(tmp_path))
    calls, real = [], fused_cpu.silu_and_mul_
    monkeypatch.setattr(fused_cpu, "silu_and_mul_", lambda x: calls.append(x.shape[0]) or real(x))
    monkeypatch.setattr(fused_cpu, "SILU_MIN_ROWS", 2)
    assert worst_logit_difference(hf, model, config) <= TOL
    assert calls and min(calls) >= 2  # the one-row steps kept torch's ops


def test_silu_applies_from_the_row_bound():
    n = fused_cpu.SILU_MIN_ROWS
    assert fused_cpu.silu_applies(torch.ones(n, 8)) and not fused_cpu.silu_applies(torch.ones(n - 1, 8))
    assert not fused_cpu.silu_applies(torch.ones(n, 8).bfloat16())
    assert not fused_cpu.silu_applies(torch.ones(8, n).t())


def test_turned_off_with_the_fused_ops(monkeypatch):
    _, k_cache, v_cache = pool_views(2, 4, 1, 8)
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "0")
    rotary_store_cpu._native.reset()
    assert not rotary_store_cpu.applies(torch.randn(2, 3, 8), k_cache, v_cache)
    monkeypatch.delenv("PAGEDSERVE_FUSED_OPS")
    rotary_store_cpu._native.reset()
    assert rotary_store_cpu.applies(torch.randn(2, 3, 8), k_cache, v_cache)
