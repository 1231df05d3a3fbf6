"""The Scheduler alone: plans in, hand-made memsvc answers (ReserveResult) back, sampled
tokens applied. No memsvc, executor or model: `FakeMem` below grants every plan entry its
tokens from block ids it picks (or the test builds the answer itself), so each test can
check the plan the scheduler proposes, how it applies an answer (statuses, tables, the
batch's tokens and slots) and how it applies sampled tokens."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.gateway.scheduler import Scheduler
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.sequence import Sequence, SeqStatus
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from pagedserve.wire.reserve_messages import Grant, Grants, Plan, Preemption, Rejection, ReserveResult

BS = 4  # block size of every test
EOS = 2


def make_seq(seq_id, prompt, *, max_tokens=8, max_len=None, arrival=0.0, priority=0, index=0,
             request_id=None, **sampling):
    """A sequence as the BatchLoop makes one (max_len: prompt + max_tokens unless given)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return Sequence(seq_id, request_id or seq_id.split("/")[0], index, list(prompt), sp, seed=7,
                    max_len=len(prompt) + max_tokens if max_len is None else max_len,
                    arrival=arrival, priority=priority)


def make_sched(**config):
    return Scheduler(SchedulerConfig(**config), eos_token_ids=[EOS], block_size=BS)


def slots_of(table, start, end):
    return [table[p // BS] * BS + p % BS for p in range(start, end)]


class FakeMem:
    """Grants every entry of a plan all of its tokens (a new one: up to max_new_tokens after
    its cached prefix), with fresh block ids counting up from `first_block`; keeps each
    sequence's table and computed count as memsvc would, applies forks and frees."""

    def __init__(self, first_block=100):
        self.next_block = first_block
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.plans: list[Plan] = []
        self.forked: set[str] = set()  # children whose first grant carries their whole table

    def reserve(self, plan: Plan, cached: dict[str, int] | None = None) -> ReserveResult:
        self.plans.append(plan)
        for parent, child in plan.forks:
            self.tables[child] = list(self.tables[parent])
            self.computed[child] = self.computed[parent]
            self.forked.add(child)
        for seq_id in plan.free:
            self.tables.pop(seq_id, None)
            self.computed.pop(seq_id, None)
        grants = []
        for e in rows(plan):
            if e.new:
                start = (cached or {}).get(e.seq_id, 0)
                n = min(len(e.token_ids) - start, e.max_new_tokens)
                table = self.tables[e.seq_id] = []
            else:
                start, table = self.computed[e.seq_id], self.tables[e.seq_id]
                n = len(e.token_ids) + e.pending
            table_start = 0 if e.seq_id in self.forked else len(table)
            self.forked.discard(e.seq_id)
            need = -(-(start + n) // BS) - len(table)
            new_blocks = list(range(self.next_block, self.next_block + max(need, 0)))
            self.next_block += len(new_blocks)
            table.extend(new_blocks)
            self.computed[e.seq_id] = start + n
            grants.append(Grant(e.seq_id, start, n, table_start, table[table_start:], start if e.new else 0))
        return answer(grants)


def answer(grants=(), **kw) -> ReserveResult:
    """memsvc's answer granting `grants` (Grant rows, in columns)."""
    g = Grants()
    for x in grants:
        g.add(x.seq_id, x.start_pos, x.num_tokens, x.table_start, list(x.new_blocks), x.num_cached_tokens)
    return ReserveResult(g, **kw)


def rows(plan):
    """The plan's sequences one by one: running ones (`pending`: their tokens end with
    PENDING, left out of `token_ids`), then the new ones."""
    out, at = [], 0
    for seq_id, n in zip(plan.run_ids, plan.run_counts):
        tokens = plan.run_tokens[at:at + n]
        at += n
        pending = bool(tokens) and tokens[-1] == PENDING
        out.append(SimpleNamespace(seq_id=seq_id, token_ids=tokens[:-1] if pending else tokens, new=False,
                                   pending=pending))
    return out + [SimpleNamespace(seq_id=e.seq_id, token_ids=e.token_ids, new=True, pending=False,
                                  max_len=e.max_len, max_new_tokens=e.max_new_tokens) for e in plan.entries]


def steps(batch):
    """The step's sequences one by one."""
    out, at, bat = [], 0, 0
    for i, seq_id in enumerate(batch.seq_ids):
        n, k = batch.num_tokens[i], batch.num_new_blocks[i]
        out.append(SimpleNamespace(seq_id=seq_id, token_ids=batch.token_ids[at:at + n], start_pos=batch.start_pos[i],
                                   sample=batch.sample[i], table_start=batch.table_start[i],
                                   new_blocks=batch.new_blocks[bat:bat + k], seq=batch.seqs[i]))
        at, bat = at + n, bat + k
    return out


def sample(sched, batch, tokens=None, default=50):
    """Outputs for every step of `batch` that samples (token ids from `tokens` by seq id), applied."""
    tokens = tokens or {}
    outs = [SampleOutput(s.seq_id, tokens.get(s.seq_id, default), logprob=-0.5)
            for s in steps(batch) if s.sample]
    return sched.on_sampled(batch, outs)


def step(sched, mem, tokens=None, **kw):
    """One serial step: plan, reserve, apply, sample. Returns (plan, batch, updates)."""
    plan = sched.plan()
    batch, rejected = sched.on_reserved(mem.reserve(plan, **kw))
    assert rejected == []
    return plan, batch, sample(sched, batch, tokens)


def decode(sched, seq_id):
    """A grant of the next token of a running sequence in a block it already has (no table change)."""
    seq = sched.seqs[seq_id]
    return Grant(seq_id, seq.num_computed, 1, -(-(seq.num_computed + 1) // BS))


def ids(entries):
    return [e.seq_id for e in entries]


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


def running_pair():
    """`a` and `b` running: prompts of 5, one token each drawn (50), FakeMem tables."""
    sched, mem = make_sched(), FakeMem()
    sched.add(make_seq("a", range(10, 15)))
    sched.add(make_seq("b", range(20, 25), arrival=1.0))
    step(sched, mem)
    return sched, mem


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


def add_samples(sched, prompt, n=3):
    seqs = [make_seq(f"r/{i}", prompt, index=i, request_id="r") for i in range(n)]
    sched.add(seqs[0], seqs[1:])
    return seqs


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
