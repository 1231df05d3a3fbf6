"""pagedserve.wire.step_feed: fed tokens filled from the last samples, steps run in their numbered
order; pagedserve.wire.ordered_executor running an in-process executor as the service runs one."""
import threading
import time

import pytest

from pagedserve.wire.ordered_executor import OrderedExecutor
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import (
    KVGeometry,
    SampleOutput,
    SamplingParams,
    SeqStep,
    StepBatch,
)
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_feed import FedTokenUnknown, LastSampled, StepOrder, lost_feed


def seq(seq_id, tokens, start, sample=True, output=()):
    return SeqStep(seq_id, list(tokens), start, [0] * len(tokens), [0], sample, SamplingParams(), 0,
                   [], list(output))


def test_fill_puts_the_last_sample_in_place_and_refuses_an_unknown_one_whole():
    feed = LastSampled()
    first = StepBatch([seq("a", [1, 2], 0), seq("b", [3], 0, sample=False), seq("c", [4], 0)])
    feed.record(first, [SampleOutput("a", 10), SampleOutput("c", 30)])
    ok = StepBatch([seq("a", [PENDING], 2, output=[PENDING]), seq("b", [5], 1), seq("c", [PENDING], 1)])
    assert feed.fill(ok) == [0, 2]
    assert ok.seqs[0].token_ids == [10] and ok.seqs[0].output_token_ids == [10]
    assert ok.seqs[2].token_ids == [30]
    # "a" sampled at position 2 only; "b" never sampled: the whole batch is refused unchanged
    bad = StepBatch([seq("a", [PENDING], 2), seq("b", [PENDING], 2)])
    with pytest.raises(FedTokenUnknown):
        feed.fill(bad)
    assert bad.seqs[0].token_ids == [PENDING]
    feed.record(StepBatch([], forget=["a"]), [])
    with pytest.raises(FedTokenUnknown):
        feed.fill(StepBatch([seq("a", [PENDING], 2)]))


def test_lost_feed_tells_a_missing_fed_token_from_other_failures():
    class RpcLike(Exception):
        def __init__(self, text):
            self.text = text

        def details(self):
            return self.text

    assert lost_feed(FedTokenUnknown("x"))
    assert lost_feed(RpcLike("fed token unknown: sequence 'a'"))
    assert lost_feed(RpcLike("executor state lost: sequence 'a' is unknown"))
    assert not lost_feed(RpcLike("batch rejected: bad slot"))
    assert not lost_feed(RuntimeError("crashed"))


def test_steps_pass_in_their_order_and_retries_or_unordered_ones_at_once():
    order = StepOrder(wait_s=5.0)
    seen = []

    def go(step):
        order.wait_turn(step)
        seen.append(step)
        order.passed(step)

    late = threading.Thread(target=go, args=(2,))
    late.start()
    time.sleep(0.05)
    assert seen == []  # step 2 waits for step 1
    go(1)
    late.join(5)
    assert seen == [1, 2]
    go(1)  # a retry
    go(0)  # unordered
    assert seen == [1, 2, 1, 0]
    joined = StepOrder(wait_s=5.0, joined=True)
    joined.wait_turn(57)  # the first step a restarted executor hears of goes at once


def test_ordered_executor_runs_steps_in_order_and_feeds_itself():
    ran = []

    class Info:
        kv = KVGeometry(1, 1, 1, 4)

    class Echo:
        def model_info(self):
            return Info()

        def execute(self, batch):
            ran.append((batch.step, [(s.token_ids[0], s.slot_mapping) for s in batch.seqs]))
            time.sleep(0.02)
            return [SampleOutput(s.seq_id, s.token_ids[0] + 1) for s in batch.seqs if s.sample]

    class Src:
        sampling, seed, prompt_token_ids, output_token_ids, block_table = SamplingParams(), 0, [6], [], [5]

    ex = OrderedExecutor(Echo())
    results = {}
    d1 = StepDelta(["a"], [3], [1], [7], [True], [0], [1], [5], [Src()], step=1)
    d2 = StepDelta(["a"], [4], [1], [PENDING], [True], [1], [1], [9], [Src()], step=2)
    t2 = threading.Thread(target=lambda: results.setdefault(2, ex.execute(d2)))
    t2.start()  # sent second, may start first: waits for step 1
    time.sleep(0.05)
    results[1] = ex.execute(d1)
    t2.join(5)
    assert ran == [(1, [(7, [23])]), (2, [(8, [36])])]  # slots from the held table: 5*4+3, 9*4+0
    assert results[2][0].token_id == 9
    assert d2.token_ids == [PENDING]  # the caller's step is left as it was
    ex.execute(StepDelta(forget=["a"], step=3))
    assert ex.held == {}
