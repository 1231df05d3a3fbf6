"""pagedserve/kernels/fused.py picks each fused op's kernel by device: the CPU keeps exactly the C++
kernels' choices (fused_cpu, rotary_store_cpu), CUDA tensors go to the Triton twins. There is
no GPU here: the CUDA branch is taken by forcing its test (_triton_on) and recording what is
called; the Triton kernels themselves are tests/system/test_fused_triton.py's."""
from types import SimpleNamespace

import torch

from pagedserve.kernels import fused, fused_cpu, rotary_store_cpu
from tests.unit.kernels.test_fused_twins import pool_views


def test_the_cpu_takes_what_the_cpp_kernels_take():
    _, k_cache, v_cache = pool_views(2, 4, 1, 8)
    for x in (torch.randn(4, 8), torch.randn(4, 8).bfloat16(), torch.randn(8, 4).t()):
        assert fused.applies(x) == fused_cpu.applies(x)
    assert not fused.applies(torch.randn(4, 8).bfloat16())  # 16-bit on the CPU: the model's torch code
    n = fused_cpu.SILU_MIN_ROWS
    assert fused.silu_applies(torch.ones(n, 8)) and not fused.silu_applies(torch.ones(n - 1, 8))
    qk = torch.randn(2, 3, 8)
    assert fused.rotary_store_applies(qk, k_cache, v_cache) == rotary_store_cpu.applies(qk, k_cache, v_cache)
    assert not fused.rotary_store_applies(qk.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())


def test_the_cpu_computes_what_the_cpp_kernels_compute():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g), torch.rand(24, generator=g)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), fused_cpu.rms_norm(x, w, 1e-6))
    x2 = x.clone()
    assert torch.equal(fused.add_rms_norm_(x, r, w, 1e-6), fused_cpu.add_rms_norm_(x2, r, w, 1e-6))
    assert torch.equal(x, x2)
    gu = torch.randn(40, 16, generator=g)
    assert torch.equal(fused.silu_and_mul(gu.clone()), fused_cpu.silu_and_mul_(gu.clone()))


def test_cuda_tensors_go_to_the_triton_kernels(monkeypatch):
    calls = []
    record = lambda name: lambda *a, **k: calls.append((name, k)) or "triton"  # noqa: E731
    kernels = {"fused": SimpleNamespace(rms_norm=record("rms_norm"), add_rms_norm_=record("add_rms_norm_"),
                                        silu_and_mul=record("silu_and_mul")),
               "rotary_store": SimpleNamespace(rotary_store_kv_=record("rotary_store_kv_"))}
    monkeypatch.setattr(fused, "_triton", kernels.__getitem__)
    monkeypatch.setattr(fused, "_triton_on", lambda *tensors: True)
    x, w = torch.randn(3, 8).bfloat16(), torch.ones(8)
    assert fused.applies(x) and fused.applies(x.half()) and not fused.applies(x.double())
    assert fused.silu_applies(torch.ones(1, 8).bfloat16())  # one row: no row bound on the GPU
    assert not fused.silu_applies(torch.ones(8, 4).t())
    _, k_cache, v_cache = pool_views(2, 4, 1, 8)
    assert fused.rotary_store_applies(torch.randn(2, 3, 8).bfloat16(), k_cache, v_cache)
    assert fused.rms_norm(x, w, 1e-6, round_first=False) == "triton"
    assert fused.add_rms_norm_(x, x, w, 1e-6) == "triton"
    assert fused.silu_and_mul(x) == "triton"
    assert fused.rotary_store_kv_(None, None, None, None, None, None, None) == "triton"
    assert [name for name, _ in calls] == ["rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_store_kv_"]


def test_cpu_tensors_never_take_the_triton_branch():
    assert not fused._triton_on(torch.ones(2))


def test_one_switch_turns_the_fused_ops_off(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "0")
    assert not fused_cpu.fused_ops_on()
    monkeypatch.delenv("PAGEDSERVE_FUSED_OPS")
    assert fused_cpu.fused_ops_on()
