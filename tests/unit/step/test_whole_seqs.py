"""pagedserve.step.whole_seqs: sequences given whole (tables and token histories) make the
StepBatch the running set would make of the step message for them."""
import pytest

from pagedserve.step.running_set import RunningSet
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams

BS = 4
PENALTY = SamplingParams(temperature=0.0, repetition_penalty=1.2)


def test_slots_come_from_the_tables():
    b = batch_of([Seq("a", [1, 2, 3, 4, 5], 0, [6, 2]), Seq("b", [7], 9, [0, 1, 3], False)], BS)
    assert b.slot_mapping.tolist() == [24, 25, 26, 27, 8, 13]
    assert b.sample.tolist() == [True, False] and b.block_tables.tolist() == [[6, 2, 0], [0, 1, 3]]


def test_the_same_as_the_running_set_makes_of_the_step_message():
    seqs = [Seq("a", [4, 5], 3, [2, 8], True, PENALTY, 7, prompt=[1, 2, 3, 4], output=[5, 6]),
            Seq("b", [9], 0, [1], False)]
    b = batch_of(seqs, BS, step=5)
    running = RunningSet(BS)
    running.admit("a", PENALTY, 7, 4, [1, 2, 3])
    running.admit("b", SamplingParams(temperature=0.0), 0)
    m = running.apply(["a", "b"], [3, 0], [2, 1], [4, 5, 9], None, [True, False], [0, 0], [2, 1], [2, 8, 1],
                      step=5).batch
    for name in ("start_pos", "num_tokens", "token_ids", "sample", "slot_mapping", "block_tables", "flags"):
        assert getattr(b, name).tolist() == getattr(m, name).tolist(), name
    assert b.histories == m.histories == {0: ([1, 2, 3, 4], [5])}  # as of this step: up to position 4
    assert b.held[0].seed == 7 and b.step == 5


def test_a_table_too_short_is_refused():
    with pytest.raises(ValueError, match="1 blocks in its table, 2 needed for 5 tokens"):
        batch_of([Seq("a", [1, 2, 3, 4, 5], 0, [6])], BS)
