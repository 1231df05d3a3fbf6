"""One request cannot harm another: a step that fails leaves no prefix-cache hit behind on
blocks it never wrote, and a sequence the executor leaves out of a step ends alone while
the others give exactly their tokens (pagedserve.gateway.write_report, pagedserve.executor.seq_screen)."""
import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.executor.seq_screen import run_screened
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from tests.support.fake_executor import FakeExecutor
from tests.support.fake_loop import expected, greedy, run_all

PREFIX = list(range(100, 164))  # 16 full blocks of 4


class Faulty(FakeExecutor):
    """The fake executor; a step holding a sequence of request `fail_request` fails before
    it writes anything (`raises`), or the executor's screen leaves that sequence out
    (pagedserve.executor.seq_screen: it reports an error)."""

    def __init__(self, *args, fail_request=None, raises=False, **kw):
        super().__init__(*args, **kw)
        self.fail_request, self.raises = fail_request, raises

    def _bad(self, seq_id) -> bool:
        return seq_id.split("/")[0] == self.fail_request

    def execute(self, batch):
        if self.raises and any(self._bad(s) for s in batch.seq_ids):
            self.fail_request = None  # once
            raise RuntimeError("the step failed")
        return run_screened(batch, self._check, super().execute)

    def _check(self, batch):
        for i, seq_id in enumerate(batch.seq_ids):
            if self._bad(seq_id):
                batch.errors.setdefault(i, "ValueError: a bad parameter")


def loop_with(ex, overlap, num_blocks=128):
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, max_model_len=4096))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    loop = BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, overlap=overlap))
    return loop, mem


def drain(loop):
    """run_all, where a failing step ends every request in flight (as the step runner does)."""
    out, errors = {}, {}
    while loop.has_work():
        try:
            deltas = loop.step()
        except RuntimeError:
            for request_id in list(loop.requests):
                loop.abort(request_id)
            continue
        for d in deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
            if d.error:
                errors[d.request_id] = (d.finish_reason, d.error)
    return out, errors


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_on_a_fresh_prefix_leaves_no_hit_on_its_blocks(overlap):
    ex = Faulty(4, fail_request="bad", raises=True)
    loop, mem = loop_with(ex, overlap)
    loop.add_request("bad", PREFIX + [1], greedy(5))
    out, _ = drain(loop)
    assert "bad" not in out or out["bad"] == []
    loop.add_request("small", [7, 7], greedy(3))  # takes one of the blocks left unwritten, runs
    assert run_all(loop)[("small", 0)] == expected([7, 7], 3, 7)
    loop.add_request("next", PREFIX + [2], greedy(6))
    out = run_all(loop)
    assert out[("next", 0)] == expected(PREFIX + [2], 6, 7)  # what a fresh computation gives
    loop.add_request("again", PREFIX + [3], greedy(4))  # now "next" wrote the prefix: a hit
    deltas = []
    while loop.has_work():
        deltas += loop.step()
    assert [t for d in deltas for t in d.token_ids] == expected(PREFIX + [3], 4, 7)
    assert deltas[-1].cached_tokens == 64
    mem.check_integrity()
    assert mem.stats().snapshot["blocks_referenced"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_sequence_left_out_ends_alone_and_the_others_give_their_tokens(overlap):
    ex = Faulty(4, fail_request="bad")
    loop, mem = loop_with(ex, overlap)
    prompts = {"a": [5, 6, 7, 8, 9], "bad": PREFIX + [1], "b": list(range(300, 330))}
    for request_id, prompt in prompts.items():
        loop.add_request(request_id, prompt, greedy(12))
    out, errors = drain(loop)
    assert out["a"] == expected(prompts["a"], 12, 7) and out["b"] == expected(prompts["b"], 12, 7)
    assert errors == {"bad": ("refused", "the executor refused this sequence: ValueError: a bad parameter")}
    ex.fail_request = None
    loop.add_request("after", PREFIX + [2], greedy(5))  # the prefix the left-out one never wrote
    assert run_all(loop)[("after", 0)] == expected(PREFIX + [2], 5, 7)
    mem.check_integrity()
    assert mem.stats().snapshot["blocks_referenced"] == 0


class _FaultyOutput(list):
    def append(self, token):
        raise OverflowError("Numerical result out of range")


@pytest.mark.parametrize("in_order", [True, False], ids=["in-order", "by-id"])
def test_an_output_the_gateway_cannot_apply_ends_its_request_alone(monkeypatch, in_order):
    ex = FakeExecutor(4)
    loop, mem = loop_with(ex, overlap=False)
    loop.add_request("a", [5, 6, 7], greedy(8))
    loop.add_request("b", [8, 9, 10], greedy(8))
    loop.scheduler.seqs["b/0"].output_token_ids = _FaultyOutput()
    if not in_order:  # the general path: outputs looked up by id
        monkeypatch.setattr(loop.scheduler, "_sampled_in_order", lambda *args: False)
    out, errors = drain(loop)
    assert out["a"] == expected([5, 6, 7], 8, 7)
    assert errors["b"][0] == "refused" and "OverflowError" in errors["b"][1]
    assert mem.stats().snapshot["blocks_referenced"] == 0
