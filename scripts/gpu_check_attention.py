"""The torch helpers of gpu_check's kernels and bench parts (and of scripts/gpu_kernel_sweep.py).

make_paged builds a random paged pool (blocks shuffled, optionally poisoned with NaN past each
sequence) and the kernel's arguments; dense_reference is causal attention over the same data in
float32, independent of pagedserve/kernels/; compare_attention runs a kernel against it and judges it by
REL_TOL; timed is seconds per call from CUDA events. torch is passed in, never imported here.
"""
from __future__ import annotations


def make_paged(torch, num_seqs, context, q_len, num_heads, num_kv, head, block, dtype, device, seed=0,
               mixed=False, pad=0, poison=False, mixed_launch=False, far=0):
    """A random pool with each sequence's blocks shuffled, and the kernel arguments.

    mixed: sequence lengths drawn in [q_len, context] (the last one `context`); pad: extra
    table columns past the widest sequence, naming block 0; poison: block 0 and every slot
    past a sequence's length hold NaN (a kernel that reads them returns NaN); mixed_launch:
    every other sequence (the odd ones) is a decode beside the others' q_len-token chunks;
    far: the blocks sit past `far` elements into a larger pool, whose other blocks are NaN
    (at 2^31, 32-bit offset arithmetic reads the wrong place)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-context // block)
    num_blocks = num_seqs * per_seq + 1
    pool = torch.randn((num_blocks, 2, block, num_kv, head), generator=gen, device=device).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen, device=device)[: num_seqs * per_seq] + 1)
    tables = tables.view(num_seqs, per_seq).to(torch.int32)
    if mixed:
        lens = torch.randint(max(q_len, 1), context + 1, (num_seqs,), generator=gen, device=device)
        lens[-1] = context
    else:
        lens = torch.full((num_seqs,), context, device=device)
    if pad:
        tables = torch.cat([tables, tables.new_zeros((num_seqs, pad))], 1)
    if poison:
        pool[0] = float("nan")
        for b, n in enumerate(lens.tolist()):
            last = tables[b, (n - 1) // block].item()
            pool[last, :, (n - 1) % block + 1:] = float("nan")
            for j in range(-(-n // block), per_seq):
                pool[tables[b, j].item()] = float("nan")
    q_lens = torch.clamp(lens, max=q_len)
    if mixed_launch:
        q_lens[1::2] = 1
    if far:
        offset = -(-far // pool[0].numel()) + 1
        big = torch.full((offset + num_blocks, *pool.shape[1:]), float("nan"), dtype=dtype, device=device)
        big[offset:] = pool
        pool, tables = big, tables + offset
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    starts[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn((int(starts[-1]), num_heads, head), generator=gen, device=device).to(dtype)
    return dict(q=q, k_cache=pool[:, 0], v_cache=pool[:, 1], block_tables=tables,
                seq_lens=lens.to(torch.int32), query_start_loc=starts)


def dense_reference(torch, a, scale, window=None, softcap=None):
    """Causal attention of make_paged's arguments in float32, one sequence at a time, reading
    only each sequence's own tokens (independent of pagedserve/kernels/); window: position p sees
    p - window + 1 .. p; softcap: scores s -> softcap * tanh(s / softcap)."""
    k_cache, v_cache, q = a["k_cache"], a["v_cache"], a["q"]
    block, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    starts = a["query_start_loc"].tolist()
    for b, n in enumerate(a["seq_lens"].tolist()):
        ids = a["block_tables"][b, : -(-n // block)].long()
        k = k_cache[ids].reshape(-1, num_kv, k_cache.shape[3])[:n].float().repeat_interleave(group, 1)
        v = v_cache[ids].reshape(-1, num_kv, v_cache.shape[3])[:n].float().repeat_interleave(group, 1)
        qs = q[starts[b]:starts[b + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        rows = torch.arange(n - len(qs), n, device=q.device)[:, None]
        cols = torch.arange(n, device=q.device)[None, :]
        hidden = cols > rows
        if window is not None:
            hidden |= cols <= rows - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[starts[b]:starts[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


REL_TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}  # relative L2 error vs float32


def compare_attention(torch, kernel, a, scale, splits=None, window=None, softcap=None):
    """The kernel's output (written over NaN) against dense_reference: relative L2 and max
    errors, whether it is finite, and ok."""
    out = torch.full_like(a["q"], float("nan"))
    extra = {k: v for k, v in (("num_splits", splits), ("window", window), ("softcap", softcap)) if v}
    kernel(**a, scale=scale, out=out, **extra)
    ref = dense_reference(torch, a, scale, window, softcap)
    diff = out.float() - ref
    rel_l2 = (diff.norm() / ref.norm()).item()
    rel_max = (diff.abs().max() / ref.abs().max()).item()
    finite = bool(torch.isfinite(out).all())
    dtype = str(a["q"].dtype).removeprefix("torch.")
    return dict(rel_l2=rel_l2, rel_max=rel_max, finite=finite, ok=finite and rel_l2 <= REL_TOL[dtype])


def timed(torch, fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def graph_timed(torch, fn, repeats=50):
    """Seconds per call of fn replayed from a CUDA graph (warmed on a side stream first), as
    the executor replays decodes: the GPU's time, without the host's launch cost (Triton's
    launcher takes ~50-100 us a call, more than a small decode kernel runs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(torch, graph.replay, repeats)


def copy_gb_per_s(torch, device="cuda") -> float:
    """Device-to-device copy bandwidth of 1 GiB, counting read and write: the ceiling the
    decode kernel's KV reads are set against."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(torch, lambda: dst.copy_(src), 10)
    return 2 * src.numel() / seconds / 1e9


def dense_decode(torch, a, scale):
    """SDPA over make_paged's decode arguments (one query a sequence, every sequence at the
    table's full length) with K/V gathered once into contiguous [B, kv, context, head]: a
    function of no arguments, the dense launch that paged attention is set against."""
    import torch.nn.functional as F

    k_cache, v_cache = a["k_cache"], a["v_cache"]
    num_seqs, (_, block, kv, head) = a["block_tables"].shape[0], k_cache.shape
    context = a["block_tables"].shape[1] * block
    ids = a["block_tables"].long()
    k = k_cache[ids].reshape(num_seqs, context, kv, head).transpose(1, 2).contiguous()
    v = v_cache[ids].reshape(num_seqs, context, kv, head).transpose(1, 2).contiguous()
    q = a["q"].view(num_seqs, -1, 1, head)
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
