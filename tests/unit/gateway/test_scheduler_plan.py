"""The Scheduler alone (tests/support/scheduler_fakes.py): the plan's order and limits, how it applies
memsvc's answer, preemption by recompute and by swap."""
from __future__ import annotations

from pagedserve.gateway.sequence import SeqStatus
from pagedserve.wire.reserve_messages import Grant, Preemption, Rejection
from tests.support.scheduler_fakes import (
    FakeMem, answer, decode, ids, make_sched, make_seq, rows, running_pair, sample,
    slots_of, step, steps)


# -- plan order and limits ---------------------------------------------------------------


def test_plan_puts_running_before_swapped_before_waiting_whatever_their_priority():
    sched, mem = make_sched(), FakeMem()
    run = make_seq("run", range(10, 15), priority=5)  # the lowest priority of all
    swp = make_seq("swp", range(20, 25), priority=0, arrival=1.0)
    sched.add(run)
    sched.add(swp)
    step(sched, mem)  # both prefilled, first tokens drawn
    sched.plan()
    batch, _ = sched.on_reserved(answer(
        [decode(sched, "run")], preempted=[Preemption("swp", "swap")]))
    sample(sched, batch)
    sched.add(make_seq("new", range(30, 35), priority=-5, arrival=2.0))  # the highest
    assert [s.seq_id for s in sched.running] == ["run"]
    assert [s.seq_id for s in sched.swapped] == ["swp"]
    plan = sched.plan()
    assert ids(rows(plan)) == ["run", "swp", "new"]
    assert [e.new for e in rows(plan)] == [False, False, True]
    # a running / swapped entry carries exactly the token it computes next
    assert rows(plan)[0].token_ids == [50] and rows(plan)[1].token_ids == [50]
    assert rows(plan)[2].token_ids == list(range(30, 35))


def test_waiting_is_sorted_by_priority_then_arrival():
    sched = make_sched()
    order = [("d", 1, 0.0), ("b", 0, 2.0), ("c", 0, 3.0), ("a", 0, 1.0), ("e", -1, 9.0)]
    for seq_id, priority, arrival in order:
        sched.add(make_seq(seq_id, [1, 3, 4], priority=priority, arrival=arrival))
    assert [s.seq_id for s in sched.waiting] == ["e", "a", "b", "c", "d"]
    assert ids(rows(sched.plan())) == ["e", "a", "b", "c", "d"]


def test_max_num_seqs_caps_the_plan_running_first():
    sched, mem = make_sched(max_num_seqs=3), FakeMem()
    for i in range(2):
        sched.add(make_seq(f"r{i}", [5, 6, 7], arrival=i))
    step(sched, mem)
    for i in range(3):
        sched.add(make_seq(f"w{i}", [5, 6, 7], arrival=10 + i))
    assert ids(rows(sched.plan())) == ["r0", "r1", "w0"]

    only_new = make_sched(max_num_seqs=3)
    for i in range(5):
        only_new.add(make_seq(f"w{i}", [5, 6, 7], arrival=i))
    assert ids(rows(only_new.plan())) == ["w0", "w1", "w2"]


def test_max_num_batched_tokens_is_the_budget_of_the_whole_plan():
    sched, mem = make_sched(max_num_batched_tokens=10), FakeMem()
    sched.add(make_seq("dec", [5, 6, 7]))
    step(sched, mem)  # now decoding: one token a step
    for i, n in enumerate((6, 6, 6)):
        sched.add(make_seq(f"p{i}", range(100, 100 + n), arrival=1 + i))
    plan = sched.plan()
    assert ids(rows(plan)) == ["dec", "p0", "p1"]  # 1 + 6 + 3 = 10: p2 gets nothing
    # a new entry sends its whole prompt, capped by what is left of the budget
    assert [e.max_new_tokens for e in rows(plan)[1:]] == [9, 3]
    assert rows(plan)[2].token_ids == list(range(100, 106))
    batch, _ = sched.on_reserved(mem.reserve(plan))
    assert sum(len(s.token_ids) for s in steps(batch)) == 10
    assert [s.sample for s in steps(batch)] == [True, True, False]  # p1's chunk ends short


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    sched, mem = make_sched(max_num_batched_tokens=10), FakeMem()
    prompt = list(range(100, 125))  # 25 tokens: chunks of 10, 10, 5
    sched.add(make_seq("a", prompt))
    chunks = []
    for _ in range(3):
        plan, batch, updates = step(sched, mem)
        (s,) = steps(batch)
        chunks.append((s.start_pos, s.token_ids, s.sample))
        assert s.seq is sched.seqs["a"] and s.new_blocks == mem.tables["a"][s.table_start:]
    assert chunks == [(0, prompt[:10], False), (10, prompt[10:20], False), (20, prompt[20:], True)]
    seq = sched.seqs["a"]
    assert seq.num_computed == 25 and seq.output_token_ids == [50]
    assert len(mem.tables["a"]) == 7  # ceil(25 / 4)


def test_without_chunked_prefill_a_prompt_larger_than_the_budget_waits():
    sched = make_sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add(make_seq("big", range(100, 109)))  # 9 tokens > 8
    assert rows(sched.plan()) == []
    assert [s.seq_id for s in sched.waiting] == ["big"]

    fits = make_sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    fits.add(make_seq("a", range(100, 108)))  # exactly the budget
    fits.add(make_seq("b", range(200, 202), arrival=1.0))  # nothing left for it
    plan = fits.plan()
    assert ids(rows(plan)) == ["a"] and rows(plan)[0].token_ids == list(range(100, 108))

    chunked = make_sched(max_num_batched_tokens=8)
    chunked.add(make_seq("big", range(100, 109)))
    (entry,) = rows(chunked.plan())
    assert entry.max_new_tokens == 8  # with chunking: admitted, its first chunk capped


# -- on_reserved ---------------------------------------------------------------------


def test_a_granted_new_sequence_runs_from_its_cached_prefix():
    sched = make_sched()
    prompt = list(range(100, 110))  # 10 tokens, 4 of them in the prefix cache
    sched.add(make_seq("a", prompt))
    sched.plan()
    batch, rejected = sched.on_reserved(answer(
        [Grant("a", 4, 6, 0, [7, 3, 9], num_cached_tokens=4)], pool_epoch="e1"))
    seq = sched.seqs["a"]
    assert rejected == [] and batch.pool_epoch == "e1"
    assert seq.status is SeqStatus.RUNNING and sched.running == [seq] and sched.waiting == []
    assert seq.num_computed == 4 and seq.num_cached_tokens == 4
    (s,) = steps(batch)
    assert (s.seq_id, s.token_ids, s.start_pos, s.sample) == ("a", prompt[4:], 4, True)
    assert (s.table_start, s.new_blocks) == (0, [7, 3, 9]) and s.seq is seq  # the whole table: new
    assert slots_of(s.new_blocks, 4, 10) == [12, 13, 14, 15, 36, 37]  # table[1] = 3, table[2] = 9
    sample(sched, batch, {"a": 61})
    assert seq.num_computed == 10 and seq.output_token_ids == [61]


def test_a_chunk_that_does_not_reach_the_end_of_the_prompt_does_not_sample():
    sched = make_sched()
    sched.add(make_seq("a", range(100, 110)))
    sched.plan()
    batch, _ = sched.on_reserved(answer([Grant("a", 0, 5, 0, [4, 8])]))
    (s,) = steps(batch)
    assert s.sample is False and s.token_ids == list(range(100, 105))
    assert (s.table_start, s.new_blocks) == (0, [4, 8])
    assert sched.on_sampled(batch, []) == []  # nothing sampled: no update
    seq = sched.seqs["a"]
    assert seq.num_computed == 5 and seq.output_token_ids == []
    (entry,) = rows(sched.plan())  # the rest of the prompt, as a running sequence
    assert entry.new is False and entry.token_ids == list(range(105, 110))


def test_a_grants_table_change_goes_on_in_the_step_as_it_came():
    sched = make_sched()
    sched.add(make_seq("a", range(100, 112), max_tokens=10))  # 12 tokens: 3 full blocks
    sched.plan()
    batch, _ = sched.on_reserved(answer([Grant("a", 0, 12, 0, [7, 3, 9])]))
    sample(sched, batch, {"a": 60})
    seq = sched.seqs["a"]
    # position 12 opens a 4th block
    sched.plan()
    batch, _ = sched.on_reserved(answer([Grant("a", 12, 1, 3, [5])]))
    assert not hasattr(seq, "block_table")  # the gateway holds no table: memsvc and the executor do
    (s,) = steps(batch)
    assert s.token_ids == [60] and s.start_pos == 12 and (s.table_start, s.new_blocks) == (3, [5])
    sample(sched, batch, {"a": 61})
    # position 13, same block: no change
    sched.plan()
    batch, _ = sched.on_reserved(answer([Grant("a", 13, 1, 4, [])]))
    assert (steps(batch)[0].table_start, steps(batch)[0].new_blocks) == (4, [])
    sample(sched, batch, {"a": 62})
    # memsvc replaces the tail (a copy on write of block 3 onward)
    sched.plan()
    batch, _ = sched.on_reserved(answer([Grant("a", 14, 1, 3, [11])]))
    assert (steps(batch)[0].table_start, steps(batch)[0].new_blocks) == (3, [11])
    assert steps(batch)[0].token_ids == [62]


def test_a_waiting_answer_leaves_the_sequence_waiting_and_it_is_planned_again():
    sched = make_sched()
    sched.add(make_seq("a", [5, 6, 7]))
    sched.plan()
    batch, rejected = sched.on_reserved(answer([], waiting=["a"]))
    seq = sched.seqs["a"]
    assert steps(batch) == [] and rejected == []
    assert seq.status is SeqStatus.WAITING and sched.waiting == [seq] and sched.running == []
    assert seq.num_cached_tokens == -1  # never admitted
    (entry,) = rows(sched.plan())
    assert entry.seq_id == "a" and entry.new


def test_a_rejected_sequence_finishes_with_an_error():
    sched = make_sched()
    sched.add(make_seq("a", [5, 6, 7]))
    sched.add(make_seq("b", [5, 6, 8], arrival=1.0))
    sched.plan()
    batch, rejected = sched.on_reserved(answer(
        [Grant("b", 0, 3, 0, [1])], rejected=[Rejection("a", "needs 9 blocks, the pool has 8")]))
    (seq,) = rejected
    assert seq.seq_id == "a" and seq.status is SeqStatus.FINISHED
    assert seq.finish_reason == "error" and seq.error == "needs 9 blocks, the pool has 8"
    assert "a" not in sched.seqs and seq not in sched.waiting
    assert "a" not in sched.to_free  # memsvc never held it
    assert [s.seq_id for s in steps(batch)] == ["b"]
    assert ids(rows(sched.plan())) == ["b"]


# -- preemption ------------------------------------------------------------------------


def test_preemption_by_recompute_sends_the_sequence_back_to_waiting():
    sched, mem = running_pair()
    seq = sched.seqs["b"]
    assert mem.tables["b"] and seq.num_computed == 5
    sched.plan()
    batch, _ = sched.on_reserved(answer(
        [decode(sched, "a")], preempted=[Preemption("b", "recompute")]))
    assert [s.seq_id for s in steps(batch)] == ["a"]
    assert seq.status is SeqStatus.WAITING and sched.waiting == [seq]
    assert seq not in sched.running and seq not in sched.swapped
    assert seq.num_computed == 0 and seq.num_preemptions == 1
    assert seq.output_token_ids == [50]  # what it drew is kept
    assert "b" not in sched.to_free  # memsvc freed it itself
    sample(sched, batch)
    plan = sched.plan()
    entry = rows(plan)[1]
    assert entry.seq_id == "b" and entry.new  # recomputed: prompt and outputs again
    assert entry.token_ids == [*range(20, 25), 50]
    batch, _ = sched.on_reserved(answer(
        [decode(sched, "a"), Grant("b", 0, 6, 0, [300, 301])]))
    s = steps(batch)[1]
    assert (s.seq_id, s.start_pos, s.sample) == ("b", 0, True)
    assert (s.table_start, s.new_blocks) == (0, [300, 301])
    assert seq.status is SeqStatus.RUNNING


def test_preemption_by_swap_then_resumption():
    sched, mem = running_pair()
    seq = sched.seqs["b"]
    sched.plan()
    batch, _ = sched.on_reserved(answer(
        [decode(sched, "a")], preempted=[Preemption("b", "swap")]))
    assert seq.status is SeqStatus.SWAPPED and sched.swapped == [seq] and seq not in sched.running
    assert seq.num_computed == 5  # its cache is on the host: nothing to recompute
    assert seq.num_preemptions == 1
    assert not sched.can_plan_ahead()
    assert sched.plan(ahead_of=batch) is None
    sample(sched, batch)
    plan = sched.plan()
    assert ids(rows(plan)) == ["a", "b"]
    assert rows(plan)[1].new is False and rows(plan)[1].token_ids == [50]
    batch, _ = sched.on_reserved(answer(
        [decode(sched, "a"), Grant("b", 5, 1, 0, [200, 201])], resumed=["b"]))
    assert seq.status is SeqStatus.RUNNING and seq in sched.running and sched.swapped == []
    s = steps(batch)[1]
    assert (s.seq_id, s.token_ids, s.start_pos, s.sample) == ("b", [50], 5, True)
    assert (s.table_start, s.new_blocks) == (0, [200, 201])  # swapped in: a whole new table
    assert sched.can_plan_ahead()
