"""What bounds the engine on this machine: the float32 matmul rate at a serving-like shape
(matmul_ceiling), the rate at a step's own rows over the model's own layer shapes
(step_matmul_rate, step_rates), the memory copy bandwidth (copy_bandwidth), and the parameters and bytes
a one-token step reads (model_weights): the ceiling and floor `bench throughput` prints, and
a whole run's ceiling (run_ceiling)."""
from __future__ import annotations

import time

MATMUL_TRIAL_FLOP = 4e9  # each timing of step_matmul_rate: calls enough for this many FLOPs,
MAX_REPS = 100           # but no more calls than this (a small model's shapes)


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


def step_matmul_rate(shapes: dict[tuple[int, int], int], rows: int, trials: int = 5,
                     trial_flop: float = MATMUL_TRIAL_FLOP) -> dict:
    """The fastest float32 rate this machine multiplies a step of `rows` rows through layers of
    `shapes` ((out, in) -> how many layers) at: each shape timed on random weights through each
    backend `auto` chooses among (pagedserve.executor.linear_timing.timed_backends), the fastest kept,
    best of `trials` (a ceiling: warm, the weight in cache), each of calls worth `trial_flop`
    (at most MAX_REPS calls); the rate over all the layers."""
    import torch

    from pagedserve.executor.linear import Linear
    from pagedserve.executor.linear_timing import prepare_timed

    flops = seconds = 0.0
    per_shape = {}
    for (n, k), layers in shapes.items():
        layer, x = Linear(torch.randn(n, k)), torch.randn(rows, k)
        backends = prepare_timed(layer)  # each copy made; the dense weight stays for the others
        calls = {b: (lambda b=b: layer.run(b, x)) for b in backends}
        reps = max(1, min(MAX_REPS, int(trial_flop // (2 * rows * n * k))))
        best = {}
        for _ in range(trials):
            for backend, call in calls.items():  # alternated, so all meet the same moments
                call()
                t = time.perf_counter()
                for _ in range(reps):
                    call()
                best[backend] = min(best.get(backend, float("inf")), (time.perf_counter() - t) / reps)
        fastest = min(best, key=best.get)
        per_shape[f"{n}x{k}"] = {"backend": fastest, "gflops": 2 * rows * n * k / best[fastest] / 1e9}
        flops += layers * 2 * rows * n * k
        seconds += layers * best[fastest]
    return {"rows": rows, "matmul_flops_per_s": flops / seconds, "shapes": per_shape}


def linear_shapes(model, with_head: bool = True) -> dict[tuple[int, int], int]:
    """(out, in) -> how many of the model's linear layers have that shape; without the LM
    head (`model.lm_head`) when not `with_head`."""
    from pagedserve.executor.linear import Linear

    head = getattr(model, "lm_head", None)
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, Linear) and (with_head or m is not head):
            shapes[m.shape] = shapes.get(m.shape, 0) + 1
    return shapes


def step_rates(engine, reqs) -> dict:
    """The machine's matmul rates for a run's steps (step_matmul_rate): a prefill chunk (the
    token budget's rows, or all the prompts' if fewer; no LM head) and a decode batch (as many
    rows as the run keeps running at most; with the LM head)."""
    model, sched = engine.executor.model, engine.loop.scheduler.config
    chunk = min(sched.max_num_batched_tokens, sum(r.prompt_len for r in reqs))
    return {"prefill": step_matmul_rate(linear_shapes(model, with_head=False), max(chunk, 1)),
            "decode": step_matmul_rate(linear_shapes(model), min(len(reqs), sched.max_num_seqs))}


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
    layer read in the form its one-row backend uses (dense for MKL and "dot", prepacked), the other parameters
    as they are, but not the embedding table (a step reads one row of it per token)."""
    import torch

    from pagedserve.executor.linear import DENSE, Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    in_linears = {id(m.weight) for m in linears if m.weight is not None}
    params = read = 0
    for m in linears:
        dense, prepared = m.held_bytes()
        params += m.shape[0] * m.shape[1]
        read += dense if m.backend_for(1) in DENSE else prepared
    embed = getattr(model, "embed", None)
    for p in model.parameters():
        if id(p) in in_linears:
            continue
        params += p.numel()
        if not (isinstance(embed, torch.Tensor) and p is embed):
            read += p.numel() * p.element_size()
    return params, read


def run_ceiling(reqs, output_tokens: int, flops_per_token: float, head_flops: float, flops_per_s: float,
                kv_bytes_per_token: int, bytes_per_s: float, prompt_flops_per_s: float | None = None) -> dict:
    """A run's ceiling (issue 44): every computed row's matmul FLOPs at the measured rate, plus
    each output token's read of its context's K/V (the decode steps' mean context) at the copy
    bandwidth; on a CPU matmuls and attention run one after the other, so the times add. A
    prompt row never reaches the LM head (`head_flops` per row; only output tokens' rows do).
    Prompt rows go at `prompt_flops_per_s` when given (a prefill chunk's rate), output rows at
    `flops_per_s`."""
    prompt_tokens = sum(r.prompt_len for r in reqs)
    context = sum(r.prompt_len + r.output_len / 2 for r in reqs) / len(reqs)
    prompt_rate = prompt_flops_per_s or flops_per_s
    matmul_s = (prompt_tokens * (flops_per_token - head_flops) / prompt_rate
                + output_tokens * flops_per_token / flops_per_s)
    kv_s = output_tokens * context * kv_bytes_per_token / bytes_per_s
    return {"kv_bytes_per_token": kv_bytes_per_token, "mean_decode_context": context, "run_matmul_s": matmul_s,
            "run_kv_s": kv_s, "run_ceiling_output_tokens_per_s": output_tokens / (matmul_s + kv_s)}
