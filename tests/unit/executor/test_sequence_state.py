"""The per-step delta: the gateway's encoder (wire.step_delta) and the executor's state
(executor.sequence_state) together give the model runner the same StepBatch as the full one."""
import pytest

from executor.sequence_state import SequenceStates, StateLost
from wire.protocol import SamplingParams, SeqStep, StepBatch
from wire.step_delta import STATE_LOST, commit, encode_step
from wire.v1 import executor_pb2

BS = 4
GREEDY = SamplingParams(temperature=0.0)
PENALTY = SamplingParams(repetition_penalty=1.3, seed=3)


def wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def step(seq_id, tokens, start, table, sample=True, sampling=GREEDY, seed=1, prompt=(), output=()):
    slots = [table[p // BS] * BS + p % BS for p in range(start, start + len(tokens))]
    return SeqStep(seq_id, list(tokens), start, slots, list(table), sample, sampling, seed,
                   list(prompt), list(output))


class Link:
    """The gateway's encoder and an executor's state, over serialized messages."""

    def __init__(self, states=None):
        self.sent: dict[str, list[int]] = {}
        self.states = states or SequenceStates(BS)
        self.incarnation = ""

    def run(self, batch):
        request, updates = encode_step(batch, self.sent, "s1", self.incarnation)
        request = wire(request)
        out = self.states.expand(request).batch
        commit(self.sent, batch, updates)
        self.incarnation = self.states.incarnation
        return out, request


def same(a: StepBatch, b: StepBatch):
    assert [vars(x) for x in a.seqs] == [vars(y) for y in b.seqs]


def test_state_once_then_changes_only():
    link = Link()
    prompt = [5, 6, 7, 8, 9, 10]
    b1 = StepBatch([step("a", prompt, 0, [3, 8]), step("b", [1, 2, 3], 0, [4], sample=False)],
                   pool_epoch="e")
    out, req = link.run(b1)
    same(out, b1)
    assert out.pool_epoch == "e" and len(req.states) == 2 and list(req.new_blocks) == [3, 8, 4]
    # a decodes within its block; b finishes its prompt into a new block
    b2 = StepBatch([step("a", [11], 6, [3, 8]), step("b", [4, 5], 3, [4, 9])])
    out, req = link.run(b2)
    same(out, b2)
    assert not req.states and list(req.table_start) == [2, 1] and list(req.new_blocks) == [9]
    # copy-on-write replaced a's last block: the whole table again, no state
    b3 = StepBatch([step("a", [12], 7, [3, 7])])
    out, req = link.run(b3)
    same(out, b3)
    assert not req.states and list(req.new_blocks) == [3, 7]


def test_forget_then_full_state_again():
    link = Link()
    link.run(StepBatch([step("a", [1, 2], 0, [1])]))
    b = StepBatch([step("a", [1, 2, 3], 0, [6])], forget=["a"])  # preempted, recomputed
    out, req = link.run(b)
    same(out, b)
    assert len(req.states) == 1
    assert out.forget == ["a"]  # the model runner hears it too (grammar matchers)


def test_penalties_history_follows_the_steps():
    link = Link()
    prompt = [5, 6, 7, 8, 9]
    b1 = StepBatch([step("p", prompt[4:], 4, [2, 3], sampling=PENALTY, prompt=prompt)])  # 4 cached
    same(link.run(b1)[0], b1)
    b2 = StepBatch([step("p", [42], 5, [2, 3], sampling=PENALTY, prompt=prompt, output=[42])])
    same(link.run(b2)[0], b2)
    b3 = StepBatch([step("p", [43], 6, [2, 3], sampling=PENALTY, prompt=prompt, output=[42, 43])])
    same(link.run(b3)[0], b3)


def test_a_restarted_executor_says_state_lost():
    link = Link()
    link.run(StepBatch([step("a", [1, 2], 0, [1])]))
    link.states = SequenceStates(BS)  # a new process
    with pytest.raises(StateLost, match=STATE_LOST):
        link.run(StepBatch([step("a", [3], 2, [1])]))
    link.incarnation = ""  # same process, sequence unknown
    with pytest.raises(StateLost, match=STATE_LOST):
        link.run(StepBatch([step("a", [3], 2, [1])]))
    link.sent.clear()
    b = StepBatch([step("a", [3], 2, [1])])
    same(link.run(b)[0], b)


def test_a_failed_request_can_be_encoded_again():
    link = Link()
    link.run(StepBatch([step("a", [1, 2], 0, [1])]))
    b = StepBatch([step("a", [3, 4, 5], 2, [1, 2])])
    request, _ = encode_step(b, link.sent, "s1", link.incarnation)  # lost on the way
    same(link.run(b)[0], b)
    same(link.states.expand(wire(request)).batch, b)  # and a re-run of the same one is the same


def test_sessions_are_separate_and_bad_changes_refused():
    states = SequenceStates(BS)
    a, b = Link(states), Link(states)
    a.run(StepBatch([step("x", [1], 0, [1])]))
    request, _ = encode_step(StepBatch([step("x", [2], 1, [1])]), {"x": [1]}, "s2", "")
    with pytest.raises(StateLost):
        states.expand(wire(request))
    bad = executor_pb2.ExecuteRequest(session_id="s1", seq_ids=["x"], start_pos=[1], num_tokens=[1],
                                      token_ids=[2], sample=[True], table_start=[5],
                                      num_new_blocks=[0])
    with pytest.raises(ValueError):
        states.expand(bad)
    del b


def test_prompt_logprobs_send_the_whole_prompt_once_and_every_chunk_sees_it():
    link = Link()
    sp = SamplingParams(temperature=0.0, prompt_logprobs=2)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    b1 = StepBatch([step("a", prompt[:3], 0, [3], sample=False, sampling=sp, prompt=prompt),
                    step("b", [1, 2], 0, [4])])
    out, req = link.run(b1)
    same(out, b1)
    assert list(req.states[0].prompt) == prompt and not req.states[1].prompt
    assert list(out.seqs[0].prompt_logprob_positions()) == [0, 1, 2]
    b2 = StepBatch([step("a", prompt[3:], 3, [3, 8], sampling=sp, prompt=prompt)])
    out, req = link.run(b2)
    same(out, b2)
    assert not req.states and list(out.seqs[0].prompt_logprob_positions()) == [3, 4, 5]


def test_a_fed_token_is_the_executors_own_last_sample_penalty_history_included():
    from wire.protocol import SampleOutput
    from wire.step_feed import FED, FedTokenUnknown

    link = Link()
    prompt = [5, 6, 7]
    b1 = StepBatch([step("p", prompt, 0, [2], sampling=PENALTY, prompt=prompt)])
    request, updates = encode_step(b1, link.sent, "s1", "")
    first = link.states.expand(wire(request))
    commit(link.sent, b1, updates)
    link.states.fill(first)
    link.states.record(first, [SampleOutput("p", 42)])
    # step 2 names its token as the executor's own: it does not travel
    b2 = StepBatch([step("p", [FED], 3, [2], sampling=PENALTY, prompt=prompt, output=[FED])], step=2)
    request, updates = encode_step(b2, link.sent, "s1", "")
    request = wire(request)
    assert list(request.fed) == [True] and list(request.token_ids) == [] and request.step == 2
    second = link.states.expand(request)
    commit(link.sent, b2, updates)
    assert second.batch.seqs[0].token_ids == [FED]
    link.states.fill(second)
    s = second.batch.seqs[0]
    assert s.token_ids == [42] and s.output_token_ids == [42] and s.prompt_token_ids == prompt
    link.states.record(second, [SampleOutput("p", 43)])
    # the history holds the filled token: a later step with its tokens sees it
    b3 = StepBatch([step("p", [43], 4, [2, 3], sampling=PENALTY, prompt=prompt, output=[42, 43])])
    out, _ = link.run(b3)
    same(out, b3)
    # a fed token at a position the executor holds no sample for: nothing changes
    b4 = StepBatch([step("p", [FED], 9, [2, 3, 4], sampling=PENALTY, prompt=prompt, output=[FED])])
    request, _ = encode_step(b4, link.sent, "s1", "")
    bad = link.states.expand(wire(request))
    with pytest.raises(FedTokenUnknown, match="position 9"):
        link.states.fill(bad)
    assert bad.batch.seqs[0].token_ids == [FED]
