"""`bench step-cost` refuses bad batch sizes (its runs: tests/integration/test_step_cost_runs.py)."""
from pagedserve.benchmarks import step_cost


def test_bad_batch_sizes_are_refused(capsys):
    class Args:
        batch_sizes, input_len, output_len, json, out = "0", 8, 4, False, ""

    assert step_cost.run(Args()) == 2
    assert "--batch-sizes" in capsys.readouterr().err
