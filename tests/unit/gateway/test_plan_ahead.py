"""Planning and reserving step N + 1 while step N runs: what the serial loop never meets
(a reservation answered for sequences that end or are aborted before it is applied, pending
tokens memsvc keys once their ids come, a Reserve that fails while a step runs)."""
import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_executor import FakeExecutor
from tests.support.fake_loop import expected, prompts, run_all


def make(*, ahead=True, num_blocks=256, memory=None):
    ex = FakeExecutor(4)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, overlap=True, plan_ahead=ahead)
    return BatchLoop(memory(mem) if memory else mem, ex, config), mem


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, seed=7, **kw)


def assert_clean(mem):
    mem.check_integrity()
    stats = mem.stats()
    assert stats.snapshot["blocks_referenced"] == 0 and stats.num_sequences == 0


def test_blocks_completed_by_pending_tokens_are_cached_for_later_prompts():
    loop, mem = make()
    prompt = list(range(10, 17))  # 7 tokens: outputs sent pending complete blocks 1 and 2
    loop.add_request("a", prompt, greedy(9))
    out = run_all(loop)
    assert loop.num_ahead > loop.num_deferred
    assert out[("a", 0)] == expected(prompt, 9, 7)
    follow = prompt + out[("a", 0)] + [5]  # a conversation that goes on: 17 tokens
    loop.add_request("b", follow, greedy(4))
    cached = []
    while loop.has_work():
        for d in loop.step():
            cached.append(d.cached_tokens)
            assert d.token_ids == expected(follow, 4, 7)[len(cached) - 1:len(cached)]
    loop.close()
    # blocks 0-2 (block 3 holds 3 computed tokens: the last output is never computed)
    assert cached[0] == 12
    assert_clean(mem)


def test_a_stop_token_ends_a_sequence_whose_next_step_was_reserved():
    ps = prompts(6, seed=11)
    results = []
    for ahead in (False, True):
        loop, mem = make(ahead=ahead)
        for i, p in enumerate(ps):
            stop = expected(p, 8, 7)[3 + i % 3]  # ends after its 4th-6th token
            loop.add_request(str(i), p, greedy(20, stop_token_ids=[stop]))
        results.append(run_all(loop))
        loop.close()
        assert_clean(mem)  # the slot reserved past the stop token was freed
    assert results[0] == results[1]
    assert all(len(v) < 8 for v in results[0].values())


def test_a_request_admitted_ahead_then_aborted_is_freed_and_its_id_may_come_back():
    loop, mem = make()
    p, q = prompts(2, seed=12)
    loop.add_request("a", p, greedy(10))
    loop.step()
    loop.add_request("b", q, greedy(10))
    loop.step()  # while it ran, the next step was reserved, admitting b
    assert mem.allocator.has_sequence("b/0") and loop.requests["b"].seqs[0].num_computed == 0
    loop.abort("b")
    loop.add_request("b", p, greedy(6))  # the id again, another prompt
    out = run_all(loop)
    loop.close()
    assert out[("b", 0)] == expected(p, 6, 7)
    assert out[("a", 0)][-3:] == expected(p, 10, 7)[-3:]
    assert_clean(mem)


def test_a_reserve_failing_while_a_step_runs_ends_the_step_first():
    class FailingAhead:
        def __init__(self, mem):
            self.mem, self.calls = mem, 0

        def reserve(self, plan):
            if plan.ahead:
                self.calls += 1
                if self.calls == 3:
                    raise RuntimeError("memsvc is gone")
            return self.mem.reserve(plan)

    loop, mem = make(memory=FailingAhead)
    for i, p in enumerate(prompts(3, seed=13)):
        loop.add_request(str(i), p, greedy(12))
    with pytest.raises(RuntimeError, match="memsvc is gone"):
        for _ in range(20):
            loop.step()
    for request_id in list(loop.requests):  # as the step runner does after a failure
        loop.abort(request_id)
    run_all(loop)
    loop.close()
    assert not loop.has_work()
    assert_clean(mem)


def test_the_last_steps_deltas_are_made_while_memsvc_answers_a_plan_made_ahead():
    """A Reserve made ahead is answered only once the loop has made deltas since it went
    out: a loop that waited for the answer first would stall (and fail on the timeout)."""
    import threading

    made = threading.Event()

    class AnswersAfterDeltas:
        def __init__(self, mem):
            self.mem, self.waited = mem, 0

        def reserve(self, plan):
            if plan.ahead:
                made.clear()
                assert made.wait(10), "no deltas were made while the Reserve was out"
                self.waited += 1
            return self.mem.reserve(plan)

    loop, mem = make(memory=AnswersAfterDeltas)
    make_deltas = loop._deltas

    def deltas(updates):
        out = make_deltas(updates)
        made.set()
        return out

    loop._deltas = deltas
    ps = prompts(3, seed=17)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, greedy(10))
    out = run_all(loop)
    loop.close()
    assert loop.memory.inner.waited > 5  # pagedserve.gateway.in_process.InProcessMemory
    assert [out[(str(i), 0)] for i in range(3)] == [expected(p, 10, 7) for p in ps]
    assert_clean(mem)


@pytest.mark.parametrize("ahead", [False, True])
def test_the_executor_hears_of_finished_sequences_again_after_a_failed_step(ahead):
    class FailsOnce(FakeExecutor):
        def __init__(self, block_size):
            super().__init__(block_size)
            self.failed, self.forgets = False, []

        def execute(self, batch):
            if batch.forget and not self.failed:
                self.failed = True
                raise RuntimeError("executor crashed")
            self.forgets.extend(batch.forget)
            return super().execute(batch)

    ex = FailsOnce(4)
    mem = MemoryManager(MemoryConfig(num_blocks=256))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, overlap=ahead, plan_ahead=ahead)
    loop = BatchLoop(mem, ex, config)
    p, q = prompts(2, seed=14)
    loop.add_request("a", p, greedy(2))
    loop.add_request("b", q, greedy(8))
    with pytest.raises(RuntimeError, match="crashed"):
        for _ in range(10):
            loop.step()
    loop.abort("b")  # as the step runner does after a failure
    loop.add_request("c", q, greedy(2))  # the next batch to run
    run_all(loop)
    loop.close()
    assert ex.failed and {"a/0", "b/0"} <= set(ex.forgets)
    assert_clean(mem)
