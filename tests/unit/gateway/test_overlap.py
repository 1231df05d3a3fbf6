"""The overlapped batching loop (a step's tokens become deltas while the next step runs; with
plan ahead, the next step is also planned and reserved meanwhile) gives the same outputs as
the serial loop: greedy, seeded sampling, n > 1, preemption by swap and by recompute, stop
strings (seen one step late, the extra token dropped), aborts, and an executor failure in
the middle; nothing stays referenced afterwards."""
import dataclasses
import threading

import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.in_process import InProcessExecutor, step_clients
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.step_retry import StepRetry
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_executor import FakeExecutor
from tests.support.fake_loop import expected, prompts, run_all
from tests.support.sent_now import SentNowExecutor, SentNowMemory


class LetterTokenizer:
    """Token t is the letter 'a' + t % 26: stop strings on the fake executor's tokens."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + t % 26) for t in ids)


# overlap: outputs only; ahead: outputs and plan ahead; later: plan ahead over clients that
# send a call and read its answer later on the loop's thread, as the remote ones do
LOOPS = ("serial", "overlap", "ahead", "later")


def make(loop_kind, *, num_blocks=256, mode="recompute", host_blocks=None, prefix=True, max_tokens_step=64,
         tokenizer=None, executor=None):
    if loop_kind in (True, False):
        loop_kind = "ahead" if loop_kind else "serial"
    ex = executor or FakeExecutor(4)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, prefix_caching=prefix,
                                     preemption_mode=mode, num_host_blocks=host_blocks))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_tokens_step,
                             overlap=loop_kind != "serial", plan_ahead=loop_kind in ("ahead", "later"))
    if loop_kind == "later":
        memory = SentNowMemory(mem)
        return BatchLoop(memory, SentNowExecutor(ex, memory.tables), config, tokenizer), mem
    return BatchLoop(mem, ex, config, tokenizer), mem


def run(loop):
    try:
        out = {}
        texts = {}
        finish = {}
        while loop.has_work():
            for d in loop.step():
                out.setdefault((d.request_id, d.index), []).extend(d.token_ids)
                texts[(d.request_id, d.index)] = texts.get((d.request_id, d.index), "") + d.text
                if d.finish_reason:
                    finish[(d.request_id, d.index)] = (d.finish_reason, d.completion_tokens)
        return out, texts, finish
    finally:
        loop.close()


def assert_clean(mem):
    mem.check_integrity()
    stats = mem.stats()
    assert stats.snapshot["blocks_referenced"] == 0 and stats.num_sequences == 0


def _count_fed_runs(scheduler) -> list[int]:
    """How many of the scheduler's steps were steady decode steps (every token PENDING)."""
    count, made = [0], scheduler._all_fed

    def counted(*args):
        fed = made(*args)
        count[0] += fed
        return fed
    scheduler._all_fed = counted
    return count


def _helper_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith(("pagedserve-execute", "pagedserve-reserve"))}


def _without_helpers(run_loop, loop):
    """`run_loop(loop)`, which starts no helper thread: the calls go out and come back on
    this one."""
    before, step = _helper_threads(), loop.step

    def checked():
        deltas = step()
        assert _helper_threads() <= before
        return deltas
    loop.step = checked
    return run_loop(loop)


def both(workload, computed=None, granted_ahead=True, **kw):
    """The workload's results with the serial, the overlapped and the plan-ahead loop."""
    results = []
    for kind in LOOPS:
        ex = FakeExecutor(4)
        loop, mem = make(kind, executor=ex, **kw)
        runs = _count_fed_runs(loop.scheduler)
        workload(loop)
        results.append(run(loop) if kind != "later" else _without_helpers(run, loop))
        if kind == "later" and granted_ahead:
            assert runs[0] > 0  # steady steps went with every token PENDING
        assert_clean(mem)
        assert loop.num_steps > 0
        if kind in ("ahead", "later") and granted_ahead:
            assert loop.num_ahead > loop.num_deferred  # steps were reserved ahead
        if kind not in ("ahead", "later"):
            assert loop.num_ahead == 0
        if computed is not None:
            computed.append(ex.num_executed_tokens)
    return results


def test_greedy_seeded_and_n_samples_are_the_same():
    ps = prompts(10, seed=4)

    def workload(loop):
        for i, p in enumerate(ps):
            sp = (SamplingParams(max_tokens=12, temperature=0.0, seed=7) if i % 2 else
                  SamplingParams(max_tokens=9, temperature=0.8, seed=100 + i, n=3))
            loop.add_request(str(i), p, sp)

    serial, overlapped, ahead, later = both(workload)
    assert serial == overlapped == ahead == later
    out = serial[0]
    for i, p in enumerate(ps):
        if i % 2:
            assert out[(str(i), 0)] == expected(p, 12, 7)
        else:
            assert all(len(out[(str(i), j)]) == 9 for j in range(3))


@pytest.mark.parametrize("mode, host_blocks", [("recompute", None), ("swap", None), ("swap", 6)])
def test_preemption_gives_the_same_outputs(mode, host_blocks):
    ps = prompts(8, lo=10, hi=20, seed=3)

    def workload(loop):
        for i, p in enumerate(ps):
            loop.add_request(str(i), p, SamplingParams(max_tokens=30, temperature=0.0, seed=7))

    serial, overlapped, ahead, later = both(workload, num_blocks=24, mode=mode, host_blocks=host_blocks, prefix=False)
    assert serial == overlapped == ahead == later
    for i, p in enumerate(ps):
        assert serial[0][(str(i), 0)] == expected(p, 30, 7)


def test_stop_strings_end_at_the_same_token_and_the_extra_token_is_dropped():
    ps = prompts(12, seed=9)
    stops = ["e", "ab", "zz", "q"]

    def workload(loop):
        for i, p in enumerate(ps):
            loop.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0.0, seed=7,
                                                       stop=[stops[i % len(stops)]]))

    computed = []
    serial, overlapped, ahead, later = both(workload, computed, tokenizer=LetterTokenizer())
    assert serial == overlapped == ahead == later
    assert computed[1] > computed[0]  # overlapped: a stopped sequence ran one more step
    tokens, texts, finish = serial
    stopped = [k for k, (reason, _) in finish.items() if reason == "stop"]
    assert stopped  # the workload does hit stop strings
    for key in stopped:
        stop = stops[int(key[0]) % len(stops)]
        assert stop not in texts[key]
        assert finish[key][1] == len(tokens[key])  # usage counts the tokens delivered


def test_aborts_between_steps_free_everything():
    ps = prompts(6, seed=5)
    for kind in LOOPS:
        loop, mem = make(kind)
        for i, p in enumerate(ps):
            loop.add_request(str(i), p, SamplingParams(max_tokens=50, temperature=0.0, seed=7))
        for _ in range(4):
            loop.step()
        loop.abort("1")
        loop.abort("4")
        out, _, _ = run(loop)
        assert ("1", 0) not in out or len(out[("1", 0)]) < 50
        for i in (0, 2, 3, 5):
            assert out[(str(i), 0)][-5:] == expected(ps[i], 50, 7)[-5:]
        assert_clean(mem)


class FlakyExecutor(FakeExecutor):
    """Fails the Execute of its `fail_at`-th call with UNAVAILABLE (then serves again)."""

    def __init__(self, block_size, fail_at):
        super().__init__(block_size)
        self.calls, self.fail_at = 0, fail_at

    def execute(self, batch):
        self.calls += 1
        if self.calls == self.fail_at:
            import grpc

            class Unavailable(grpc.RpcError):
                def code(self):
                    return grpc.StatusCode.UNAVAILABLE

                def details(self):
                    return "executor restarting"

            raise Unavailable()
        return super().execute(batch)


def test_an_executor_failure_mid_run_loses_no_token():
    ps = prompts(5, seed=6)
    results = []
    for kind in LOOPS:
        ex = FlakyExecutor(4, fail_at=5)
        mem = MemoryManager(MemoryConfig(num_blocks=256))
        ex.attach_pool(mem.register_executor(ex.info.kv))
        if kind == "later":
            memory = SentNowMemory(mem)
            retry = StepRetry(memory, SentNowExecutor(ex, memory.tables), timeout_s=5.0, interval_s=0.0)
        else:
            retry = StepRetry(*step_clients(mem, ex, overlap=kind != "serial"), timeout_s=5.0, interval_s=0.0)
        loop = BatchLoop(retry.memory, retry.executor,
                         dataclasses.replace(SchedulerConfig(max_num_seqs=16), overlap=kind != "serial",
                                             plan_ahead=kind in ("ahead", "later")))
        for i, p in enumerate(ps):
            loop.add_request(str(i), p, SamplingParams(max_tokens=15, temperature=0.0, seed=7))
        results.append(run(loop)[0])
        assert ex.calls > 5
        assert_clean(mem)
    assert results[0] == results[1] == results[2] == results[3]
    for i, p in enumerate(ps):
        assert results[1][(str(i), 0)] == expected(p, 15, 7)


def test_deltas_come_one_step_later_and_nothing_is_left_behind():
    loop, mem = make(True)
    loop.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, seed=7))
    assert loop.step() == []  # the prefill ran; its token becomes a delta during the next step
    got = []
    while loop.has_work():
        got.extend(t for d in loop.step() for t in d.token_ids)
    loop.close()
    assert got == expected([1, 2, 3], 3, 7)
    assert run_all(loop) == {}
    assert_clean(mem)


def test_deltas_made_during_a_failed_step_come_with_the_next_call():
    class Broken(FakeExecutor):
        calls = 0

        def execute(self, batch):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("executor crashed")
            return super().execute(batch)

    loop, mem = make(True, executor=Broken(4))
    loop.add_request("r", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0, seed=7))
    got = [t for _ in range(2) for d in loop.step() for t in d.token_ids]
    with pytest.raises(RuntimeError, match="crashed"):
        loop.step()
    loop.abort("r")  # as the step runner does after a failure
    got += [t for d in loop.step() for t in d.token_ids]
    loop.close()
    assert got == expected([5, 6, 7], 2, 7)  # step 2's token was not lost with step 3
    assert not loop.has_work()
    assert_clean(mem)  # the reservation made ahead of the failed step was freed


def test_deliver_gets_each_steps_deltas_while_the_next_step_runs():
    loop, mem = make(True)
    ps = prompts(4, seed=8)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0.0, seed=7))
    delivered = []
    loop.deliver = lambda deltas: delivered.append(deltas)
    out = {}
    calls = 0
    while loop.has_work():
        before = len(delivered)
        returned = loop.step()
        calls += 1
        assert len(delivered) - before <= 1  # at most one delivery per step, made inside it
        for d in returned + [d for batch in delivered[before:] for d in batch]:
            out.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    loop.close()
    assert any(delivered) and calls > 6
    for i, p in enumerate(ps):
        assert out[(str(i), 0)] == expected(p, 6, 7)
    assert_clean(mem)


class HistoryCheckingExecutor(FakeExecutor):
    """Checks that every step with penalties sees the sequence's true token history (the
    tokens in the pool: a fed token must be filled in before the step runs)."""

    def __init__(self, block_size):
        super().__init__(block_size)
        self.checked = 0

    def execute(self, batch):
        out = super().execute(batch)
        bs = self.info.kv.block_size
        pool = self.pool[:, 0, 0, :, 0, 0]
        for i, seq_id in enumerate(batch.seq_ids):
            if batch.held[i].sampling.uses_penalties:
                n = int(batch.start_pos[i] + batch.num_tokens[i])
                table = batch.block_tables[i]
                context = [int(pool[table[p // bs], p % bs]) for p in range(n)]
                prompt = batch.prompt_of(i)
                history = prompt + batch.output_of(i)
                assert history[:n] == context, seq_id
                if batch.start_pos[i] >= batch.held[i].prompt_len:
                    assert len(history) == n, seq_id
                self.checked += 1
        return out


def test_penalties_see_the_true_history_in_every_loop_fed_tokens_included():
    ps = prompts(6, seed=11)
    results = []
    for kind in LOOPS:
        ex = HistoryCheckingExecutor(4)
        loop, mem = make(kind, executor=ex)
        for i, p in enumerate(ps):
            loop.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, seed=7,
                                                       repetition_penalty=1.2, presence_penalty=0.5))
        results.append(run(loop)[0])
        assert ex.checked > 0
        if kind in ("ahead", "later"):
            assert loop.num_ahead > loop.num_deferred  # steps went ahead with fed tokens
        assert_clean(mem)
    assert results[0] == results[1] == results[2] == results[3]


def test_a_fed_step_whose_token_the_executor_lost_runs_again_with_its_tokens():
    """The executor forgets its last samples (as a restarted one would) just before the 3rd
    and 6th steps that name them: those fail for want of them and are sent again with
    their tokens; the outputs are unchanged."""
    from pagedserve.step.local_engine import LocalEngine

    class Forgetful(LocalEngine):
        fed_calls = 0

        def __init__(self, inner):
            super().__init__(inner)
            fill = self.running.fill

            def forgetful_fill(step):  # in the step's turn, just before it runs
                if len(step.fed):
                    self.fed_calls += 1
                    if self.fed_calls in (3, 6):
                        self.running.last_pos[:] = -1
                return fill(step)

            self.running.fill = forgetful_fill

    ps = prompts(5, seed=12)
    loop, mem = make("ahead")
    assert isinstance(loop.executor, InProcessExecutor)
    loop.executor.ordered = Forgetful(loop.executor.ordered.inner)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, SamplingParams(max_tokens=15, temperature=0.0, seed=7))
    out = run(loop)[0]
    assert 2 <= loop.num_resent <= 4  # a loss costs the step and at most the one sent ahead of it, not every step after
    for i, p in enumerate(ps):
        assert out[(str(i), 0)] == expected(p, 15, 7)
    assert_clean(mem)
