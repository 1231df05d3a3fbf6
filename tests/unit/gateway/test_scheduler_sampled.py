"""The Scheduler alone (tests/support/scheduler_fakes.py): sampled tokens applied (stops, lengths,
an aborted sequence's output) and n > 1 (held samples, forks)."""
from __future__ import annotations

from pagedserve.gateway.scheduler import Scheduler
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.sequence import SeqStatus
from pagedserve.wire.reserve_messages import Rejection
from tests.support.scheduler_fakes import (
    BS, EOS, FakeMem, add_samples, answer, ids, make_sched, make_seq, rows, running_pair,
    sample, step, steps)


# -- on_sampled ------------------------------------------------------------------------


def finish_run(seq, tokens, eos=(EOS,)):
    """Run `seq` alone with FakeMem, drawing `tokens` in turn; the updates of every step."""
    sched, mem = Scheduler(SchedulerConfig(), eos_token_ids=list(eos), block_size=BS), FakeMem()
    sched.add(seq)
    updates = []
    for t in tokens:
        if not sched.has_work() or seq.status is SeqStatus.FINISHED:
            break
        updates += step(sched, mem, {seq.seq_id: t})[2]
    return sched, updates


def test_sampled_tokens_are_appended_and_reported():
    sched, updates = finish_run(make_seq("a", [5, 6, 7]), [40, 41, 42])
    seq = sched.seqs["a"]
    assert seq.output_token_ids == [40, 41, 42] and seq.num_computed == 5
    assert [(u.seq.seq_id, u.token_id, u.logprob, u.finished) for u in updates] == [
        ("a", 40, -0.5, False), ("a", 41, -0.5, False), ("a", 42, -0.5, False)]


def test_eos_finishes_a_sequence_unless_ignore_eos():
    sched, updates = finish_run(make_seq("a", [5, 6, 7]), [40, EOS, 41])
    seq = updates[-1].seq
    assert [u.token_id for u in updates] == [40, EOS] and updates[-1].finished
    assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "stop"
    assert seq.output_token_ids == [40, EOS]
    assert "a" not in sched.seqs and sched.running == [] and sched.to_free == ["a"]
    assert sched.plan().free == ["a"] and sched.to_free == []
    assert not sched.has_work()

    sched, updates = finish_run(make_seq("a", [5, 6, 7], ignore_eos=True), [40, EOS, 41])
    assert [u.finished for u in updates] == [False, False, False]
    assert sched.seqs["a"].output_token_ids == [40, EOS, 41]


def test_a_stop_token_id_finishes_a_sequence():
    sched, updates = finish_run(make_seq("a", [5, 6, 7], stop_token_ids=[33]), [40, 33, 41])
    seq = updates[-1].seq
    assert [u.token_id for u in updates] == [40, 33] and updates[-1].finished
    assert seq.finish_reason == "stop" and sched.to_free == ["a"]
    # a stop token id is not the eos: ignore_eos does not skip it
    sched, updates = finish_run(make_seq("a", [5, 6, 7], stop_token_ids=[33], ignore_eos=True),
                                [33, 41])
    assert updates[-1].finished and updates[-1].seq.finish_reason == "stop"


def test_max_tokens_finishes_a_sequence_by_length():
    sched, updates = finish_run(make_seq("a", [5, 6, 7], max_tokens=3), [40, 41, 42, 43])
    seq = updates[-1].seq
    assert [u.finished for u in updates] == [False, False, True]
    assert seq.output_token_ids == [40, 41, 42] and seq.finish_reason == "length"
    assert sched.to_free == ["a"] and not sched.running


def test_max_len_finishes_a_sequence_by_length():
    # max_tokens 10, but the model's length caps the sequence at 5 tokens
    sched, updates = finish_run(make_seq("a", [5, 6, 7], max_tokens=10, max_len=5), [40, 41, 42])
    seq = updates[-1].seq
    assert [u.finished for u in updates] == [False, True]
    assert seq.num_tokens == 5 and seq.finish_reason == "length"


def test_output_of_a_sequence_aborted_while_its_step_ran_is_ignored():
    sched, mem = running_pair()
    plan = sched.plan()
    batch, _ = sched.on_reserved(mem.reserve(plan))
    seq = sched.abort("b")
    updates = sample(sched, batch, {"a": 60, "b": 61})
    assert [(u.seq.seq_id, u.token_id) for u in updates] == [("a", 60)]
    assert seq.output_token_ids == [50] and seq.finish_reason == "abort"
    assert sched.to_free == ["b"]


# -- n > 1 -------------------------------------------------------------------------------


def test_samples_are_held_until_the_parent_reaches_the_fork_point():
    sched, mem = make_sched(max_num_batched_tokens=3), FakeMem()
    prompt = list(range(100, 106))  # fork point: 5 (each sample computes the last token itself)
    parent, s1, s2 = add_samples(sched, prompt)
    assert list(sched.held) == ["r/0"] and sched.held["r/0"] == [s1, s2]
    assert set(sched.seqs) == {"r/0", "r/1", "r/2"} and sched.waiting == [parent]
    assert not sched.can_plan_ahead()
    plan, batch, updates = step(sched, mem)  # prompt[:3]
    assert ids(rows(plan)) == ["r/0"] and rows(plan)[0].token_ids == prompt[:5]
    assert updates == [] and sched.forks == [] and "r/0" in sched.held
    plan, batch, updates = step(sched, mem)  # prompt[3:5]: the fork point, nothing sampled
    assert steps(batch)[0].token_ids == prompt[3:5] and steps(batch)[0].sample is False
    assert updates == [] and sched.held == {}
    assert sched.forks == [("r/0", "r/1"), ("r/0", "r/2")]
    for s in (s1, s2):
        assert s.status is SeqStatus.RUNNING and s.num_computed == 5
    assert sched.running == [parent, s1, s2]
    assert not sched.can_plan_ahead()  # forks are due
    plan = sched.plan()
    assert plan.forks == [("r/0", "r/1"), ("r/0", "r/2")] and sched.forks == []
    assert sched.can_plan_ahead()
    # the budget (3) covers the last prompt token of each
    assert [(e.seq_id, e.token_ids, e.new) for e in rows(plan)] == [
        (f"r/{i}", [105], False) for i in range(3)]
    batch, _ = sched.on_reserved(mem.reserve(plan))
    assert [(s.start_pos, s.sample) for s in steps(batch)] == [(5, True)] * 3
    whole = mem.tables["r/0"]  # a forked sample's first step carries its whole table (memsvc's)
    assert [(s.table_start, s.new_blocks) for s in steps(batch)[1:]] == [(0, whole)] * 2
    updates = sample(sched, batch, {"r/0": 40, "r/1": 41, "r/2": 42})
    assert [(u.seq.index, u.token_id) for u in updates] == [(0, 40), (1, 41), (2, 42)]


def test_samples_of_a_one_token_prompt_wait_as_sequences_of_their_own():
    sched = make_sched()
    parent, s1, s2 = add_samples(sched, [9])
    assert sched.held == {} and sched.waiting == [parent, s1, s2]
    assert all(e.token_ids == [9] and e.new for e in rows(sched.plan()))


def test_aborting_the_parent_before_the_fork_finishes_its_held_samples():
    sched = make_sched()
    parent, s1, s2 = add_samples(sched, list(range(100, 106)))
    sched.abort_request("r")
    assert sched.held == {} and sched.seqs == {} and sched.waiting == []
    assert [s.finish_reason for s in (parent, s1, s2)] == ["abort"] * 3
    assert sched.to_free == [] and not sched.has_work()
    assert sched.can_plan_ahead()


def test_a_rejected_parent_takes_its_held_samples_with_it():
    sched = make_sched()
    _, s1, s2 = add_samples(sched, list(range(100, 106)))
    sched.plan()
    _, rejected = sched.on_reserved(answer([], rejected=[Rejection("r/0", "too long")]))
    assert [s.seq_id for s in rejected] == ["r/0"]
    assert [(s.finish_reason, s.error) for s in (s1, s2)] == [("error", "too long")] * 2
    assert sched.seqs == {} and sched.held == {}
    sched.abort_request("r")  # what the BatchLoop does with a rejected sequence's request
    assert sched.seqs == {}
    assert sched.held == {}
    assert sched.can_plan_ahead()


def test_an_aborted_held_sample_is_not_forked():
    sched, mem = make_sched(), FakeMem()
    parent, s1, s2 = add_samples(sched, list(range(100, 106)))
    assert sched.abort("r/2") is s2 and s2.finish_reason == "abort"
    step(sched, mem)  # the parent's prefill up to the fork point
    assert s2.status is SeqStatus.FINISHED
    assert sched.forks == [("r/0", "r/1")]
    assert [s.seq_id for s in sched.running] == ["r/0", "r/1"]
