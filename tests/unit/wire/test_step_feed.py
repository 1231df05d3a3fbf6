"""pagedserve.wire.step_feed: steps run in their numbered order, a lost feed told from other
failures; pagedserve.step.local_engine running an in-process executor as the service runs one
(its fills and records: tests/unit/step/test_running_set.py)."""
import threading
import time

import pytest

from pagedserve.step.local_engine import LocalEngine
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import KVGeometry, SampleOutput, SamplingParams
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_feed import FedTokenUnknown, StepOrder, lost_feed


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
    seen.clear()
    nxt = threading.Thread(target=lambda: (joined.wait_turn(58), seen.append(58)))
    nxt.start()
    time.sleep(0.05)
    assert seen == []  # and the order starts there: 58 waits for 57
    joined.passed(57)
    nxt.join(5)
    assert seen == [58]


def test_a_new_sessions_later_step_that_comes_first_waits_for_the_callers_first():
    joined, seen = StepOrder(wait_s=5.0, joined=True), []
    second = threading.Thread(target=lambda: (joined.wait_turn(2, first=1), seen.append(2)))
    second.start()
    time.sleep(0.05)
    assert seen == []
    joined.wait_turn(1, first=1)
    seen.append(1)
    joined.passed(1)
    second.join(5)
    assert seen == [1, 2]


def test_local_engine_runs_steps_in_order_and_feeds_itself():
    ran = []

    class Info:
        kv = KVGeometry(1, 1, 1, 4)

    class Echo:
        def model_info(self):
            return Info()

        def execute(self, batch):
            starts = batch.starts
            ran.append((batch.step, [(int(batch.token_ids[starts[i]]),
                                      batch.slot_mapping[starts[i]:starts[i + 1]].tolist())
                                     for i in range(batch.num_seqs)]))
            time.sleep(0.02)
            return [SampleOutput(batch.seq_ids[i], int(batch.token_ids[starts[i]]) + 1)
                    for i in batch.sample.nonzero()[0]]

    class Src:
        sampling, seed, prompt_token_ids, output_token_ids, block_table = SamplingParams(), 0, [6], [], [5]

    ex = LocalEngine(Echo())
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
    assert len(ex.running) == 0


def test_local_engine_takes_a_whole_table_from_memsvc_for_a_sequence_it_does_not_hold():
    class Info:
        kv = KVGeometry(1, 1, 1, 4)

    class Slots:
        def model_info(self):
            return Info()

        def execute(self, batch):
            return [SampleOutput(batch.seq_ids[0], int(batch.slot_mapping[0]))]

    class Src:
        sampling, seed, prompt_token_ids, output_token_ids = SamplingParams(), 0, [6, 7, 8, 9, 10], []

    step = StepDelta(["a"], [4], [1], [10], [True], [1], [1], [9], [Src()], step=1)  # a change from block 1 on
    with pytest.raises(ValueError, match="no `tables`"):
        LocalEngine(Slots()).execute(step)
    asked = []
    engine = LocalEngine(Slots(), tables=lambda ids: asked.append(ids) or [[5, 9]])
    assert engine.execute(step)[0].token_id == 9 * 4 + 0 and asked == [["a"]]
    with pytest.raises(ValueError, match="does not carry its state"):
        engine.execute(StepDelta(["b"], [0], [1], [1], [True], [0], [1], [2], [None], step=2))
