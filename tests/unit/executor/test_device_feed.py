"""Two steps in flight (pagedserve.executor.readback, pagedserve.wire.pending_outputs): a
step's sampled tokens may still be on the device when the next step is filled, which then
reads its fed tokens there (StepBatch.device_feed). On the CPU `held_readback` keeps a pass's
outputs pending until asked, as a GPU's are, so the GPU's order of calls runs here: its
tokens and logprobs equal those of steps run one at a time, and the host waits for the
device only where it needs the tokens (histories, rows left out)."""
import numpy as np
import pytest
import torch

from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.step.running_set import RunningSet
from pagedserve.wire.pending_outputs import PendingOutputs
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.step_outputs import StepOutputs
from tests.support.tiny_models import make_tiny_model

BS = 4
GREEDY = SamplingParams(temperature=0.0)
DRAWN = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, logprobs=3)
PENALTY = SamplingParams(temperature=0.0, repetition_penalty=1.3)
PROMPTS = {"a": [5, 17, 42, 8, 99, 23], "b": [7, 3, 250, 11], "c": list(range(40, 49))}
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    make_tiny_model(path, "llama3")
    return load_model(str(path))


def run(model, samplings: dict, pipelined: bool):
    """The prompts, then DECODE_STEPS decode steps; pipelined: each step filled and launched
    before the one before is read. Returns (outputs per step, device-fed rows per step)."""
    model, config = model
    pool = torch.zeros(64, config.num_layers, 2, BS, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, config, pool)
    runner.held_readback = pipelined
    rs = RunningSet(BS)
    width = -(-(max(map(len, PROMPTS.values())) + DECODE_STEPS) // BS)
    tables = {s: list(range(k * width, (k + 1) * width)) for k, s in enumerate(PROMPTS)}
    for s, prompt in PROMPTS.items():
        rs.admit(s, samplings[s], seed=11, prompt_len=len(prompt), history=[], prompt=prompt)
    ids = list(PROMPTS)
    starts = [0] * len(ids)
    launched, fed = [], []
    for k in range(DECODE_STEPS + 1):
        if k == 0:
            step = rs.apply(ids, starts, [len(PROMPTS[s]) for s in ids], [t for s in ids for t in PROMPTS[s]],
                            None, [True] * len(ids), [0] * len(ids), [width] * len(ids),
                            [b for s in ids for b in tables[s]])
        else:
            step = rs.apply_decode(ids, starts, [width] * len(ids), [0] * len(ids), [])
        rs.fill(step)
        feed = step.batch.device_feed
        fed.append([] if feed is None else sorted(feed[1].tolist()))
        out = runner.launch(step.batch)
        assert isinstance(out, PendingOutputs) == pipelined
        rs.record(step, out)
        launched.append(out)
        starts = [s + int(n) for s, n in zip(starts, step.batch.num_tokens)]
    return [o.result() if isinstance(o, PendingOutputs) else o for o in launched], fed


def same(a: list[StepOutputs], b: list[StepOutputs]):
    assert [list(o) for o in a] == [list(o) for o in b]  # tokens, logprobs: the same computation


def test_fed_tokens_read_on_the_device_give_the_tokens_of_steps_run_one_at_a_time(model):
    samplings = {"a": GREEDY, "b": DRAWN, "c": GREEDY}
    serial, fed_serial = run(model, samplings, pipelined=False)
    piped, fed = run(model, samplings, pipelined=True)
    same(piped, serial)
    assert all(not f for f in fed_serial)
    assert fed == [[]] + [[0, 1, 2]] * DECODE_STEPS  # every decode step read all three on the device
    assert any(1 in o.more for o in piped)  # b's logprobs came through the readback


def test_a_row_that_needs_its_history_makes_the_host_wait_and_nothing_else_changes(model):
    samplings = {"a": GREEDY, "b": PENALTY, "c": DRAWN}
    serial, _ = run(model, samplings, pipelined=False)
    piped, fed = run(model, samplings, pipelined=True)
    same(piped, serial)
    assert all(not f for f in fed)  # the penalty row's history needs the host's tokens: settled first


class Source:
    def __init__(self, tokens):
        self.tokens, self.finished = torch.tensor(tokens), False

    def done(self):
        return self.finished

    def wait(self):
        pass

    def outputs(self):
        return StepOutputs([f"s{k}" for k in range(len(self.tokens))], self.tokens.tolist())


def test_a_row_given_to_another_sequence_is_not_fed_from_the_last_pass():
    rs = RunningSet(BS)
    for s in ("a", "b"):
        rs.admit(s, GREEDY, 0)
    first = rs.apply(["a", "b"], [0, 0], [2, 2], [1, 2, 3, 4], None, [True, True], [0, 0], [1, 1], [0, 1])
    rs.fill(first)
    rs.record(first, PendingOutputs(Source([7, 9]), 0, 2))
    assert rs.last_pos[[rs.row_of["a"], rs.row_of["b"]]].tolist() == [2, 2]
    rs.forget(["b"])
    rs.admit("c", GREEDY, 0)  # takes b's row: its last sample is not c's
    second = rs.apply(["a", "c"], [2, 0], [1, 3], [5, 6, 7], [True, False], [True, True], [1, 0], [0, 1], [2])
    rs.fill(second)
    tokens, at, src = second.batch.device_feed
    assert at.tolist() == [0] and src.tolist() == [0] and second.batch.token_ids[1:].tolist() == [5, 6, 7]
    assert rs.last_token[rs.row_of["a"]] == 0  # not on the host yet
    rs.unsettled[0].source.finished = True
    third = rs.apply(["a"], [3], [1], [], [True], [True], [1], [0], [])
    rs.record(second, StepOutputs(["a", "c"], [8, 4]))  # settles the first pass's tokens, then keeps these
    rs.fill(third)
    assert third.batch.device_feed is None and third.batch.token_ids.tolist() == [8]
    assert rs.unsettled is None and (rs.feed_src == -1).all()


def test_a_merged_step_reads_each_callers_fed_tokens_at_its_place():
    from pagedserve.step.batch_parts import concat
    from pagedserve.step.whole_seqs import Seq, batch_of

    tokens = torch.tensor([3, 4, 5])
    x = batch_of([Seq("x", [1, 2], 0, [0])], BS)
    y = batch_of([Seq("y", [1], 4, [1, 2])], BS)
    y.device_feed = (tokens, np.array([0]), np.array([2]))
    merged = concat([x, y])
    assert merged.device_feed[0] is tokens
    assert merged.device_feed[1].tolist() == [2] and merged.device_feed[2].tolist() == [2]
    x.device_feed = (torch.tensor([1]), np.array([1]), np.array([0]))
    with pytest.raises(ValueError, match="different passes"):
        concat([x, y])
