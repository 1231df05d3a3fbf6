"""The fused per-layer Triton kernels (pagedserve/kernels/fused_triton.py, rotary_store_triton.py)
against their float32 references (pagedserve/kernels/fused_ref.py) and the model's torch code in
the same dtype, under TRITON_INTERPRET=1 on the CPU at small and odd sizes (float16 bit for
bit where the kernel rounds as the torch code does); and the model
through them (the CUDA branch of pagedserve/kernels/fused.py, taken here by CPU tensors)
against transformers. The GPU runs them at real shapes: scripts/gpu_check_fused.py.

Tolerances (absolute and relative alike): against the float32 reference, float32 1e-5,
float16 2e-3, bfloat16 2e-2; against the torch code in the dtype, float16 1e-3 (one unit in the
last place), bfloat16 2e-2: the interpreter truncates float32 to bfloat16 where the GPU rounds
to nearest, so bfloat16 is not bit for bit here. As tests/system/test_kernels_triton.py, each
check runs in a fresh process (the interpreter is chosen when triton is first imported).
"""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
CHECKS = ["rms_norm", "add_rms_norm", "silu_and_mul", "rotary_store", "model"]


@needs_triton
@pytest.mark.parametrize("name", CHECKS)
def test_fused_triton_kernel_matches_reference(name):
    env = {key: value for key, value in os.environ.items() if key != "PAGEDSERVE_FUSED_OPS"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), name], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ok {name}" in done.stdout


def tolerances(torch):
    reference = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    same_dtype = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}
    return reference, same_dtype


def close(torch, got, want, tol):
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def same_bits(torch, got, want, share=1.0):
    """float16 rounds here as on the GPU: where the kernel rounds as the torch code does, it
    is bit for bit (the norms: but for float32 summation order and exp, `share` of them)."""
    if got.dtype == torch.float16:
        exact = (got == want).float().mean().item()
        assert exact >= share, f"{exact:.3f} of the elements bit for bit, wanted {share}"


def check_rms_norm():
    import torch
    from pagedserve.executor.models.gemma import gemma_rms_norm
    from pagedserve.executor.models.decoder import rms_norm as model_rms_norm
    from pagedserve.kernels import fused_cpu, fused_triton
    from pagedserve.kernels.fused_ref import rms_norm_ref

    reference, same_dtype = tolerances(torch)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((1, 8), (5, 33), (3, 130), (2, 3, 20)):  # odd widths, a 3-d x
            n = shape[-1]
            x, w = (torch.randn(shape, generator=g) * 3).to(dtype), (torch.rand(n, generator=g) + 0.5).to(dtype)
            got = fused_triton.rms_norm(x, w, 1e-6)
            assert got.dtype == dtype and got.shape == x.shape
            close(torch, got, rms_norm_ref(x.float(), w.float(), 1e-6), reference[dtype])
            close(torch, got, model_rms_norm(x, w, 1e-6), same_dtype[dtype])  # float32: the C++ twin
            same_bits(torch, got, model_rms_norm(x, w, 1e-6), 0.95)
            wg = torch.rand(n, generator=g) + 0.5  # Gemma: (1 + w) in float32, rounded after the weight
            got = fused_triton.rms_norm(x, wg, 1e-6, round_first=False)
            close(torch, got, rms_norm_ref(x.float(), wg, 1e-6), reference[dtype])
            close(torch, got, gemma_rms_norm(x, wg, 1e-6), same_dtype[dtype])
            same_bits(torch, got, gemma_rms_norm(x, wg, 1e-6), 0.95)
    x = torch.randn(4, 24)
    assert fused_cpu.applies(x)
    close(torch, fused_triton.rms_norm(x, torch.ones(24), 1e-6), fused_cpu.rms_norm(x, torch.ones(24), 1e-6), 1e-6)
    assert fused_triton.rms_norm(torch.randn(0, 8), torch.ones(8), 1e-6).shape == (0, 8)


def check_add_rms_norm():
    import torch
    from pagedserve.kernels import fused_triton
    from pagedserve.kernels.fused_ref import add_rms_norm_ref, rms_norm_ref

    reference, same_dtype = tolerances(torch)
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, n in ((1, 8), (6, 37), (3, 260)):
            wide = (torch.randn(rows, n + 5, generator=g) * 2).to(dtype)
            x, tail = wide[:, :n], wide[:, n:].clone()  # rows with a stride: the tail is not x's
            residual = (torch.randn(rows, n + 3, generator=g) * 2).to(dtype)[:, :n]
            w = (torch.rand(n, generator=g) + 0.5).to(dtype)
            x0 = x.clone()
            got = fused_triton.add_rms_norm_(x, residual, w, 1e-5)
            summed, normed = add_rms_norm_ref(x0.float(), residual.float(), w.float(), 1e-5)
            close(torch, x, summed, reference[dtype])  # in place
            close(torch, x, x0 + residual, same_dtype[dtype])
            same_bits(torch, x, x0 + residual)
            close(torch, got, normed, reference[dtype])
            close(torch, got, rms_norm_ref(x.float(), w.float(), 1e-5), reference[dtype])  # the norm of x as stored
            assert torch.equal(wide[:, n:], tail)


def check_silu_and_mul():
    import torch
    import torch.nn.functional as F
    from pagedserve.kernels import fused_triton
    from pagedserve.kernels.fused_ref import silu_and_mul_ref

    reference, same_dtype = tolerances(torch)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, n, block in ((1, 8, 1024), (3, 5, 1024), (4, 100, 16), (2, 1500, 1024)):  # several blocks a row
            wide = torch.randn(rows, 2 * n + 3, generator=g) * 4
            gate_up = wide[:, : 2 * n]  # rows with a stride
            extremes = torch.tensor([-200.0, -90.0, 0.0, 88.5, 200.0])[:n]
            gate_up[0, : len(extremes)] = extremes
            gate_up = gate_up.to(dtype)
            got = fused_triton.silu_and_mul(gate_up, block=block)
            assert got.shape == (rows, n) and got.dtype == dtype
            close(torch, got, silu_and_mul_ref(gate_up.float()), reference[dtype])
            gate, up = gate_up.chunk(2, dim=-1)
            close(torch, got, F.silu(gate).mul_(up), same_dtype[dtype])
            same_bits(torch, got, F.silu(gate).mul_(up), 0.95)


def check_rotary_store():
    import torch
    from pagedserve.executor.models.rotary import apply_rotary
    from pagedserve.kernels import rotary_store_triton
    from pagedserve.kernels.fused_ref import rotary_ref, rotary_store_kv_ref
    from pagedserve.kernels.store_kv_ref import store_kv_ref

    reference, same_dtype = tolerances(torch)
    cases = [(7, 5, 3, 6, torch.int32, True), (1, 9, 3, 64, torch.int64, False), (5, 2, 1, 6, torch.int64, True),
             (6, 4, 4, 10, torch.int32, False)]  # tokens, q heads, kv heads, head_dim, slots' dtype, cos 3-d
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for tokens, heads, kv_heads, dim, slot_dtype, three_d in cases:
            g = torch.Generator().manual_seed(tokens * dim)
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
            qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
            angles = torch.rand(tokens, dim // 2, generator=g) * 50
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            if three_d:
                cos, sin = cos[:, None], sin[:, None]
            block_size, blocks = 4, tokens // 4 + 3
            slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(slot_dtype)
            slots[tokens // 2] = -1  # padding: skipped
            if tokens > 2:
                slots[-1] = blocks * block_size  # past the pool: skipped, not written anywhere
            whole = torch.randn(blocks + 1, 2, 2, block_size, kv_heads, dim, generator=g).to(dtype)
            pool, beyond = whole[:blocks], whole[blocks].clone()  # a slot past the pool would land in `beyond`
            kept = slots < blocks * block_size
            ref_pool, path_pool = pool.float(), pool.clone()
            expected_q = rotary_ref(qk.float(), cos.float(), sin.float())[:, :heads]
            rotary_store_kv_ref(qk.float()[kept], v.float()[kept], cos.float()[kept], sin.float()[kept],
                                ref_pool[:, 1, 0], ref_pool[:, 1, 1], slots[kept], heads)
            rotated = apply_rotary(qk, cos.view(tokens, 1, -1), sin.view(tokens, 1, -1))  # the torch path
            store_kv_ref(rotated[kept, heads:], v[kept], path_pool[:, 1, 0], path_pool[:, 1, 1], slots[kept])
            k_before = qk[:, heads:].clone()
            q = rotary_store_triton.rotary_store_kv_(qk, v, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots)
            assert q.shape == (tokens, heads, dim) and q.data_ptr() == qk.data_ptr()  # in place, a view
            close(torch, q, expected_q, reference[dtype])
            close(torch, q, rotated[:, :heads], same_dtype[dtype])
            same_bits(torch, q, rotated[:, :heads])
            close(torch, pool, ref_pool, reference[dtype])
            close(torch, pool, path_pool, same_dtype[dtype])
            same_bits(torch, pool, path_pool)
            assert torch.equal(pool[:, 0], path_pool[:, 0])  # the other layer untouched, bit for bit
            assert torch.equal(whole[blocks], beyond)
            assert torch.equal(qk[:, heads:], k_before)  # K is read from the cache, left as it was here


def check_model():
    """The model takes every fused op through the Triton branch (fused._triton_on forced for CPU
    tensors) and matches transformers: Llama (q and k a view of the QKV output), Qwen3 (q/k
    normed, then joined) and Gemma 2 (its norm rounds after the weight; gelu, so no SiLU)."""
    import tempfile

    from pagedserve.executor.model_loader import load_model
    from pagedserve.kernels import fused, fused_triton, rotary_store_triton
    from tests.support.tiny_models import make_tiny_model
    from tests.unit.executor.test_linear_backend import TOL, worst_logit_difference

    calls = {}
    for module, name in ((fused_triton, "rms_norm"), (fused_triton, "add_rms_norm_"), (fused_triton, "silu_and_mul"),
                         (rotary_store_triton, "rotary_store_kv_")):
        real = getattr(module, name)
        setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.setdefault(_name, []).append(1)
                or _real(*a, **k))
    fused._triton_on = lambda *tensors: True
    for arch, expected in (("llama3", {"rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_store_kv_"}),
                           ("qwen3", {"rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_store_kv_"}),
                           ("gemma2", {"rms_norm", "rotary_store_kv_"})):
        calls.clear()
        with tempfile.TemporaryDirectory() as path:
            hf = make_tiny_model(path, arch)
            model, config = load_model(path)
            worst = worst_logit_difference(hf, model, config)
        assert worst <= TOL, (arch, worst)
        assert set(calls) == expected, (arch, sorted(calls))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    globals()["check_" + sys.argv[1]]()
    print("ok", sys.argv[1])
