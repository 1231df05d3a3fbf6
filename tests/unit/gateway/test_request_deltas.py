"""Requests.deltas: a sequence whose text cannot be made ends its request alone."""
import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from tests.support.fake_executor import FakeExecutor
from tests.support.fake_loop import expected, greedy


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stream_that_raises_ends_its_request_alone_with_one_error_delta(overlap):
    ex = FakeExecutor(4)
    mem = MemoryManager(MemoryConfig(num_blocks=64, max_model_len=4096))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    loop = BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, overlap=overlap))
    loop.add_request("a", [5, 6, 7], greedy(8))
    loop.add_request("b", [8, 9, 10], greedy(8))

    def broken(token_id):
        raise UnicodeError("no text for this token")
    loop.requests["b"].streams[0].add = broken
    out = {}
    while loop.has_work():
        for d in loop.step():
            out.setdefault(d.request_id, []).append(d)
    assert [t for d in out["a"] for t in d.token_ids] == expected([5, 6, 7], 8, 7)
    assert out["a"][-1].finish_reason == "length" and not any(d.error for d in out["a"])
    [b] = out["b"]  # the error alone, nothing after it
    assert (b.finish_reason, b.text, b.token_ids, b.prompt_tokens) == ("refused", "", [], 3)
    assert b.error == "the gateway could not make this sequence's output: UnicodeError: no text for this token"
    assert "b" not in loop.requests and mem.stats().snapshot["blocks_referenced"] == 0
