from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.zero_cost import FIXED_TOKEN, ZeroCostExecutor
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.settings import to_argv


def test_fixed_token_for_sampled_sequences_only():
    ex = ZeroCostExecutor(block_size=16)
    sp = SamplingParams()
    batch = batch_of([Seq("a", [1, 2], 0, [0], True, sp, 1),
                      Seq("b", [3], 0, [1], False, sp, 1)], 16)
    assert batch.slot_mapping.tolist() == [0, 1, 16]
    out = ex.execute(batch)
    assert [(o.seq_id, o.token_id) for o in out] == [("a", FIXED_TOKEN)]
    assert ex.model_info().kv.block_size == 16


def test_prompt_logprobs_score_every_prompt_token_as_certain():
    ex = ZeroCostExecutor(block_size=4)
    sp = SamplingParams(prompt_logprobs=0)
    prompt = [5, 6, 7, 8, 9]
    first, last = (batch_of([Seq("a", prompt[:3], 0, [0, 1], False, sp, 1, prompt=prompt)], 4),
                   batch_of([Seq("a", prompt[3:], 3, [0, 1], True, sp, 1, prompt=prompt)], 4))
    [o] = ex.execute(first)
    assert not o.sampled and [(p.token_id, p.logprob, p.rank) for p in o.prompt_logprobs] == \
        [(6, 0.0, 1), (7, 0.0, 1), (8, 0.0, 1)]
    [o] = ex.execute(last)
    assert o.sampled and o.token_id == FIXED_TOKEN


def test_zero_cost_flag_round_trips():
    assert "--zero-cost" in to_argv(ExecutorConfig(zero_cost=True))
