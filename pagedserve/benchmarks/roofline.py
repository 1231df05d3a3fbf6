"""What bounds the engine on this machine: the float32 matmul rate at a serving-like shape
(matmul_ceiling), the memory copy bandwidth (copy_bandwidth), and the parameters and bytes a
one-token step reads (model_weights): the ceiling and floor `bench throughput` prints, and a
whole run's ceiling (run_ceiling)."""
from __future__ import annotations

import time


def matmul_ceiling(hidden: int, intermediate: int, flops_per_token: float, trials: int = 5) -> dict:
    """Measured fp32 matmul rate at a serving-like shape (the best of `trials` timings: a
    ceiling, so a trial slowed by a neighbour on a shared machine does not lower it), and the
    tokens/s it allows."""
    import torch

    a = torch.randn(512, hidden)
    b = torch.randn(hidden, 2 * intermediate)
    for _ in range(3):
        a @ b
    best, reps = float("inf"), 8
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, time.perf_counter() - t)
    rate = reps * 2 * a.shape[0] * hidden * 2 * intermediate / best
    return {"matmul_flops_per_s": rate, "flops_per_token": flops_per_token,
            "ceiling_tokens_per_s": rate / flops_per_token}


def copy_bandwidth(nbytes: int = 512 << 20) -> float:
    """Measured memory bandwidth in bytes/s: bytes read per second by a large tensor copy
    (the source is read once, the destination written once), best of a few."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def model_weights(model) -> tuple[int, int]:
    """(parameters, bytes a one-token step reads): every weight counted once whatever holds it
    (a tied embedding is the LM head's; a dropped dense weight by its shape), and each linear
    layer read in the form its one-row backend uses (dense, prepacked), the other parameters
    as they are, but not the embedding table (a step reads one row of it per token)."""
    import torch

    from pagedserve.executor.linear import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    in_linears = {id(m.weight) for m in linears if m.weight is not None}
    params = read = 0
    for m in linears:
        dense, prepared = m.held_bytes()
        params += m.shape[0] * m.shape[1]
        read += dense if m.backend_for(1) == "mkl" else prepared
    embed = getattr(model, "embed", None)
    for p in model.parameters():
        if id(p) in in_linears:
            continue
        params += p.numel()
        if not (isinstance(embed, torch.Tensor) and p is embed):
            read += p.numel() * p.element_size()
    return params, read


def run_ceiling(reqs, output_tokens: int, flops_per_token: float, head_flops: float, flops_per_s: float,
                kv_bytes_per_token: int, bytes_per_s: float) -> dict:
    """A run's ceiling (issue 44): every computed row's matmul FLOPs at the measured rate, plus
    each output token's read of its context's K/V (the decode steps' mean context) at the copy
    bandwidth; on a CPU matmuls and attention run one after the other, so the times add. A
    prompt row never reaches the LM head (`head_flops` per row; only output tokens' rows do)."""
    prompt_tokens = sum(r.prompt_len for r in reqs)
    context = sum(r.prompt_len + r.output_len / 2 for r in reqs) / len(reqs)
    matmul_s = ((prompt_tokens + output_tokens) * flops_per_token - prompt_tokens * head_flops) / flops_per_s
    kv_s = output_tokens * context * kv_bytes_per_token / bytes_per_s
    return {"kv_bytes_per_token": kv_bytes_per_token, "mean_decode_context": context, "run_matmul_s": matmul_s,
            "run_kv_s": kv_s, "run_ceiling_output_tokens_per_s": output_tokens / (matmul_s + kv_s)}
