"""pagedserve.step.step_batch: reading a sequence out of the columns, which rows report, and
a batch cut to some rows (select) or joined from several callers' (concat)."""
import numpy as np

from pagedserve.step.batch_parts import concat
from pagedserve.step.step_batch import StepBatch, empty_batch
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams

BS = 4
PENALTY = SamplingParams(temperature=0.0, presence_penalty=0.5)


def test_prompt_logprob_positions_of_each_chunk():
    prompt = [5, 6, 7, 8, 9]
    sp = SamplingParams(prompt_logprobs=1)

    def step(start, n, sampling=sp, sample=False):
        return batch_of([Seq("a", prompt[start:start + n] or [1], start, [0, 1], sample, sampling, 0,
                             list(prompt))], BS)
    # chunks [0, 2), [2, 4), [4, 5): positions 0..3 score prompt tokens 1..4
    assert list(step(0, 2).prompt_logprob_positions(0)) == [0, 1]
    assert list(step(2, 2).prompt_logprob_positions(0)) == [2, 3]
    assert not step(4, 1, sample=True).prompt_logprob_positions(0)  # the last token: sampled only
    assert not step(5, 1, sample=True).prompt_logprob_positions(0)  # decode
    assert step(0, 2).reports().tolist() == [True] and step(0, 2, SamplingParams()).reports().tolist() == [False]


def mixed() -> StepBatch:
    return batch_of([Seq("a", [1, 2, 3], 0, [7]), Seq("b", [4], 5, [2, 3], False),
                     Seq("p", [9], 2, [5], True, PENALTY, 4, prompt=[8, 8], output=[9]),
                     Seq("c", [6, 7], 4, [1, 6, 0])], BS, pool_epoch="e", forget=["gone"], step=3,
                    copies=[(1, 2)])


def test_a_sequence_read_out_of_the_columns():
    b = mixed()
    assert b.num_seqs == 4 and b.starts.tolist() == [0, 3, 4, 5, 7]
    assert [b.tokens_of(i).tolist() for i in range(4)] == [[1, 2, 3], [4], [9], [6, 7]]
    assert b.slot_mapping.tolist() == [28, 29, 30, 13, 22, 24, 25]
    assert b.sampling(2) is PENALTY and b.held[2].seed == 4
    assert (b.prompt_of(2), b.output_of(2)) == ([8, 8], [9]) and b.prompt_of(0) == b.output_of(0) == []


def test_select_keeps_the_rows_asked_for_with_their_tokens_slots_tables_and_histories():
    b = mixed()
    b.errors[1] = "left out"
    s = b.select(np.array([0, 2, 3]))
    assert s.seq_ids == ["a", "p", "c"] and s.token_ids.tolist() == [1, 2, 3, 9, 6, 7]
    assert s.slot_mapping.tolist() == [28, 29, 30, 22, 24, 25] and s.starts.tolist() == [0, 3, 4, 6]
    assert s.block_tables.tolist() == [[7, 0, 0], [5, 0, 0], [1, 6, 0]] and s.table_lens.tolist() == [1, 1, 3]
    assert s.histories == {1: ([8, 8], [9])} and s.errors == {}  # the errors stay with the batch
    assert s.temperature.tolist() == [1.0, 1.0, 1.0] and s.flags.tolist() == b.flags[[0, 2, 3]].tolist()
    assert (s.pool_epoch, s.forget, s.step, s.copies) == ("e", ["gone"], 3, [(1, 2)])
    narrow = b.select(np.array([0]))
    assert narrow.block_tables.tolist() == [[7]]


def test_concat_joins_callers_in_order_errors_and_histories_moved_to_their_rows():
    one, two = mixed(), batch_of([Seq("a", [5], 3, [9]), Seq("q", [9], 2, [4], True, PENALTY, 0, [3, 3], [9])], BS,
                                 forget=["x"], copies=[(5, 6)])
    one.errors[1] = "bad"
    two.errors[0] = "worse"
    both = concat([one, two])
    assert both.seq_ids == ["a", "b", "p", "c", "a", "q"]  # the same id from two callers stays two rows
    assert both.token_ids.tolist() == one.token_ids.tolist() + [5, 9]
    assert both.block_tables.shape == (6, 3) and both.block_tables[4].tolist() == [9, 0, 0]
    assert both.errors == {1: "bad", 4: "worse"}
    assert both.histories == {2: ([8, 8], [9]), 5: ([3, 3], [9])}
    assert both.forget == ["gone", "x"] and both.copies == [(1, 2), (5, 6)]
    assert both.reports().tolist() == [True, True, True, True, True, True]
    assert concat([one]) is one


def test_an_empty_batch_reports_nothing_and_joins_as_nothing():
    e = empty_batch(forget=["a"], step=2)
    assert e.num_seqs == 0 and e.starts.tolist() == [0] and e.reports().tolist() == []
    both = concat([e, mixed()])
    assert both.seq_ids == ["a", "b", "p", "c"] and both.forget == ["a", "gone"]
