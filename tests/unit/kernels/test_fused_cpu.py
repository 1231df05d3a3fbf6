"""The fused CPU ops (pagedserve/kernels/fused_cpu.py) against the torch code they stand in for, and the
model's torch path when they are turned off."""
import pytest
import torch

from pagedserve.executor.models import llama
from pagedserve.kernels import fused_cpu
from tests.unit.kernels.test_kernels_cpu import two_threads  # noqa: F401 (autouse: rows split over two threads)


def ref_rms_norm(x, w, eps):
    x = x.double()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


def ref_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_fused_kernels_build_here():
    assert fused_cpu.available(), "the fused C++ kernels did not build (is g++ installed?)"
    assert fused_cpu.applies(torch.ones(2))
    assert not fused_cpu.applies(torch.ones(2, dtype=torch.bfloat16))


# 40 rows x 576 crosses the threading threshold (two threads); 3 x 7 and 1 x 5 do not
SHAPES = [(1, 576), (40, 576), (3, 7), (1, 5), (2, 3, 64)]


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    got = fused_cpu.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, ref_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [s for s in SHAPES if len(s) == 2])
@pytest.mark.parametrize("strided", [False, True])
def test_add_rms_norm_in_place(shape, strided):
    g = torch.Generator().manual_seed(1)
    rows, n = shape
    wide = torch.randn(rows, n + 9, generator=g)
    x = wide[:, 4:4 + n] if strided else wide[:, :n].contiguous()  # rows with a stride, unit columns
    residual, w = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    summed, untouched = x + residual, wide.clone()
    got = fused_cpu.add_rms_norm_(x, residual, w, 1e-6)
    assert torch.equal(x, summed)  # the add is exact, as torch's
    torch.testing.assert_close(got, ref_rms_norm(summed, w, 1e-6), rtol=1e-5, atol=1e-6)
    if strided:  # columns outside the view untouched
        assert torch.equal(wide[:, :4], untouched[:, :4])
        assert torch.equal(wide[:, 4 + n:], untouched[:, 4 + n:])


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim",
                         [(1, 9, 3, 64), (70, 9, 3, 64), (5, 2, 1, 6), (3, 4, 4, 128)])
def test_rotary_in_place_on_the_packed_qk_view(tokens, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 50
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    expected, v = ref_rotary(qk, cos, sin), qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert fused_cpu.rotary_(qk, cos, sin) is qk
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v)  # v untouched


def test_rotary_scaled_cos_sin():
    """cos/sin not of unit norm (longrope scales them) and 2-D."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 16, generator=g)
    cos, sin = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    expected = ref_rotary(x, cos[:, None], sin[:, None])
    torch.testing.assert_close(fused_cpu.rotary_(x, cos, sin), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("switch", ["PAGEDSERVE_NATIVE_KERNELS", "PAGEDSERVE_FUSED_OPS"])
def test_turned_off_falls_back_to_torch(monkeypatch, switch):
    monkeypatch.setenv(switch, "0")
    fused_cpu._native.reset()
    assert not fused_cpu.available() and not fused_cpu.applies(torch.ones(2))
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 576, generator=g), torch.randn(576, generator=g)
    scale = x.pow(2).mean(-1, keepdim=True).add_(1e-5).rsqrt_()
    assert torch.equal(llama.rms_norm(x, w, 1e-5), (x * scale).mul_(w))  # the torch code, bit for bit
    monkeypatch.delenv(switch)
    fused_cpu._native.reset()
    assert fused_cpu.available()
    torch.testing.assert_close(llama.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)


def test_model_rms_norm_keeps_torch_for_other_dtypes_and_strided_inputs():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    strided = torch.randn(3, 128, generator=g)[:, ::2]
    scale = strided.pow(2).mean(-1, keepdim=True).add_(1e-5).rsqrt_()
    assert torch.equal(llama.rms_norm(strided, w, 1e-5), (strided * scale).mul_(w))
    xb, wb = x.bfloat16(), w.bfloat16()
    xf = xb.float()
    expected = wb * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(llama.rms_norm(xb, wb, 1e-5), expected)
