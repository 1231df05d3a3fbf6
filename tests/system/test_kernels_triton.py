"""The Triton kernels against the torch references, under TRITON_INTERPRET=1 on the CPU,
and compiled ahead of time for an sm_90 GPU (which needs no GPU). The GPU itself, at real
shapes and in bfloat16, is scripts/gpu_check.py's part 1.

The interpreter has to be switched on before triton is first imported, so each check runs
in a fresh Python process (this file run as a script) started by its test.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_check(name, **extra):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1", **extra)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), name], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ok {name}" in done.stdout


@needs_triton
@pytest.mark.parametrize("name", ["paged_attention", "paged_attention_split_decode", "paged_attention_window",
                                  "store_kv", "copy_blocks"])
def test_triton_kernel_matches_reference(name):
    run_check(name, TRITON_INTERPRET="1")


@needs_triton
def test_triton_kernels_compile_for_sm90(tmp_path):
    run_check("compile", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")


def check_paged_attention():
    import torch
    from pagedserve.kernels.paged_attention_ref import paged_attention_ref
    from pagedserve.kernels.paged_attention_triton import paged_attention_triton
    from tests.unit.kernels.test_kernels_attention import make_batch

    # (seq_len, q_len): decodes, whole prompts, prefill chunks over a prefix, an empty entry
    specs = [(19, 1), (4, 1), (23, 23), (30, 7), (9, 0), (40, 1)]
    # block size, kv heads, group, dtype, padding, tile, splits. bfloat16 is not here: the
    # interpreter miscomputes bfloat16 dots (it is compiled below and checked on the GPU).
    cases = [
        (1, 2, 1, torch.float32, "negative", 32, None),  # per-position block ids (tile > 16 blocks)
        (8, 1, 3, torch.float32, "random", 16, None),
        (16, 1, 8, torch.float32, "negative", 32, 2),  # split context, prefill rows too
        (5, 2, 3, torch.float16, "random", 16, None),  # block size not a power of two
        (4, 1, 3, torch.float16, "negative", 16, 3),  # split context, 16-bit
        (8, 2, 4, torch.float32, "negative", None, None),  # host-chosen tile
    ]
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3}
    for block_size, num_kv_heads, group, dtype, padding, tile, splits in cases:
        args, _, _ = make_batch(specs, block_size, num_kv_heads, group, head_size=8, dtype=dtype,
                                padding=padding, seed=block_size)
        expected = paged_attention_ref(**args, scale=0.35)
        storage = torch.full((*args["q"].shape[:2], 11), float("nan"), dtype=dtype)
        out = storage[..., :8]
        paged_attention_triton(**args, scale=0.35, out=out, tile=tile, num_splits=splits)
        tol = tolerance[dtype]
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
        assert storage[..., 8:].isnan().all()
    # the launch sweep's overrides (scripts/gpu_kernel_sweep.py) reach the launch; the interpreter
    # runs any warps and stages, so only the plumbing is checked here, the settings on the GPU
    args, _, _ = make_batch(specs, 16, 2, 4, head_size=8, dtype=torch.float32, padding="random", seed=3)
    out = paged_attention_triton(**args, scale=0.35, tile=32, num_warps=8, num_stages=2)
    torch.testing.assert_close(out, paged_attention_ref(**args, scale=0.35), atol=1e-5, rtol=1e-5)


def check_paged_attention_split_decode():
    """Decode-only batches of few long sequences, as the split-context path sees them: every
    split count from 1 to more than the context has tiles, GQA 4, float32 and float16."""
    import torch
    from pagedserve.kernels.paged_attention_ref import paged_attention_ref
    from pagedserve.kernels.paged_attention_triton import paged_attention_triton
    from tests.unit.kernels.test_kernels_attention import make_batch

    specs = [(150, 1), (7, 1), (96, 1)]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        args, _, _ = make_batch(specs, 16, 2, 4, head_size=16, dtype=dtype, seed=5)
        expected = paged_attention_ref(**args, scale=0.25)
        for splits in (1, 2, 3, 5, 64):
            out = paged_attention_triton(**args, scale=0.25, tile=16, num_splits=splits)
            torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def check_paged_attention_window():
    """Sliding window and soft-capping against the reference, with the blocks wholly before
    every window poisoned with NaN (never read); mixed prefill and decode, and split decode."""
    import torch
    from pagedserve.kernels.paged_attention_ref import paged_attention_ref
    from pagedserve.kernels.paged_attention_triton import paged_attention_triton
    from tests.unit.kernels.test_kernels_attention import make_batch, poison_outside_window

    specs = [(19, 1), (4, 1), (23, 23), (30, 7), (9, 0), (40, 1)]
    for block_size, window, softcap, tile, splits in ((4, 6, None, 16, None), (8, 13, 1.5, 16, None),
                                                       (1, 3, None, 16, None), (4, 5, 2.0, 16, 3)):
        args, _, _ = make_batch(specs if splits is None else [(70, 1), (9, 1)], block_size, 2, 2,
                                head_size=8, seed=block_size + window)
        poison_outside_window(args, window)
        expected = paged_attention_ref(**args, scale=0.35, window=window, softcap=softcap)
        assert not expected.isnan().any()
        out = paged_attention_triton(**args, scale=0.35, tile=tile, num_splits=splits, window=window, softcap=softcap)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_store_kv():
    import torch
    from pagedserve.kernels.store_kv_ref import store_kv_ref
    from pagedserve.kernels.store_kv_triton import store_kv_triton

    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(3)
        pool = torch.randn(5, 2, 2, 4, 3, 6, generator=gen).to(dtype)
        expected = pool.clone()
        slots = torch.tensor([7, -1, 0, 19, 12, -5, 3], dtype=torch.int32)
        key = torch.randn(7, 3, 6, generator=gen).to(dtype)
        value = torch.randn(7, 3, 6, generator=gen).to(dtype)
        store_kv_triton(key, value, pool[:, 1, 0], pool[:, 1, 1], slots)
        store_kv_ref(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
        assert torch.equal(pool, expected)


def check_copy_blocks():
    import torch
    from pagedserve.kernels.copy_blocks_ref import copy_blocks_ref
    from pagedserve.kernels.copy_blocks_triton import copy_blocks_triton

    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(8, 2, 2, 4, 3, 5, generator=gen)
    other = torch.randn(6, 2, 2, 4, 3, 5, generator=gen)
    expected_pool, expected_other = pool.clone(), other.clone()
    copy_blocks_triton(pool, pool, [1, 6], [4, 0], chunk=64)
    copy_blocks_ref(expected_pool, expected_pool, [1, 6], [4, 0])
    assert torch.equal(pool, expected_pool)
    copy_blocks_triton(pool, other, torch.tensor([7, 2, 3]), torch.tensor([5, 0, 1]), chunk=64)
    copy_blocks_ref(expected_pool, expected_other, [7, 2, 3], [5, 0, 1])
    assert torch.equal(other, expected_other) and torch.equal(pool, expected_pool)


def check_compile():
    from pagedserve.kernels.triton_aot import compile_all

    assert compile_all(90) == 3 * 7 + 2 + 3 * 5  # attention, store and copy; the fused ops


if __name__ == "__main__":
    if sys.argv[1] != "compile":
        assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    globals()["check_" + sys.argv[1]]()
    print("ok", sys.argv[1])
