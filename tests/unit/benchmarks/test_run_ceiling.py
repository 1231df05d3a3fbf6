"""`bench throughput`'s run ceiling: prompt rows are counted without the LM head."""
from types import SimpleNamespace

import pytest

from pagedserve.benchmarks.roofline import run_ceiling


def test_prompt_rows_skip_the_lm_head_and_times_add():
    reqs = [SimpleNamespace(prompt_len=100, output_len=10), SimpleNamespace(prompt_len=300, output_len=30)]
    c = run_ceiling(reqs, 40, flops_per_token=10.0, head_flops=4.0, flops_per_s=2.0,
                    kv_bytes_per_token=8, bytes_per_s=16.0)
    assert c["run_matmul_s"] == pytest.approx(((400 + 40) * 10.0 - 400 * 4.0) / 2.0)
    assert c["mean_decode_context"] == pytest.approx((105 + 315) / 2)
    assert c["run_kv_s"] == pytest.approx(40 * 210 * 8 / 16.0)
    assert c["run_ceiling_output_tokens_per_s"] == pytest.approx(40 / (c["run_matmul_s"] + c["run_kv_s"]))
