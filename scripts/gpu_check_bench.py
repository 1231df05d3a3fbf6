"""gpu_check's `bench` part: the decode kernel's bandwidth against the D2D copy bandwidth
measured in the same run (the goal shape: 256 x 2k, bfloat16), and paged against dense SDPA
attention on the same data. Each launch is timed twice: called eagerly (`paged_ms`, the
goals' figure as first run) and replayed from a CUDA graph as the executor replays decodes
(`paged_graph_ms`: the GPU's time, without Triton's host-side launch, which dominates small
shapes). The goals are reported; `ok` means the goal shape was measured.

gpu_check.py calls `part_bench(args, part)` with CUDA (without it the part is skipped).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_check_attention import copy_gb_per_s, dense_decode, graph_timed, make_paged, timed

if TYPE_CHECKING:
    from gpu_check import Part  # the runner's record of a part (no import at run time)


def part_bench(args, part: Part):
    import torch

    from pagedserve.kernels.paged_attention_triton import paged_attention_triton

    device = args.device
    copy_gbs = copy_gb_per_s(torch, device)
    rows = []
    shapes = [(256, 2048, 32, 8, 128, 16), (32, 8192, 32, 8, 128, 16), (4, 8192, 32, 8, 128, 16),
              (256, 2048, 32, 8, 128, 32), (64, 2048, 16, 16, 64, 16)]
    for num_seqs, context, heads, kv, head, block in shapes[:2] if args.quick else shapes:
        a = make_paged(torch, num_seqs, context, 1, heads, kv, head, block, torch.bfloat16, device)
        scale = head ** -0.5
        paged = lambda: paged_attention_triton(**a, scale=scale)  # noqa: E731
        dense = dense_decode(torch, a, scale)
        kv_bytes = 2 * num_seqs * context * kv * head * 2
        t_paged, t_dense = timed(torch, paged), timed(torch, dense)
        g_paged, g_dense = graph_timed(torch, paged), graph_timed(torch, dense)
        rows.append(dict(seqs=num_seqs, context=context, heads=heads, kv_heads=kv, head=head, block=block,
                         paged_ms=t_paged * 1e3, dense_sdpa_ms=t_dense * 1e3,
                         paged_gb_per_s=kv_bytes / t_paged / 1e9,
                         fraction_of_copy=kv_bytes / t_paged / 1e9 / copy_gbs,
                         paged_over_dense=t_paged / t_dense - 1,
                         paged_graph_ms=g_paged * 1e3, dense_graph_ms=g_dense * 1e3,
                         graph_fraction_of_copy=kv_bytes / g_paged / 1e9 / copy_gbs,
                         graph_paged_over_dense=g_paged / g_dense - 1))
        del a, paged, dense
        part.put("rows", rows)
        if part.over():
            part.put("reason", "time budget")
            break
    goal = next((r for r in rows if r["seqs"] == 256 and r["context"] == 2048 and r["block"] == 16), None)
    part.put("copy_gb_per_s", copy_gbs)
    result = {"goal_bandwidth_80pct": None if goal is None else goal["fraction_of_copy"] >= 0.8,
              "goal_overhead_10pct": None if goal is None else goal["paged_over_dense"] <= 0.10}
    # ok: the goal shape was measured (the goals themselves are reported, not required)
    result["status"] = "ok" if goal is not None and all(r["paged_ms"] > 0 for r in rows) else "failed"
    return result
