"""The step message: the gateway's delta (pagedserve.wire.step_delta) and the executor's state
(pagedserve.executor.sequence_state) together give the model runner the full StepBatch."""
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from pagedserve.executor.sequence_state import SequenceStates, StateLost
from pagedserve.step.step_batch import StepBatch
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.step_delta import STATE_LOST, StepDelta, encode_delta
from pagedserve.wire.v1 import executor_pb2

BS = 4
GREEDY = SamplingParams(temperature=0.0)
PENALTY = SamplingParams(repetition_penalty=1.3, seed=3)


def wire(msg):
    return type(msg).FromString(msg.SerializeToString())


@dataclass
class Src:
    """The gateway's sequence, as the step message reads it."""

    prompt_token_ids: list[int]
    block_table: list[int]  # memsvc's table of it (the gateway holds none): see `tables`
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    seed: int = 1
    output_token_ids: list[int] = field(default_factory=list)


def step(seq_id, tokens, start, table, sample=True, sampling=GREEDY, seed=1, prompt=(), output=()):
    """One sequence of the expected batch: its slots come from its table."""
    return Seq(seq_id, list(tokens), start, list(table), sample, sampling, seed, list(prompt), list(output))


def expected(*seqs: Seq) -> StepBatch:
    return batch_of(list(seqs), BS)


def delta(seq_id, tokens, start, table_start, new_blocks, src, sample=True):
    return seq_id, list(tokens), start, sample, table_start, list(new_blocks), src


def columns(deltas, **kw) -> StepDelta:
    """A step of `deltas` (one sequence each), in the message's columns."""
    step = StepDelta(**kw)
    for seq_id, tokens, start, sample, table_start, new_blocks, src in deltas:
        step.seq_ids.append(seq_id)
        step.start_pos.append(start)
        step.num_tokens.append(len(tokens))
        step.token_ids.extend(tokens)
        step.sample.append(sample)
        step.table_start.append(table_start)
        step.num_new_blocks.append(len(new_blocks))
        step.new_blocks.extend(new_blocks)
        step.seqs.append(src)
    return step


def tables(d: StepDelta):
    """memsvc's MemoryClient.tables over the step's sequences."""
    by_id = dict(zip(d.seq_ids, d.seqs))
    return lambda ids: [list(by_id[s].block_table) for s in ids]


class Link:
    """The gateway's encoder and an executor's state, over serialized messages."""

    def __init__(self, states=None):
        self.sent: set[str] = set()
        self.states = states or SequenceStates(BS)
        self.incarnation = ""

    def run(self, d):
        request = wire(encode_delta(d, self.sent, "s1", self.incarnation, tables(d)))
        out = self.states.expand(request).batch
        self.incarnation = self.states.incarnation
        return out, request


COLUMNS = ("start_pos", "num_tokens", "token_ids", "sample", "slot_mapping", "table_lens", "flags",
           "temperature", "top_k", "top_p", "min_p")


def rows(b: StepBatch) -> list[tuple]:
    """Each sequence of the batch as one tuple: id, tokens, slots, table, sampling, seed,
    prompt and output as the sampler reads them, and why it is left out."""
    starts = b.starts
    return [(b.seq_ids[i], int(b.start_pos[i]), b.token_ids[starts[i]:starts[i + 1]].tolist(),
             b.slot_mapping[starts[i]:starts[i + 1]].tolist(), b.block_tables[i, :b.table_lens[i]].tolist(),
             bool(b.sample[i]), b.held[i].sampling, b.held[i].seed, b.prompt_of(i), b.output_of(i),
             b.errors.get(i, "")) for i in range(b.num_seqs)]


def same(a: StepBatch, b: StepBatch):
    assert rows(a) == rows(b)
    for name in COLUMNS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert getattr(a, name).dtype == getattr(b, name).dtype, name


def test_state_once_then_changes_only():
    link = Link()
    prompt = [5, 6, 7, 8, 9, 10]
    a, b = Src(prompt, [3, 8]), Src([1, 2, 3, 4, 5], [4])
    out, req = link.run(columns([delta("a", prompt, 0, 0, [3, 8], a),
                                   delta("b", [1, 2, 3], 0, 0, [4], b, sample=False)], pool_epoch="e"))
    same(out, expected(step("a", prompt, 0, [3, 8]), step("b", [1, 2, 3], 0, [4], sample=False)))
    assert out.pool_epoch == "e" and len(req.states) == 2 and list(req.new_blocks) == [3, 8, 4]
    # a decodes within its block; b finishes its prompt into a new block
    out, req = link.run(columns([delta("a", [11], 6, 2, [], a), delta("b", [4, 5], 3, 1, [9], b)]))
    same(out, expected(step("a", [11], 6, [3, 8]), step("b", [4, 5], 3, [4, 9])))
    assert not req.states and list(req.table_start) == [2, 1] and list(req.new_blocks) == [9]
    # copy-on-write replaced a's last block: from index 1 on, no state
    out, req = link.run(columns([delta("a", [12], 7, 1, [7], a)]))
    same(out, expected(step("a", [12], 7, [3, 7])))
    assert not req.states and list(req.table_start) == [1] and list(req.new_blocks) == [7]


def test_forget_then_full_state_again():
    link = Link()
    a = Src([1, 2, 3], [1])
    link.run(columns([delta("a", [1, 2], 0, 0, [1], a)]))
    a.block_table = [6]  # preempted, recomputed
    out, req = link.run(columns([delta("a", [1, 2, 3], 0, 0, [6], a)], forget=["a"]))
    same(out, expected(step("a", [1, 2, 3], 0, [6])))
    assert len(req.states) == 1
    assert out.forget == ["a"]  # the model runner hears it too (grammar matchers)


def test_penalties_history_follows_the_steps():
    link = Link()
    prompt = [5, 6, 7, 8, 9]
    p = Src(prompt, [2, 3], sampling=PENALTY)
    out, req = link.run(columns([delta("p", prompt[4:], 4, 0, [2, 3], p)]))  # 4 cached
    assert list(req.states[0].history) == prompt[:4]
    same(out, expected(step("p", prompt[4:], 4, [2, 3], sampling=PENALTY, prompt=prompt)))
    p.output_token_ids.append(42)
    out, _ = link.run(columns([delta("p", [42], 5, 2, [], p)]))
    same(out, expected(step("p", [42], 5, [2, 3], sampling=PENALTY, prompt=prompt, output=[42])))
    p.output_token_ids.append(43)
    out, _ = link.run(columns([delta("p", [43], 6, 2, [], p)]))
    same(out, expected(step("p", [43], 6, [2, 3], sampling=PENALTY, prompt=prompt, output=[42, 43])))


def test_a_restarted_executor_says_state_lost_and_gets_the_whole_table_again():
    link = Link()
    a = Src([1, 2, 3], [1])
    link.run(columns([delta("a", [1, 2], 0, 0, [1], a)]))
    link.states = SequenceStates(BS)  # a new process
    with pytest.raises(StateLost, match=STATE_LOST):
        link.run(columns([delta("a", [3], 2, 1, [], a)]))
    link.incarnation = ""  # same process, sequence unknown
    with pytest.raises(StateLost, match=STATE_LOST):
        link.run(columns([delta("a", [3], 2, 1, [], a)]))
    link.sent.clear()
    out, req = link.run(columns([delta("a", [3], 2, 1, [], a)]))
    same(out, expected(step("a", [3], 2, [1])))
    assert len(req.states) == 1 and list(req.table_start) == [0] and list(req.new_blocks) == [1]


def test_a_request_lost_on_the_way_can_run_again():
    link = Link()
    a = Src([1, 2, 3, 4, 5], [1, 2])
    link.run(columns([delta("a", [1, 2], 0, 0, [1], a)]))
    d = columns([delta("a", [3, 4, 5], 2, 1, [2], a)])
    request = encode_delta(d, link.sent, "s1", link.incarnation)  # lost on the way
    want = expected(step("a", [3, 4, 5], 2, [1, 2]))
    same(link.run(d)[0], want)
    same(link.states.expand(wire(request)).batch, want)  # and a re-run of the same one is the same


def test_a_new_sessions_two_steps_in_flight_run_in_their_order_whichever_comes_first():
    """The gateway sends step 2 before step 1 is answered: each must see the table the one
    before it left, also when step 2 arrives first (it once ran at once, beside step 1's
    admission: 'block table change at 2, but it holds 0 blocks')."""
    states, sent = SequenceStates(BS), set()
    a = Src([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3])
    first = wire(encode_delta(columns([delta("a", [1, 2, 3, 4, 5, 6, 7, 8], 0, 0, [1, 2], a)], step=1),
                              sent, "s1", ""))
    second = wire(encode_delta(columns([delta("a", [9], 8, 2, [3], a)], step=2), sent, "s1", ""))
    first.first_step = second.first_step = 1
    order = states.order("s1")
    order.wait_s = 30.0
    batches = {}

    def run(request):
        order.wait_turn(request.step, request.first_step)
        try:
            batches[request.step] = states.expand(request).batch
        finally:
            order.passed(request.step)

    late = threading.Thread(target=run, args=(second,))
    late.start()
    time.sleep(0.05)
    assert not batches  # step 2 waits for step 1
    run(first)
    late.join(30)
    same(batches[1], expected(step("a", [1, 2, 3, 4, 5, 6, 7, 8], 0, [1, 2])))
    same(batches[2], expected(step("a", [9], 8, [1, 2, 3])))


def test_sessions_are_separate_and_bad_changes_refused():
    states = SequenceStates(BS)
    a = Link(states)
    x = Src([1, 2], [1])
    a.run(columns([delta("x", [1], 0, 0, [1], x)]))
    request = encode_delta(columns([delta("x", [2], 1, 1, [], x)]), {"x"}, "s2", "")
    with pytest.raises(StateLost):
        states.expand(wire(request))
    bad = executor_pb2.ExecuteRequest(session_id="s1", seq_ids=["x"], start_pos=[1], num_tokens=[1],
                                      token_ids=[2], sample=[True], table_start=[5],
                                      num_new_blocks=[0])
    with pytest.raises(ValueError):
        states.expand(bad)


def test_prompt_logprobs_send_the_whole_prompt_once_and_every_chunk_sees_it():
    link = Link()
    sp = SamplingParams(temperature=0.0, prompt_logprobs=2)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    a, b = Src(prompt, [3, 8], sampling=sp), Src([1, 2], [4])
    out, req = link.run(columns([delta("a", prompt[:3], 0, 0, [3], a, sample=False),
                                   delta("b", [1, 2], 0, 0, [4], b)]))
    same(out, expected(step("a", prompt[:3], 0, [3], sample=False, sampling=sp, prompt=prompt),
                         step("b", [1, 2], 0, [4])))
    assert list(req.states[0].prompt) == prompt and not req.states[1].prompt
    assert list(out.prompt_logprob_positions(0)) == [0, 1, 2] and out.reports().tolist() == [True, True]
    out, req = link.run(columns([delta("a", prompt[3:], 3, 1, [8], a)]))
    same(out, expected(step("a", prompt[3:], 3, [3, 8], sampling=sp, prompt=prompt)))
    assert not req.states and list(out.prompt_logprob_positions(0)) == [3, 4, 5]


def test_a_fed_token_is_the_executors_own_last_sample_penalty_history_included():
    from pagedserve.wire.pending_token import PENDING
    from pagedserve.wire.protocol import SampleOutput
    from pagedserve.wire.step_feed import FedTokenUnknown

    link = Link()
    prompt = [5, 6, 7]
    p = Src(prompt, [2, 3, 4], sampling=PENALTY)
    first = link.states.expand(wire(encode_delta(columns([delta("p", prompt, 0, 0, [2], p)]),
                                                 link.sent, "s1", "")))
    link.states.fill(first)
    link.states.record(first, [SampleOutput("p", 42)])
    # step 2 names its token as the executor's own: it does not travel
    request = wire(encode_delta(columns([delta("p", [PENDING], 3, 1, [], p)], step=2), link.sent, "s1", ""))
    assert request.decode and list(request.token_ids) == [] and request.step == 2
    assert list(request.fed) == list(request.num_tokens) == list(request.sample) == []  # said by `decode`
    second = link.states.expand(request)
    assert second.batch.tokens_of(0).tolist() == [PENDING]
    link.states.fill(second)
    b = second.batch
    assert b.tokens_of(0).tolist() == [42] and b.output_of(0) == [42] and b.prompt_of(0) == prompt
    link.states.record(second, [SampleOutput("p", 43)])
    # the history holds the filled token: a later step with its tokens sees it
    out, _ = link.run(columns([delta("p", [43], 4, 1, [3], p)]))
    same(out, expected(step("p", [43], 4, [2, 3], sampling=PENALTY, prompt=prompt, output=[42, 43])))
    # a fed token at a position the executor holds no sample for: nothing changes
    request = encode_delta(columns([delta("p", [PENDING], 9, 2, [4], p)]), link.sent, "s1", "")
    bad = link.states.expand(wire(request))
    with pytest.raises(FedTokenUnknown, match="position 9"):
        link.states.fill(bad)
    assert bad.batch.tokens_of(0).tolist() == [PENDING]


def test_fed_and_known_tokens_go_in_one_set_of_columns():
    from pagedserve.wire.pending_token import PENDING
    srcs = [Src([4, 5], [30])] + [Src([1, 2, 3], [i, 10 + i]) for i in range(3)]
    step_ = columns([delta("p", [4, 5], 0, 0, [30], srcs[0]), delta("a", [PENDING], 5, 1, [], srcs[1]),
                     delta("b", [PENDING], 8, 2, [21], srcs[2]), delta("c", [PENDING], 4, 1, [], srcs[3])],
                    pool_epoch="e", step=3)
    request = encode_delta(step_, {"p", "a", "b", "c"}, "s1", "")
    assert list(request.fed) == [False, True, True, True] and list(request.token_ids) == [4, 5]
    assert list(request.new_blocks) == [30, 21] and not request.states
    request = encode_delta(step_, {"p", "b"}, "s1", "", tables(step_))  # a and c: state and whole table
    assert [s.seq_id for s in request.states] == ["a", "c"] and list(request.table_start) == [0, 0, 2, 0]
    assert list(request.new_blocks) == [30, 0, 10, 21, 2, 12]
    assert step_.sampled_ids() == ["p", "a", "b", "c"] and len(step_.token_ids) == 5
    assert step_.progress() == {"p": (2, True), "a": (6, True), "b": (9, True), "c": (5, True)}


def test_block_copies_go_with_their_step():
    """memsvc's copy-on-write copies for ranks that hold their own pools (pagedserve.memsvc.held_pools)
    reach the executor's StepBatch in order; mismatched columns are refused."""
    link = Link()
    a = Src([5, 6, 7, 8, 9, 10], [3, 8])
    out, req = link.run(columns([delta("a", [5, 6, 7, 8, 9, 10], 0, 0, [3, 8], a)], copies=[(8, 7), (2, 5)]))
    assert out.copies == [(8, 7), (2, 5)] and list(req.copy_src) == [8, 2]
    out, _ = link.run(columns([delta("a", [11], 6, 2, [], a)]))
    assert out.copies == []
    bad = encode_delta(columns([delta("a", [12], 7, 2, [], a)], copies=[(8, 7)]), link.sent, "s1",
                       link.incarnation)
    bad.copy_dst.append(1)
    with pytest.raises(ValueError, match="copy_src has 1 blocks, copy_dst 2"):
        link.states.expand(wire(bad))


def test_a_decode_step_in_one_flag_gives_what_its_columns_give():
    """A steady decode step travels as `decode` without its num_tokens, sample and fed columns;
    the executor makes the same batch as from those columns, and refuses the flag with them."""
    from pagedserve.wire.pending_token import PENDING
    from pagedserve.wire.protocol import SampleOutput

    srcs = {s: Src([1, 2, 3], [i, 10 + i], sampling=PENALTY if s == "b" else GREEDY)
            for i, s in enumerate("abc")}
    links = Link(), Link()
    for link in links:
        first = link.states.expand(wire(encode_delta(
            columns([delta(s, [1, 2, 3], 0, 0, [i], src) for i, (s, src) in enumerate(srcs.items())]),
            link.sent, "s1", "")))
        link.states.record(first, [SampleOutput(s, 40 + i) for i, s in enumerate(srcs)])
    d = columns([delta("c", [PENDING], 3, 1, [], srcs["c"]), delta("a", [PENDING], 3, 1, [12], srcs["a"]),
                 delta("b", [PENDING], 3, 0, [7, 8], srcs["b"])], step=2)
    flag = wire(encode_delta(d, links[0].sent, "s1", links[0].incarnation))
    assert flag.decode and not flag.num_tokens and not flag.sample and not flag.fed and not flag.token_ids
    cols = wire(flag)
    cols.decode = False
    cols.num_tokens[:], cols.sample[:], cols.fed[:] = [1] * 3, [True] * 3, [True] * 3
    batches = [link.states.expand(m) for link, m in zip(links, (flag, cols))]
    for link, b in zip(links, batches):
        link.states.fill(b)
    same(batches[0].batch, batches[1].batch)
    assert batches[0].batch.token_ids.tolist() == [42, 40, 41] and batches[0].applied.fed.tolist() == [0, 1, 2]
    bad = wire(flag)
    bad.sample[:] = [True] * 3
    with pytest.raises(ValueError, match="a decode step leaves num_tokens, token_ids, sample and fed empty"):
        links[0].states.expand(bad)
    # not every sequence samples, or one computes more than one token: the columns go
    assert not encode_delta(columns([delta("a", [PENDING], 4, 2, [], srcs["a"], sample=False)]),
                            links[0].sent, "s1", "").decode
    assert not encode_delta(columns([delta("a", [PENDING, PENDING], 4, 2, [], srcs["a"])]),
                            links[0].sent, "s1", "").decode
