"""`bench throughput`'s run ceiling: prompt rows are counted without the LM head, at the prefill
chunk's rate when given; the rates come from the model's own layer shapes."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagedserve.benchmarks.roofline import linear_shapes, run_ceiling, step_matmul_rate
from pagedserve.executor.linear import Linear


def test_prompt_rows_skip_the_lm_head_and_times_add():
    reqs = [SimpleNamespace(prompt_len=100, output_len=10), SimpleNamespace(prompt_len=300, output_len=30)]
    c = run_ceiling(reqs, 40, flops_per_token=10.0, head_flops=4.0, flops_per_s=2.0,
                    kv_bytes_per_token=8, bytes_per_s=16.0)
    assert c["run_matmul_s"] == pytest.approx(((400 + 40) * 10.0 - 400 * 4.0) / 2.0)
    assert c["mean_decode_context"] == pytest.approx((105 + 315) / 2)
    assert c["run_kv_s"] == pytest.approx(40 * 210 * 8 / 16.0)
    assert c["run_ceiling_output_tokens_per_s"] == pytest.approx(40 / (c["run_matmul_s"] + c["run_kv_s"]))


def test_prompt_rows_go_at_the_prefill_rate_when_given():
    reqs = [SimpleNamespace(prompt_len=100, output_len=10)]
    c = run_ceiling(reqs, 10, flops_per_token=10.0, head_flops=4.0, flops_per_s=2.0,
                    kv_bytes_per_token=8, bytes_per_s=16.0, prompt_flops_per_s=3.0)
    assert c["run_matmul_s"] == pytest.approx(100 * 6.0 / 3.0 + 10 * 10.0 / 2.0)


def test_linear_shapes_count_layers_and_leave_out_the_head_when_asked():
    model = nn.Module()
    model.layers = nn.ModuleList([Linear(torch.zeros(8, 16)), Linear(torch.zeros(8, 16)), Linear(torch.zeros(16, 8))])
    model.lm_head = Linear(torch.zeros(32, 16))
    assert linear_shapes(model) == {(8, 16): 2, (16, 8): 1, (32, 16): 1}
    assert linear_shapes(model, with_head=False) == {(8, 16): 2, (16, 8): 1}


def test_a_steps_rate_is_the_layers_flops_over_their_fastest_times():
    r = step_matmul_rate({(64, 32): 3, (32, 64): 1}, rows=8, trials=2, trial_flop=1e6)
    assert r["rows"] == 8 and set(r["shapes"]) == {"64x32", "32x64"}
    rates = [s["gflops"] * 1e9 for s in r["shapes"].values()]
    assert all(s["backend"] in ("mkl", "onednn", "dot") for s in r["shapes"].values())
    assert min(rates) <= r["matmul_flops_per_s"] * (1 + 1e-9) and r["matmul_flops_per_s"] <= max(rates) * (1 + 1e-9)
