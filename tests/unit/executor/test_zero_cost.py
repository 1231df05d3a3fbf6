from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.zero_cost import FIXED_TOKEN, ZeroCostExecutor
from pagedserve.wire.protocol import SamplingParams, SeqStep, StepBatch
from pagedserve.wire.settings import to_argv


def test_fixed_token_for_sampled_sequences_only():
    ex = ZeroCostExecutor(block_size=16)
    sp = SamplingParams()
    batch = StepBatch([SeqStep("a", [1, 2], 0, [0, 1], [0], True, sp, 1),
                       SeqStep("b", [3], 0, [16], [1], False, sp, 1)])
    out = ex.execute(batch)
    assert [(o.seq_id, o.token_id) for o in out] == [("a", FIXED_TOKEN)]
    assert ex.model_info().kv.block_size == 16


def test_zero_cost_flag_round_trips():
    assert "--zero-cost" in to_argv(ExecutorConfig(zero_cost=True))
