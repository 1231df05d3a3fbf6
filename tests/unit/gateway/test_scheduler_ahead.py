"""The Scheduler alone (tests/support/scheduler_fakes.py): planning ahead of the running step, and
aborts."""
from __future__ import annotations

import pytest

from pagedserve.gateway.sequence import SeqStatus
from pagedserve.wire.reserve_messages import Preemption
from tests.support.scheduler_fakes import (
    FakeMem, add_samples, answer, decode, ids, make_sched, make_seq, rows, sample, step,
    steps)


# -- plan ahead --------------------------------------------------------------------------


def test_plan_ahead_plans_as_if_the_running_batch_were_computed():
    sched, mem = make_sched(max_num_batched_tokens=6), FakeMem()
    sched.add(make_seq("dec", [5, 6, 7]))
    step(sched, mem, {"dec": 40})  # dec decodes from here on
    sched.add(make_seq("pre", range(100, 110), arrival=1.0))  # 10 tokens: chunks of 5 and 5
    plan0 = sched.plan()
    batch0, _ = sched.on_reserved(mem.reserve(plan0))
    assert [(s.seq_id, len(s.token_ids), s.sample) for s in steps(batch0)] == [
        ("dec", 1, True), ("pre", 5, False)]
    ahead = sched.plan(ahead_of=batch0)  # while batch0 "runs"
    assert ahead.ahead and list(ahead.fills) == [] and ahead.forks == []
    dec, pre = rows(ahead)
    # dec: its next token is the one batch0 samples (its id unknown yet)
    assert (dec.seq_id, dec.token_ids, dec.pending) == ("dec", [], True)
    # pre: the rest of its prompt, all known
    assert (pre.seq_id, pre.token_ids, pre.pending, pre.new) == ("pre", list(range(105, 110)), False, False)
    sample(sched, batch0, {"dec": 41})
    batch1, _ = sched.on_reserved(mem.reserve(ahead))
    s_dec, s_pre = steps(batch1)
    assert (s_dec.token_ids, s_dec.start_pos, s_dec.sample) == ([41], 4, True)
    assert (s_pre.token_ids, s_pre.start_pos, s_pre.sample) == (list(range(105, 110)), 5, True)
    # the id of the pending token travels with the next plan, once
    ahead2 = sched.plan(ahead_of=batch1)
    assert list(ahead2.fills) == [("dec", 4, 41)]
    assert [(e.seq_id, e.token_ids, e.pending) for e in rows(ahead2)] == [
        ("dec", [], True), ("pre", [], True)]
    sample(sched, batch1, {"dec": 42, "pre": 43})
    batch2, _ = sched.on_reserved(mem.reserve(ahead2))
    assert [(s.token_ids, s.start_pos) for s in steps(batch2)] == [([42], 5), ([43], 10)]
    sample(sched, batch2)
    plan3 = sched.plan()
    assert sorted(plan3.fills) == [("dec", 5, 42), ("pre", 10, 43)]
    assert [e.pending for e in rows(plan3)] == [False, False]  # not made ahead: all known
    assert list(sched.plan().fills) == []


def test_plan_ahead_skips_a_sequence_whose_next_token_is_its_last():
    sched, mem = make_sched(), FakeMem()
    sched.add(make_seq("short", [5, 6, 7], max_tokens=2))
    sched.add(make_seq("capped", [5, 6, 8], max_tokens=10, max_len=5, arrival=1.0))
    sched.add(make_seq("long", [5, 6, 9], max_tokens=10, arrival=2.0))
    step(sched, mem)  # one token each: the next of short and capped is their last
    batch, _ = sched.on_reserved(mem.reserve(sched.plan()))
    ahead = sched.plan(ahead_of=batch)
    assert ids(rows(ahead)) == ["long"] and rows(ahead)[0].pending
    updates = sample(sched, batch)
    assert [(u.seq.seq_id, u.finished) for u in updates] == [
        ("short", True), ("capped", True), ("long", False)]


def test_deferred_drops_the_pending_tokens():
    sched, mem = make_sched(), FakeMem()
    sched.add(make_seq("a", [5, 6, 7]))
    step(sched, mem)
    batch, _ = sched.on_reserved(mem.reserve(sched.plan()))
    ahead = sched.plan(ahead_of=batch)
    assert rows(ahead)[0].pending
    sched.deferred(ahead)  # memsvc did not grant it: it holds no pending token
    sample(sched, batch, {"a": 44})
    plan = sched.plan()
    assert list(plan.fills) == [] and not plan.ahead
    assert rows(plan)[0].token_ids == [44] and not rows(plan)[0].pending


def test_plan_ahead_is_refused_while_samples_are_held_or_forks_due():
    sched, mem = make_sched(), FakeMem()
    sched.add(make_seq("a", [5, 6, 7]))
    _, batch, _ = step(sched, mem)
    assert sched.can_plan_ahead()
    add_samples(sched, list(range(100, 106)))
    assert not sched.can_plan_ahead() and sched.plan(ahead_of=batch) is None
    _, batch, _ = step(sched, mem)  # r/0 reaches its fork point
    assert sched.held == {} and sched.forks
    assert not sched.can_plan_ahead() and sched.plan(ahead_of=batch) is None
    assert sched.forks  # a refused plan ahead does not take them
    assert sched.plan().forks and sched.can_plan_ahead()


def test_a_grant_made_ahead_for_a_sequence_gone_since_is_freed_not_run():
    sched, mem = make_sched(), FakeMem()
    sched.add(make_seq("a", [5, 6, 7]))
    sched.add(make_seq("b", [5, 6, 8], arrival=1.0))
    step(sched, mem)
    batch, _ = sched.on_reserved(mem.reserve(sched.plan()))
    ahead = sched.plan(ahead_of=batch)  # while batch runs
    assert ids(rows(ahead)) == ["a", "b"]
    old_b = sched.abort("b")  # e.g. a stop string, found while batch runs
    updates = sample(sched, batch)
    assert [u.seq.seq_id for u in updates] == ["a"]
    sched.add(make_seq("b", [1, 1, 1], arrival=2.0))  # the id comes back, a new request
    batch1, _ = sched.on_reserved(mem.reserve(ahead))
    assert [s.seq_id for s in steps(batch1)] == ["a"]
    new_b = sched.seqs["b"]
    assert new_b is not old_b and new_b.status is SeqStatus.WAITING
    assert new_b in sched.waiting and new_b not in sched.running
    assert sched.to_free == ["b"]  # the old b, once (its grant made ahead is freed with it)
    assert old_b.output_token_ids == [50]


def test_the_output_of_an_aborted_sequence_does_not_reach_a_new_one_of_the_same_id():
    sched, mem = make_sched(), FakeMem()
    sched.add(make_seq("b", [5, 6, 8]))
    batch, _ = sched.on_reserved(mem.reserve(sched.plan()))
    sched.abort("b")
    sched.add(make_seq("b", [1, 1, 1, 1, 1]))
    sample(sched, batch, {"b": 60})
    new_b = sched.seqs["b"]
    assert new_b.output_token_ids == [] and new_b.num_computed == 0


# -- abort ---------------------------------------------------------------------------------


def test_abort_takes_a_sequence_out_of_every_queue():
    sched, mem = make_sched(), FakeMem()
    for i, name in enumerate(("run", "swp")):
        sched.add(make_seq(name, [5, 6, 7 + i], arrival=i))
    step(sched, mem)
    sched.plan()
    sched.on_reserved(answer([decode(sched, "run")], preempted=[Preemption("swp", "swap")]))
    sched.add(make_seq("wait", [5, 6, 9], arrival=5.0))
    seqs = {name: sched.seqs[name] for name in ("run", "swp", "wait")}
    for name in ("run", "swp", "wait"):
        assert sched.abort(name) is seqs[name]
        assert seqs[name].status is SeqStatus.FINISHED and seqs[name].finish_reason == "abort"
        assert name not in sched.seqs
    assert sched.waiting == [] and sched.running == [] and sched.swapped == []
    assert sched.to_free == ["run", "swp"]  # memsvc held those two; the waiting one it never saw
    assert sched.abort("run") is None and sched.abort("nobody") is None
    assert sched.has_work()  # the frees still have to go out
    assert sched.plan().free == ["run", "swp"] and not sched.has_work()


def test_abort_request_aborts_all_of_a_requests_sequences_and_only_those():
    sched, mem = make_sched(max_num_batched_tokens=8), FakeMem()
    add_samples(sched, list(range(100, 106)))
    sched.add(make_seq("other", [5, 6, 7], arrival=1.0))
    step(sched, mem)  # r/0 reaches the fork point: r/1, r/2 running
    assert {s.seq_id for s in sched.running} == {"r/0", "r/1", "r/2", "other"}
    sched.abort_request("r", reason="cancelled")
    assert [s.seq_id for s in sched.running] == ["other"] and list(sched.seqs) == ["other"]
    assert sorted(sched.to_free) == ["r/0", "r/1", "r/2"]
    plan = sched.plan()
    assert ids(rows(plan)) == ["other"] and sorted(plan.free) == ["r/0", "r/1", "r/2"]
    sched.abort_request("nobody")  # unknown: nothing happens
    assert list(sched.seqs) == ["other"]


def test_abort_reason_and_release_idle_beams_without_beams():
    sched = make_sched()
    seq = make_seq("a", [5, 6, 7])
    sched.add(seq)
    with pytest.raises(ValueError):
        sched.add(make_seq("a", [1]))  # the id is taken
    sched.abort_request("a", reason="timeout")
    assert seq.finish_reason == "timeout"
    assert sched.release_idle_beams() is False and sched.to_free == []


def test_has_work():
    sched = make_sched()
    assert not sched.has_work()
    sched.add(make_seq("a", [5, 6, 7]))
    assert sched.has_work()
