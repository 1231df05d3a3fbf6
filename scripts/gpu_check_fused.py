"""gpu_check's `kernels` part, the fused per-layer ops (pagedserve/kernels/fused_triton.py,
rotary_store_triton.py): each Triton kernel at the served models' shapes against its float32
reference (pagedserve/kernels/fused_ref.py, on the inputs upcast; REF_TOL, relative to the largest
value) and, in 16 bits, against the torch code it replaces in the model, in the same dtype:
the kernels round where that code rounds, so the rotary and the residual sum are bit for bit
(exact_share 1) and the norms and SiLU-and-multiply all but bit for bit (float32 summation
order, Triton's exp: exact_share at least NEAR_EXACT, at most MAX_ULPS units in the last place
apart). float32 is held to the reference only (FMA contraction). The pool's other layer and
qk's K heads stay as they were, bit for bit.

check_fused(torch, device, small=False, quick=False) returns one record per comparison.
small=True is the rehearsal's sizes, run by tests/system/test_gpu_check_scripts.py under
TRITON_INTERPRET=1 on the CPU, where the interpreter truncates float32 to bfloat16 instead of
rounding to nearest: bfloat16 is held to the reference only there.
"""
from __future__ import annotations

REF_TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}
MAX_ULPS = 3  # a 1-ulp flip of the normed value before the weight is up to 2 after it, then rounded
NEAR_EXACT = 0.99
ALL = ("bfloat16", "float16", "float32")
# (why, (tokens, hidden, intermediate, q heads, kv heads, head size), dtypes, in --quick): each
# shape and dtype is ~5 compiled variants (~0.5 s each); the serve part's model finds the
# first's in Triton's cache
SHAPES = [
    ("the serve part's model (llama-3.2-1b), a prefill step", (300, 2048, 8192, 32, 8, 64), ALL, True),
    ("llama-3-8b, a decode batch", (64, 4096, 14336, 32, 8, 128), ("bfloat16",), False),
    ("the default model (smollm2-135m), one row", (1, 576, 1536, 9, 3, 64), ("bfloat16",), False),
]
SMALL = [("odd sizes", (5, 40, 24, 5, 3, 6), ALL, True), ("one row", (1, 33, 7, 2, 1, 8), ALL, True)]


def ulps(torch, got, want) -> int:
    """The largest distance in units in the last place between two tensors of one float dtype."""
    bits, mask = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)}[got.element_size()]

    def ordered(t):
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & mask), i)

    return int((ordered(got) - ordered(want)).abs().max()) if got.numel() else 0


def record(torch, op, shape, dtype, got, torch_path, reference, exact) -> dict:
    """exact: the share of elements that must equal torch_path's (None: not compared)."""
    rel = float((got.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-6))
    u, share = ulps(torch, got, torch_path), float((got == torch_path).float().mean())
    ok = rel <= REF_TOL[dtype] and (exact is None or (share >= exact and u <= MAX_ULPS))
    return dict(kernel=op, shape=shape, dtype=dtype, rel_err_vs_ref=rel, ulps_vs_torch=u, exact_share=share,
                wanted_exact_share=exact, ok=ok)


def check_fused(torch, device, small: bool = False, quick: bool = False) -> list[dict]:
    import torch.nn.functional as F

    from pagedserve.executor.models.gemma import gemma_rms_norm
    from pagedserve.kernels import fused_ref, fused_triton

    def llama_norm(x, w, eps):  # the model's torch code for 16 bits (pagedserve/executor/models/llama.rms_norm)
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    g = torch.Generator(device=device).manual_seed(0)
    randn = lambda *s: torch.randn(s, generator=g, device=device)  # noqa: E731
    records, eps = [], 1e-5
    for shape, (t, hidden, inter, heads, kv, head), dtypes, in_quick in SMALL if small else SHAPES:
        for name in dtypes if in_quick or not quick else ():
            dtype = getattr(torch, name)
            compared = name != "float32" and not (small and name == "bfloat16")
            exact, near = (1.0, NEAR_EXACT) if compared else (None, None)
            add = lambda op, got, path, ref, want, shape=shape, name=name: records.append(  # noqa: E731
                record(torch, op, shape, name, got, path, ref, want))
            x, w = (randn(t, hidden) * 3).to(dtype), (randn(hidden) * 0.2 + 1).to(dtype)
            add("rms_norm", fused_triton.rms_norm(x, w, eps), llama_norm(x, w, eps),
                fused_ref.rms_norm_ref(x.float(), w.float(), eps), near)
            wg = randn(hidden) * 0.2 + 1  # Gemma: (1 + w) in float32, rounded after the weight
            add("rms_norm gemma", fused_triton.rms_norm(x, wg, eps, round_first=False), gemma_rms_norm(x, wg, eps),
                fused_ref.rms_norm_ref(x.float(), wg, eps), near)
            a, r = (randn(t, hidden) * 3).to(dtype), (randn(t, hidden) * 3).to(dtype)
            a0, summed = a.clone(), a + r
            got = fused_triton.add_rms_norm_(a, r, w, eps)
            ref_sum, ref = fused_ref.add_rms_norm_ref(a0.float(), r.float(), w.float(), eps)
            add("add_rms_norm sum", a, summed, ref_sum, exact)
            add("add_rms_norm", got, llama_norm(summed, w, eps), ref, near)
            gu = (randn(t, 2 * inter) * 4).to(dtype)
            gate, up = gu.chunk(2, dim=-1)
            add("silu_and_mul", fused_triton.silu_and_mul(gu), F.silu(gate) * up,
                fused_ref.silu_and_mul_ref(gu.float()), near)
            records.extend(check_rotary_store(torch, device, randn, shape, name, (t, heads, kv, head), exact))
    return records


def check_rotary_store(torch, device, randn, shape, name, sizes, exact) -> list[dict]:
    from pagedserve.executor.models.rotary import apply_rotary
    from pagedserve.kernels import fused_ref, rotary_store_triton
    from pagedserve.kernels.store_kv_ref import store_kv_ref

    t, heads, kv, head = sizes
    dtype = getattr(torch, name)
    block, blocks = 16, t // 8 + 4
    qkv = randn(t, (heads + 2 * kv) * head).to(dtype)
    qk, v = qkv[:, : (heads + kv) * head].view(t, heads + kv, head), qkv[:, (heads + kv) * head:].view(t, kv, head)
    angles = randn(t, head // 2) * 30
    cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
    slots = torch.randperm(blocks * block, device=device)[:t]
    slots[1::5] = -1
    pool = randn(blocks, 2, 2, block, kv, head).to(dtype)
    path_pool, ref_pool = pool.clone(), pool.float()
    rotated = apply_rotary(qk, cos, sin)  # the torch path, in dtype
    store_kv_ref(rotated[:, heads:], v, path_pool[:, 1, 0], path_pool[:, 1, 1], slots)
    ref_q = fused_ref.rotary_store_kv_ref(qk.float(), v.float(), cos.float(), sin.float(), ref_pool[:, 1, 0],
                                          ref_pool[:, 1, 1], slots, heads)
    k_before = qk[:, heads:].clone()
    q = rotary_store_triton.rotary_store_kv_(qk, v, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots)
    untouched = torch.equal(pool[:, 0], path_pool[:, 0]) and torch.equal(qk[:, heads:], k_before)
    return [record(torch, "rotary_store q", shape, name, q, rotated[:, :heads], ref_q, exact),
            record(torch, "rotary_store kv", shape, name, pool[:, 1], path_pool[:, 1], ref_pool[:, 1], exact),
            dict(kernel="rotary_store untouched", shape=shape, dtype=name, ok=bool(untouched))]
