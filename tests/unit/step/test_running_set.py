"""pagedserve.step.running_set: the step's columns applied to the held tables (slots derived,
changes checked), fed tokens filled from the last samples, samples recorded per row."""
import numpy as np
import pytest

from pagedserve.step.running_set import RunningSet, StateLost
from pagedserve.step.step_batch import FLAG_HISTORY, FLAG_INVALID, FLAG_PLAIN, FLAG_PROMPT_LOGPROBS
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from pagedserve.wire.step_delta import STATE_LOST
from pagedserve.wire.step_feed import FED_UNKNOWN, FedTokenUnknown

BS = 4
GREEDY = SamplingParams(temperature=0.0)
PENALTY = SamplingParams(temperature=0.0, repetition_penalty=1.3)


def step(running, rows, fed=(), **fields):
    """Apply one step of `rows`: (seq id, start, tokens (PENDING: fed), sample, table start,
    new blocks)."""
    ids, start, n, tokens, fed_col, sample, tstart, nnew, new = [], [], [], [], [], [], [], [], []
    for seq_id, s, toks, smp, ts, blocks in rows:
        ids.append(seq_id)
        start.append(s)
        n.append(len(toks))
        fed_col.append(toks[0] == PENDING)
        tokens += [t for t in toks if t != PENDING]
        sample.append(smp)
        tstart.append(ts)
        nnew.append(len(blocks))
        new += blocks
    return running.apply(ids, start, n, tokens, fed_col, sample, tstart, nnew, new, **fields)


def admitted(*seqs, sampling=GREEDY):
    running = RunningSet(BS, rows=2, width=2)  # small, so that the tests grow it
    for seq_id in seqs:
        running.admit(seq_id, sampling, 0)
    return running


def test_slots_come_from_the_held_tables_and_follow_their_changes():
    running = admitted("a", "b")
    first = step(running, [("a", 0, [5, 6, 7, 8, 9], True, 0, [3, 8]), ("b", 0, [1, 2], False, 0, [4])],
                 pool_epoch="e", step=1)
    b = first.batch
    assert b.seq_ids == ["a", "b"] and b.token_ids.tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert b.slot_mapping.tolist() == [12, 13, 14, 15, 32, 16, 17]
    assert b.block_tables.tolist() == [[3, 8], [4, 0]] and b.table_lens.tolist() == [2, 1]
    assert b.starts.tolist() == [0, 5, 7] and b.sample.tolist() == [True, False]
    assert b.pool_epoch == "e" and b.step == 1
    # a decodes within its block; b's prompt ends in a new block; then a's last block is replaced
    b = step(running, [("a", 5, [10], True, 2, []), ("b", 2, [3, 4, 5], True, 1, [9])]).batch
    assert b.slot_mapping.tolist() == [33, 18, 19, 36]
    assert b.block_tables.tolist() == [[3, 8], [4, 9]]
    b = step(running, [("a", 6, [11], True, 1, [7])]).batch
    assert b.slot_mapping.tolist() == [30] and b.block_tables.tolist() == [[3, 7]]
    b = step(running, [("a", 2, [7, 8], True, 1, [])]).batch  # a table cut back to one block (recompute)
    assert b.block_tables.tolist() == [[3]] and running.tables[running.row_of["a"], 1] == 0


def test_tables_and_rows_grow_past_their_first_size():
    running = admitted()
    ids = [f"s{i}" for i in range(5)]
    for seq_id in ids:
        running.admit(seq_id, GREEDY, 0)
    b = step(running, [(s, 0, list(range(4 * (i + 1))), True, 0, list(range(10 * i, 10 * i + i + 1)))
                       for i, s in enumerate(ids)]).batch
    assert b.table_lens.tolist() == [1, 2, 3, 4, 5] and b.block_tables.shape == (5, 5)
    assert b.block_tables[4].tolist() == [40, 41, 42, 43, 44]
    assert b.slot_mapping[-4:].tolist() == [44 * BS + k for k in range(4)]


def test_changes_that_do_not_fit_are_refused():
    running = admitted("a")
    step(running, [("a", 0, [1, 2, 3], True, 0, [6])])
    with pytest.raises(StateLost, match=STATE_LOST):
        step(running, [("x", 0, [1], True, 0, [1])])
    with pytest.raises(ValueError, match="block table change at 2, but it holds 1 blocks"):
        step(running, [("a", 3, [4], True, 2, [7])])
    with pytest.raises(ValueError, match="1 blocks in its table, 2 needed for 5 tokens"):
        step(running, [("a", 3, [4, 5], True, 1, [])])
    with pytest.raises(ValueError, match="a fed step computes one token"):
        running.apply(["a"], [3], [2], [9], [True], [True], [1], [0], [])
    with pytest.raises(ValueError, match="do not add up"):
        running.apply(["a"], [3], [1], [4, 5], None, [True], [1], [0], [])
    with pytest.raises(ValueError, match="at least one token"):
        running.apply(["a"], [3], [0], [], None, [True], [1], [0], [])


def test_fill_puts_the_last_sample_in_place_and_refuses_an_unknown_one_whole():
    running = admitted("a", "b", "c")
    running.admit("a", PENALTY, 0, prompt_len=2, history=[])
    first = step(running, [("a", 0, [1, 2], True, 0, [0]), ("b", 0, [3], False, 0, [1]),
                           ("c", 0, [4], True, 0, [2])])
    running.fill(first)
    running.record(first, [SampleOutput("a", 10), SampleOutput("c", 30)])
    ok = step(running, [("a", 2, [PENDING], True, 1, []), ("b", 1, [5], True, 1, []),
                        ("c", 1, [PENDING], True, 1, [])])
    assert ok.batch.token_ids.tolist() == [PENDING, 5, PENDING] and ok.fed.tolist() == [0, 2]
    running.fill(ok)
    assert ok.batch.token_ids.tolist() == [10, 5, 30]
    assert ok.batch.prompt_of(0) == [1, 2] and ok.batch.output_of(0) == [10]  # the history has it too
    assert running.held[running.row_of["a"]].history == [1, 2, 10]
    # "a" sampled at position 2 only; "b" never sampled: the whole batch is refused unchanged
    bad = step(running, [("a", 2, [PENDING], True, 1, []), ("b", 2, [PENDING], True, 1, [])])
    with pytest.raises(FedTokenUnknown, match=f"{FED_UNKNOWN}: sequence 'b' at position 2"):
        running.fill(bad)
    assert bad.batch.token_ids.tolist() == [PENDING, PENDING]
    running.forget(["a"])  # forgotten: unknown; sent again, its last sample is not held
    with pytest.raises(StateLost):
        step(running, [("a", 2, [PENDING], True, 1, [])])
    running.admit("a", GREEDY, 0, table=[0])
    with pytest.raises(FedTokenUnknown):
        running.fill(step(running, [("a", 2, [PENDING], True, 1, [])]))


def test_a_fed_token_in_a_step_with_a_prefill_chunk():
    running = admitted("a", "p")
    first = step(running, [("a", 0, [1, 2], True, 0, [0])])
    running.record(first, [SampleOutput("a", 10)])
    mixed = step(running, [("p", 0, [4, 5, 6], True, 0, [1]), ("a", 2, [PENDING], True, 1, [])])
    assert mixed.batch.token_ids.tolist() == [4, 5, 6, PENDING]
    running.fill(mixed)
    assert mixed.batch.token_ids.tolist() == [4, 5, 6, 10] and mixed.batch.slot_mapping.tolist() == [4, 5, 6, 2]


def test_record_keeps_sampled_rows_only_and_skips_a_row_given_to_another_sequence():
    running = admitted("a", "p")
    running.admit("p", SamplingParams(temperature=0.0, prompt_logprobs=0), 0, prompt=[4, 5, 6, 7])
    first = step(running, [("p", 0, [4, 5], False, 0, [1]), ("a", 0, [1, 2], True, 0, [0])])
    assert first.batch.reports().tolist() == [True, True]  # p scores prompt tokens 5, 6
    running.record(first, [SampleOutput("p", -1, sampled=False), SampleOutput("a", 10)])
    assert running.last_pos[running.row_of["p"]] == -1 and running.last_pos[running.row_of["a"]] == 2
    # a step of "a" is recorded after "a" was forgotten and its row given to "x": x has no sample
    second = step(running, [("a", 2, [PENDING], True, 1, [])])
    running.fill(second)
    running.forget(["a"])
    running.admit("x", GREEDY, 0, table=[0])
    running.record(second, [SampleOutput("a", 11)])
    with pytest.raises(FedTokenUnknown):
        running.fill(step(running, [("x", 3, [PENDING], True, 1, [])]))


def test_a_sequence_left_out_stays_out_of_the_steps_behind_it_until_forgotten():
    running = admitted("a", "b")
    first = step(running, [("a", 0, [1], True, 0, [0]), ("b", 0, [2], True, 0, [1])])
    running.record(first, [SampleOutput("a", -1, sampled=False, error="ValueError: bad slot"),
                           SampleOutput("b", 20)])
    behind = step(running, [("a", 1, [PENDING], True, 1, []), ("b", 1, [PENDING], True, 1, [])])
    running.fill(behind)
    assert behind.batch.errors == {0: "left out of an earlier step: ValueError: bad slot"}
    assert behind.batch.token_ids.tolist() == [0, 20] and behind.batch.reports().tolist() == [True, True]
    running.forget(["a"])
    assert running.left_out == {}


def test_admit_sums_up_the_sampling_in_flags_and_columns():
    running = RunningSet(BS)
    running.admit("g", GREEDY, 0)
    running.admit("t", SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1), 0)
    running.admit("h", PENALTY, 0, prompt_len=1, history=[])
    running.admit("l", SamplingParams(temperature=0.0, prompt_logprobs=1), 0, prompt=[1, 2])
    running.admit("bad", SamplingParams(min_tokens=9, max_tokens=2), 0)
    ids = ["g", "t", "h", "l", "bad"]
    b = running.apply(ids, [0] * 5, [1] * 5, [1] * 5, None, [True] * 5, [0] * 5, [1] * 5, [0, 1, 2, 3, 4]).batch
    assert [int(f) for f in b.flags] == [FLAG_PLAIN, 0, FLAG_HISTORY, FLAG_PLAIN | FLAG_PROMPT_LOGPROBS,
                                         FLAG_INVALID]
    assert b.temperature.tolist()[:4] == [1.0, 0.5, 1.0, 1.0]
    assert b.top_k.tolist()[:2] == [0, 3] and b.top_p.tolist()[1] == pytest.approx(0.9)
    assert b.min_p.tolist()[1] == pytest.approx(0.1)
    assert list(b.errors) == [4] and "min_tokens" in b.errors[4] and b.held[4].error == b.errors[4]
    assert b.histories == {2: ([1], [])} and b.prompt_of(3) == [1, 2]


def test_a_history_is_cut_back_where_a_step_computes_again():
    running = RunningSet(BS)
    running.admit("p", PENALTY, 0, prompt_len=3, history=[])
    b = running.apply(["p"], [0], [3], [5, 6, 7], None, [True], [0], [1], [2]).batch
    assert b.histories == {0: ([5, 6, 7], [])}
    b = running.apply(["p"], [3], [1], [42], None, [True], [1], [0], []).batch
    assert b.histories == {0: ([5, 6, 7], [42])}
    b = running.apply(["p"], [2], [2], [7, 43], None, [True], [1], [0], []).batch  # from position 2 again
    assert b.histories == {0: ([5, 6, 7], [43])}


def test_columns_have_their_dtypes():
    running = admitted("a")
    b = step(running, [("a", 0, [1, 2], True, 0, [0])]).batch
    assert b.start_pos.dtype == b.num_tokens.dtype == b.token_ids.dtype == b.slot_mapping.dtype == np.int64
    assert b.block_tables.dtype == b.table_lens.dtype == np.int32
    assert b.sample.dtype == bool and b.flags.dtype == np.uint8 and b.temperature.dtype == np.float32


def test_a_sequence_admitted_again_keeps_its_last_sample():
    running = admitted("a")
    running.record(step(running, [("a", 0, [1, 2], True, 0, [0])]), [SampleOutput("a", 10)])
    running.admit("a", PENALTY, 0, prompt_len=2, history=[1, 2], table=[5])  # its state sent again
    again = step(running, [("a", 2, [PENDING], True, 1, [])])
    running.fill(again)
    assert again.batch.token_ids.tolist() == [10] and again.batch.slot_mapping.tolist() == [22]
    assert again.batch.histories == {0: ([1, 2], [10])}
