"""pagedserve.executor.step_merger without processes: one pass at a time, outputs split back to each
caller, a failed pass fails its callers only, two gateways' steps share passes, and a device
that runs behind the host gets the next pass before the last one ends."""
import threading
import time

from pagedserve.executor import step_merger
from pagedserve.executor.step_merger import Launched, StepMerger, launch_of
from pagedserve.step.step_batch import StepBatch
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from pagedserve.wire.pending_outputs import PendingOutputs
from pagedserve.wire.step_outputs import StepOutputs

BS = 4


def step(seq_id, sample=True):
    return Seq(seq_id, [1], 0, [0], sample, SamplingParams(), 0)


def batch(*seqs: Seq, **fields) -> StepBatch:
    return batch_of(list(seqs), BS, **fields)


def sampled(batch: StepBatch) -> list[str]:
    return [batch.seq_ids[i] for i in batch.sample.nonzero()[0]]


def test_merger_runs_one_pass_at_a_time_and_splits_outputs_by_position():
    passes, running = [], []

    def execute(batch):
        assert not running, "two passes at once"
        running.append(1)
        time.sleep(0.05)
        passes.append(list(batch.seq_ids))
        running.pop()
        return [SampleOutput(s, i) for i, s in enumerate(batch.seq_ids) if batch.sample[i]]

    merger = StepMerger(launch_of(execute))
    results = {}

    def call(name, n):
        # the same seq ids from every caller (two gateways both say "0/0")
        mine = batch(step("0/0"), step("0/1", sample=False), *[step(f"x{i}") for i in range(n)])
        results[name] = merger.run(mine)[0]

    threads = [threading.Thread(target=call, args=(f"g{i}", i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(len(p) for p in passes) == sum(2 + i for i in range(4))
    assert len(passes) < 4  # calls that arrived during a pass were merged
    for i in range(4):
        assert len(results[f"g{i}"]) == 1 + i
        assert results[f"g{i}"][0].seq_id == "0/0"


def test_merger_fails_every_call_of_a_failed_pass_and_goes_on():
    calls = []

    def execute(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise ValueError("bad slot")
        return [SampleOutput(s, 0) for s in batch.seq_ids]

    merger = StepMerger(launch_of(execute))
    try:
        merger.run(batch(step("a")))
        raise AssertionError("no error")
    except ValueError:
        pass
    assert merger.run(batch(step("b")))[0][0].seq_id == "b"


def test_merger_waits_briefly_for_an_active_caller_so_two_gateways_share_passes():
    sizes = []

    def execute(batch):
        time.sleep(0.02)
        sizes.append(batch.num_seqs)
        return [SampleOutput(s, 0) for s in batch.seq_ids]

    merger = StepMerger(launch_of(execute), window=1.0, max_wait_s=0.05)

    def gateway(name):  # steps in turn: each waits for its answer, then plans for 2 ms
        for _ in range(10):
            assert len(merger.run(batch(step(name)), caller=name)[0]) == 1
            time.sleep(0.002)

    threads = [threading.Thread(target=gateway, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(sizes) == 20 and sizes.count(2) >= 5


def test_merger_splits_prompt_only_outputs_with_the_sampled_ones():
    sp = SamplingParams(prompt_logprobs=0)

    def scoring(seq_id):  # a prompt chunk of 1 of a 3-token prompt: scores prompt token 1, samples nothing
        return Seq(seq_id, [1], 0, [0], False, sp, 0, prompt=[1, 2, 3])

    def execute(batch):
        return [SampleOutput(batch.seq_ids[i], 9) if batch.sample[i] else
                SampleOutput(batch.seq_ids[i], -1, sampled=False) for i in batch.reports().nonzero()[0]]

    merger = StepMerger(launch_of(execute))
    results = {}
    batches = {"g0": batch(scoring("0/0"), step("0/1")),
               "g1": batch(step("0/0", sample=False), scoring("0/1"), step("0/2"))}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, merger.run(batches[n])[0]))
               for n in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(o.seq_id, o.sampled) for o in results["g0"]] == [("0/0", False), ("0/1", True)]
    assert [(o.seq_id, o.sampled) for o in results["g1"]] == [("0/1", False), ("0/2", True)]


def test_merged_pass_carries_every_callers_forget_list_and_block_copies():
    seen = []

    def execute(batch):
        seen.append((list(batch.forget), list(batch.copies)))
        return [SampleOutput(s, 0) for s in sampled(batch)]

    merger = StepMerger(launch_of(execute))
    mine = batch(step("x"), forget=["gone/0", "gone/1"], copies=[(3, 4)])
    assert merger.run(mine)[0] == [SampleOutput("x", 0)]
    assert seen == [(["gone/0", "gone/1"], [(3, 4)])]


class BehindDevice:
    """A device that runs each launched pass for `seconds` after the one before it ends."""

    def __init__(self, seconds):
        self.seconds, self.free_at, self.launched = seconds, 0.0, []

    def launch(self, batch):
        self.free_at = max(time.monotonic(), self.free_at) + self.seconds
        self.launched.append((time.monotonic(), self.free_at, list(batch.seq_ids)))
        return Launched([SampleOutput(s, len(self.launched)) for s in batch.seq_ids], self.seconds,
                        self.free_at)


def test_next_pass_is_launched_while_the_last_runs_and_answers_wait_for_the_device(monkeypatch):
    # the merger gathers behind a running pass until LAUNCH_MARGIN_S before it ends: wide here,
    # so that a loaded machine waking the model thread late still launches "b" in time
    monkeypatch.setattr(step_merger, "LAUNCH_MARGIN_S", 0.5)
    device = BehindDevice(1.0)
    merger = StepMerger(device.launch)
    answered, order = {}, []

    def call(name):
        outputs, seconds = merger.run(batch(step(name)), caller=name,
                                      before=lambda: order.append(("before", name)),
                                      after=lambda outs: order.append(("after", name)))
        answered[name] = (time.monotonic(), outputs[0].token_id, seconds)

    first = threading.Thread(target=call, args=("a",))
    first.start()
    while not device.launched:  # "b" comes while "a" runs on the device, from another gateway
        time.sleep(0.001)
    call("b")
    first.join()
    (launch_a, end_a, _), (launch_b, end_b, _) = device.launched
    assert launch_b < end_a  # launched before the device ended "a"
    assert end_b == end_a + 1.0  # and started on the device the moment "a" ended
    assert answered["a"][0] >= end_a and answered["b"][0] >= end_b
    assert answered["a"][1:] == (1, 1.0) and answered["b"][1:] == (2, 1.0)
    # "a"'s outputs were recorded before "b"'s fed tokens were filled
    assert order == [("before", "a"), ("after", "a"), ("before", "b"), ("after", "b")]


class HeldSource:
    """A pass's outputs on a device: done once `finish` is called, or when asked for them."""

    def __init__(self, batch, log):
        self.tokens, self.log, self.ended = None, log, threading.Event()
        self.ids = [batch.seq_ids[i] for i in batch.sample.nonzero()[0]]

    def done(self):
        return self.ended.is_set()

    def wait(self):
        self.ended.wait()

    def outputs(self):
        self.ended.set()
        self.log.append(("read", self.ids[0]))
        return StepOutputs(self.ids, [len(self.log)] * len(self.ids))


def held_launch(log, sources, seconds):
    """A launch whose outputs are held on a device (HeldSource), each logged and kept in `sources`."""
    def launch(batch):
        sources.append(HeldSource(batch, log))
        log.append(("launch", batch.seq_ids[0]))
        return Launched(PendingOutputs(sources[-1], 0, len(sources[-1].ids)), seconds)
    return launch


def test_pending_outputs_are_read_after_the_next_pass_is_launched_and_answered_by_their_caller(monkeypatch):
    monkeypatch.setattr(step_merger, "LAUNCH_MARGIN_S", 0.0)
    log, sources = [], []
    merger = StepMerger(held_launch(log, sources, 0.001))
    merger._last_pass_s = 30.0  # "a" would end long after "b" comes
    answered = {}

    def call(name):
        outputs, _ = merger.run(batch(step(name)), caller=name,
                                after=lambda outs: log.append(("after", name, type(outs).__name__)))
        answered[name] = outputs

    first = threading.Thread(target=call, args=("a",))
    first.start()
    while not sources:
        time.sleep(0.001)
    second = threading.Thread(target=call, args=("b",))
    second.start()
    while len(sources) < 2:
        time.sleep(0.001)
    first.join()
    sources[1].ended.set()  # "b"'s outputs reach the host: no wait for an estimate
    second.join(timeout=10)
    assert not second.is_alive()
    assert log[:5] == [("launch", "a"), ("after", "a", "PendingOutputs"), ("launch", "b"),
                       ("after", "b", "PendingOutputs"), ("read", "a")]
    assert isinstance(answered["a"], StepOutputs) and answered["a"].seq_ids == ["a"]
    assert answered["b"].seq_ids == ["b"]


def test_held_outputs_wait_for_the_next_pass_up_to_the_hold_however_short_the_last_pass(monkeypatch):
    """A CPU's held readback (the executor's --hold-readback): with a pass that took no time, "a"
    would be answered (its outputs read) at once; held, "b" coming 50 ms later still reads from it."""
    monkeypatch.setattr(step_merger, "LAUNCH_MARGIN_S", 0.0)
    log, sources = [], []
    merger = StepMerger(held_launch(log, sources, 0.0), hold_s=2.0)
    threads = [threading.Thread(target=merger.run, args=(batch(step(name)), name)) for name in "ab"]
    threads[0].start()
    while not sources:
        time.sleep(0.001)
    time.sleep(0.05)
    threads[1].start()
    while len(sources) < 2:
        time.sleep(0.001)
    sources[1].ended.set()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert log[:3] == [("launch", "a"), ("launch", "b"), ("read", "a")]


def test_a_failed_launch_behind_a_running_pass_fails_its_caller_only():
    device = BehindDevice(0.5)
    calls = []

    def launch(batch):
        calls.append(batch)
        if len(calls) == 2:
            raise ValueError("bad slot")
        return device.launch(batch)

    merger = StepMerger(launch)
    results = {}

    def call(name):
        try:
            results[name] = merger.run(batch(step(name)))[0][0].seq_id
        except ValueError as e:
            results[name] = str(e)

    first = threading.Thread(target=call, args=("a",))
    first.start()
    while not calls:  # "a" launched alone, whatever the load
        time.sleep(0.001)
    call("b")
    first.join()
    call("c")
    assert results == {"a": "a", "b": "bad slot", "c": "c"}


def test_a_merged_pass_hands_each_caller_the_rows_it_left_out():
    """A sequence the pass left out (pagedserve.executor.seq_screen sets the merged batch's
    errors) is marked in its caller's own batch, at its own row, and reports its error there."""
    entered, gate, passes = threading.Event(), threading.Event(), []

    def execute(merged):
        passes.append(list(merged.seq_ids))
        entered.set()
        gate.wait(5)
        for i, seq_id in enumerate(merged.seq_ids):
            if seq_id.startswith("bad"):
                merged.errors[i] = f"ValueError: {seq_id}"
        return [SampleOutput(merged.seq_ids[i], -1, sampled=False, error=merged.errors[i]) if i in merged.errors
                else SampleOutput(merged.seq_ids[i], 5) for i in merged.reports().nonzero()[0]]

    merger = StepMerger(launch_of(execute))
    batches = {"w": batch(step("w")), "g0": batch(step("0/0"), step("bad0")),
               "g1": batch(step("bad1"), step("0/1", sample=False), step("0/2"))}
    results = {}

    def call(name):
        results[name] = merger.run(batches[name], caller=name)[0]

    threads = [threading.Thread(target=call, args=("w",))]
    threads[0].start()
    assert entered.wait(5)  # a pass runs: the two that come now queue behind it
    threads += [threading.Thread(target=call, args=(n,)) for n in ("g0", "g1")]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 5
    while len(merger._queue) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()
    for t in threads:
        t.join()
    assert passes == [["w"], ["0/0", "bad0", "bad1", "0/1", "0/2"]] or \
        passes == [["w"], ["bad1", "0/1", "0/2", "0/0", "bad0"]]  # one merged pass, in either order
    assert batches["g0"].errors == {1: "ValueError: bad0"} and batches["g1"].errors == {0: "ValueError: bad1"}
    assert [(o.seq_id, o.error) for o in results["g0"]] == [("0/0", ""), ("bad0", "ValueError: bad0")]
    assert [(o.seq_id, o.error) for o in results["g1"]] == [("bad1", "ValueError: bad1"), ("0/2", "")]
    # each caller's part is columns of its own, `more` numbered from its first entry
    assert results["g0"].tokens == [5, -1] and results["g0"].errors() == {1: "ValueError: bad0"}
    assert results["g1"].tokens == [-1, 5] and results["g1"].errors() == {0: "ValueError: bad1"}


def test_one_caller_gets_the_pass_outputs_as_they_are_and_merged_callers_slices():
    outs = StepOutputs(["a", "b", "c"], [1, 2, 3], {1: SampleOutput("b", 2, -0.5)})
    merger = StepMerger(lambda b: Launched(outs))
    assert merger.run(batch(step("a"), step("b"), step("c")))[0] is outs
    part = outs.part(1, 3)
    assert part.seq_ids == ["b", "c"] and part.tokens == [2, 3] and part.more == {0: SampleOutput("b", 2, -0.5)}
    assert part == [SampleOutput("b", 2, -0.5), SampleOutput("c", 3)] and not outs.part(2, 3).more
