"""StepUpdates: rows in columns, a SeqUpdate kept only for a row that carries more; read one
at a time, the rows are the SeqUpdates the general path used to make, in order."""
import pytest

from pagedserve.gateway.beam_search import BeamDone
from pagedserve.gateway.seq_update import SeqUpdate
from pagedserve.gateway.sequence import Sequence
from pagedserve.gateway.step_updates import StepUpdates
from pagedserve.wire.protocol import SamplingParams


def _seq(i):
    return Sequence(f"r{i}/0", f"r{i}", 0, [1, 2], SamplingParams(max_tokens=4), 0, 8, 0.0)


def test_plain_rows_keep_no_update_and_read_as_seq_updates():
    a, b = _seq(0), _seq(1)
    updates = StepUpdates()
    updates.add(a, 5)
    updates.add(b, 6, None, [], False, None)  # nothing more given: a plain row
    assert updates.more == {} and updates.seqs == [a, b] and updates.tokens == [5, 6]
    assert list(updates) == [SeqUpdate(a, 5), SeqUpdate(b, 6)] == updates
    assert updates[-1] == SeqUpdate(b, 6) and len(updates) == 2


def test_rows_that_carry_more_are_kept_whole_in_order():
    a, b, c = _seq(0), _seq(1), _seq(2)
    done = BeamDone("r9", [], 0)
    failed = SeqUpdate(c, None, finished=True, error="why")
    updates = StepUpdates()
    updates.add(a, 5, -0.5, [(5, -0.5)])
    updates.add(b, 6)
    updates.add(c, 7, finished=True)
    updates.append(done)
    updates.extend([failed])
    assert updates.seqs == [a, b, c, None, c] and updates.tokens == [5, 6, 7, None, None]
    assert sorted(updates.more) == [0, 2, 3, 4]
    assert list(updates) == [SeqUpdate(a, 5, -0.5, [(5, -0.5)]), SeqUpdate(b, 6),
                             SeqUpdate(c, 7, finished=True), done, failed]
    assert updates[1:3] == [SeqUpdate(b, 6), SeqUpdate(c, 7, finished=True)]


def test_carry_marks_a_row_of_columns_given_whole():
    a, b = _seq(0), _seq(1)
    updates = StepUpdates([a, b], [5, 6])
    updates.carry(1, -1.0)
    updates.carry(0)  # nothing more: stays plain
    assert list(updates) == [SeqUpdate(a, 5), SeqUpdate(b, 6, -1.0)]


def test_columns_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="2 sequences but 1 tokens"):
        StepUpdates([_seq(0), _seq(1)], [5])
