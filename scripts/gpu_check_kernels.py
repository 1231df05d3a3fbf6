"""gpu_check's `kernels` part: store_kv, copy_blocks and the host-pool swap exactly, the fused
per-layer ops against their references and the model's torch code (gpu_check_fused.py), then
paged attention against a float32 reference at the shapes that matter (KERNEL_CASES, the quick
ones first), and that batches of other sizes compile nothing new.

gpu_check.py calls `part_kernels(args, part)` with CUDA and `kernels_without_cuda(args, part)`
without it (the imports, the swap on the CPU and, with --aot-compile, the sm_90 compile).
"""
from __future__ import annotations

import importlib
import importlib.util
import time
from typing import TYPE_CHECKING, NamedTuple

from gpu_check_attention import compare_attention, make_paged
from gpu_check_fused import check_fused

if TYPE_CHECKING:
    from gpu_check import Part  # the runner's record of a part (no import at run time)


def check_swap(torch, device) -> bool:
    """Blocks through host memory and back (pagedserve.memsvc.host_pool), each way waited for before the
    next reads it (swap_copy only queues the copy)."""
    from pagedserve.memsvc.host_pool import finish_copies, swap_copy

    pool = torch.randn((32, 2, 2, 16, 4, 64), device=device)
    host = torch.empty((16, 2, 2, 16, 4, 64), pin_memory=torch.device(device).type == "cuda")
    swap_copy(pool, host, [3, 9, 4, 5], [0, 1, 2, 7])
    finish_copies(pool)  # the device-to-host copy must land before the swap-in reads `host`
    back = torch.zeros_like(pool)
    swap_copy(host, back, [0, 1, 2, 7], [3, 9, 4, 5])
    finish_copies(back)
    return all(torch.equal(back[i], pool[i]) for i in (3, 9, 4, 5))


ATTENTION_SHAPES = {  # (query heads, kv heads, head size) of the models served
    "llama-3-8b": (32, 8, 128), "llama-3.2-1b": (32, 8, 64), "smollm2-135m": (9, 3, 64),
    "mha-128": (16, 16, 128), "llama-3-70b": (64, 8, 128), "services": (8, 2, 64)}


class KernelCase(NamedTuple):
    """One paged-attention comparison; every case mixes lengths, pads its table and poisons
    what lies past each sequence."""
    why: str
    shape: str  # a key of ATTENTION_SHAPES
    dtype: str
    block: int
    seqs: int
    context: int  # the longest sequence
    q_len: int = 1  # 1: decodes; more: prefill chunks
    splits: int | None = None  # None: the kernel's own choice
    mixed_launch: bool = False  # the odd sequences decode beside the others' chunks
    window: int | None = None
    softcap: float | None = None
    far: bool = False  # blocks past 2^31 elements into the pool
    quick: bool = False


# In order of what a failure would cost; --quick runs the first eight. The services part's and
# the serve part's models have the "services" and "llama-3.2-1b" shapes, so their executors
# compile these kernels first (Triton's cache is shared by the processes).
KERNEL_CASES = [
    KernelCase("a decode batch at the serving shape", "llama-3-8b", "bfloat16", 16, 64, 2048, quick=True),
    KernelCase("few long decodes: the split context", "llama-3-8b", "bfloat16", 16, 2, 8192, quick=True),
    KernelCase("prefill chunks beside decodes in one launch", "llama-3-8b", "bfloat16", 16, 4, 3000, q_len=128,
               mixed_launch=True, quick=True),
    KernelCase("the serve part's model: decode", "llama-3.2-1b", "bfloat16", 16, 32, 2048, quick=True),
    KernelCase("the serve part's model: prefill", "llama-3.2-1b", "bfloat16", 16, 4, 1000, q_len=128, quick=True),
    KernelCase("the default model: GQA 3", "smollm2-135m", "bfloat16", 16, 8, 1000, q_len=32, mixed_launch=True,
               quick=True),
    KernelCase("float16", "llama-3-8b", "float16", 16, 16, 2048, quick=True),
    KernelCase("the services part's model, float32", "services", "float32", 16, 8, 300, q_len=40,
               mixed_launch=True, quick=True),
    KernelCase("block 32: decode", "llama-3-8b", "bfloat16", 32, 64, 2048),
    KernelCase("block 32: prefill", "llama-3-8b", "bfloat16", 32, 4, 2048, q_len=128),
    KernelCase("4 splits forced", "llama-3-8b", "bfloat16", 16, 8, 5000, splits=4),
    KernelCase("pool offsets past 2^31 elements", "llama-3-8b", "bfloat16", 16, 8, 2048, far=True),
    KernelCase("MHA (GQA 1)", "mha-128", "bfloat16", 16, 32, 2048, q_len=64, mixed_launch=True),
    KernelCase("GQA 8", "llama-3-70b", "bfloat16", 16, 16, 4096),
    KernelCase("a long prefill chunk", "llama-3-8b", "bfloat16", 16, 1, 8192, q_len=512),
    KernelCase("sliding window", "llama-3-8b", "bfloat16", 16, 8, 3000, q_len=64, mixed_launch=True, window=1024),
    KernelCase("soft-capped scores", "llama-3-8b", "bfloat16", 16, 8, 2048, q_len=64, mixed_launch=True,
               softcap=30.0),
    KernelCase("float16 prefill", "llama-3-8b", "float16", 16, 4, 2048, q_len=128),
    KernelCase("float32 at a real shape", "llama-3-8b", "float32", 16, 16, 2048, q_len=64, mixed_launch=True),
]


def kernel_cases(quick: bool) -> list[KernelCase]:
    return [c for c in KERNEL_CASES if c.quick or not quick]


def compiled_variants(kernel) -> int | None:
    """How many variants Triton compiled of `kernel` (None where its cache is laid out otherwise)."""
    try:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        return None


def check_recompiles(torch, device) -> dict:
    """Batches of other sizes and table widths at one shape compile nothing new (the per-step
    integers are do_not_specialize)."""
    from pagedserve.kernels import paged_attention_triton as pat

    heads, kv, head = ATTENTION_SHAPES["llama-3-8b"]
    batches = [(64, 2048), (1, 300), (16, 1000), (17, 2047), (48, 129)]
    counts = []
    for num_seqs, context in batches:
        a = make_paged(torch, num_seqs, context, 1, heads, kv, head, 16, torch.bfloat16, device,
                       mixed=num_seqs > 1, pad=num_seqs % 3)
        pat.paged_attention_triton(**a, scale=head ** -0.5, num_splits=1)
        counts.append(compiled_variants(pat._paged_attention_kernel))
    torch.cuda.synchronize()
    if None in counts:  # this Triton keeps its cache otherwise: not measured, not failed
        return {"batches": [f"{n} x {c}" for n, c in batches], "ok": None, "reason": "compile cache not readable"}
    return {"batches": [f"{n} x {c}" for n, c in batches], "variants_after_each": counts,
            "new_variants": counts[-1] - counts[0], "ok": counts[-1] == counts[0]}


def check_store_copy(torch, device) -> list[dict]:
    """store_kv and copy_blocks against their references, bit for bit, in each dtype."""
    from pagedserve.kernels.copy_blocks_ref import copy_blocks_ref
    from pagedserve.kernels.copy_blocks_triton import copy_blocks_triton
    from pagedserve.kernels.store_kv_ref import store_kv_ref
    from pagedserve.kernels.store_kv_triton import store_kv_triton

    cases = []
    for name in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, name)
        pool = torch.randn((64, 4, 2, 16, 8, 128), device=device).to(dtype)
        expect = pool.clone()
        slots = torch.randperm(64 * 16, device=device)[:300]
        slots[::7] = -1
        key = torch.randn((300, 8, 128), device=device).to(dtype)
        value = torch.randn((300, 8, 128), device=device).to(dtype)
        store_kv_triton(key, value, pool[:, 2, 0], pool[:, 2, 1], slots)
        store_kv_ref(key, value, expect[:, 2, 0], expect[:, 2, 1], slots)
        cases.append(dict(kernel="store_kv", dtype=name, ok=torch.equal(pool, expect)))
        src, dst = torch.arange(0, 20, device=device), torch.arange(40, 60, device=device)
        copy_blocks_triton(pool, pool, src, dst)
        copy_blocks_ref(expect, expect, src, dst)
        cases.append(dict(kernel="copy_blocks", dtype=name, ok=torch.equal(pool, expect)))
    cases.append(dict(kernel="swap_copy", ok=check_swap(torch, device)))
    return cases


def part_kernels(args, part: Part):
    import torch

    from pagedserve.kernels.paged_attention_triton import paged_attention_triton

    device = args.device
    cases = part.put("cases", check_store_copy(torch, device))  # exact and cheap: first
    fused = part.put("fused", check_fused(torch, device, quick=args.quick))  # the per-layer ops, cheap too
    failures = sum(not c["ok"] for c in cases) + sum(not c["ok"] for c in fused)
    planned = kernel_cases(args.quick)
    for i, case in enumerate(planned):
        if part.over():
            part.put("failures", failures)
            return {"status": "failed", "reason": "time budget", "num_cases": len(cases),
                    "not_run": [c.why for c in planned[i:]]}
        heads, kv, head = ATTENTION_SHAPES[case.shape]
        t0 = time.monotonic()
        a = make_paged(torch, case.seqs, case.context, case.q_len, heads, kv, head, case.block,
                       getattr(torch, case.dtype), device, mixed=case.seqs > 1, pad=3, poison=True,
                       mixed_launch=case.mixed_launch, far=(1 << 31) if case.far else 0)
        result = compare_attention(torch, paged_attention_triton, a, head ** -0.5, case.splits, case.window,
                                   case.softcap)
        del a
        failures += not result["ok"]
        cases.append(dict(kernel="paged_attention", **case._asdict(), heads=heads, kv_heads=kv, head=head, **result,
                          seconds=round(time.monotonic() - t0, 2)))
        part.save()
    recompiles = part.put("recompiles", check_recompiles(torch, device))
    failures += recompiles["ok"] is False
    return {"status": "ok" if failures == 0 else "failed", "num_cases": len(cases), "failures": failures}


def kernels_without_cuda(args, part: Part):
    """No CUDA: the Triton modules import (with the Triton installed), the host-pool swap
    works on the CPU, and with --aot-compile every kernel compiles for sm_90 with this
    Triton; the comparisons themselves need the GPU."""
    import torch

    imports = {}
    for name in ("pagedserve.kernels.paged_attention_triton", "pagedserve.kernels.store_kv_triton", "pagedserve.kernels.copy_blocks_triton",
                 "pagedserve.kernels.fused_triton", "pagedserve.kernels.rotary_store_triton"):
        try:
            importlib.import_module(name)
            imports[name] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded
            imports[name] = f"{type(e).__name__}: {e}"
    part.put("triton_imports", imports if importlib.util.find_spec("triton") else "triton is not installed")
    swap = part.put("swap_copy_cpu", check_swap(torch, "cpu"))
    part.put("cases_planned", len(kernel_cases(args.quick)))
    broken = importlib.util.find_spec("triton") is not None and any(v != "ok" for v in imports.values())
    if args.aot_compile and importlib.util.find_spec("triton") and not broken:
        from pagedserve.kernels.triton_aot import compile_all

        t0 = time.monotonic()
        try:
            part.put("sm90_compile", {"variants": compile_all(90), "seconds": round(time.monotonic() - t0, 1)})
        except Exception as e:  # noqa: BLE001 - recorded: the finding this step is for
            part.put("sm90_compile", {"error": f"{type(e).__name__}: {e}"[-2000:]})
            broken = True
    return {"status": "failed" if broken or not swap else "skipped", "reason": "no CUDA"}
