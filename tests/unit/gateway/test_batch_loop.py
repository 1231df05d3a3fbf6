"""The batching loop with real memsvc and a model-free executor that checks every slot."""
import pytest

from pagedserve.gateway.request_intake import RequestError
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_loop import expected, greedy, make_loop, prompts, run_all


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_outputs_match_reference_and_pool_ends_empty(block_size):
    loop, mem, _ = make_loop(num_blocks=4096 // block_size, block_size=block_size)
    ps = prompts(12)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, greedy(20))
    out = run_all(loop)
    for i, p in enumerate(ps):
        assert out[(str(i), 0)] == expected(p, 20, 7)
    mem.check_integrity()
    assert mem.stats().snapshot["blocks_referenced"] == 0


def test_chunked_prefill_and_small_step_budget():
    loop, mem, ex = make_loop(max_tokens_step=8)
    ps = prompts(4, lo=30, hi=50)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, greedy(5))
    out = run_all(loop)
    for i, p in enumerate(ps):
        assert out[(str(i), 0)] == expected(p, 5, 7)
    assert loop.num_steps > sum(len(p) for p in ps) // 8


def test_preemption_by_recompute_keeps_outputs():
    loop, mem, _ = make_loop(num_blocks=24, block_size=4, prefix=False)
    ps = prompts(8, lo=10, hi=20, seed=3)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, greedy(30))
    out = run_all(loop)
    assert mem.num_preemptions > 0
    for i, p in enumerate(ps):
        assert out[(str(i), 0)] == expected(p, 30, 7)
    mem.check_integrity()
    assert mem.stats().snapshot["blocks_referenced"] == 0


def test_prefix_cache_hit_reported_and_outputs_unchanged():
    loop, mem, ex = make_loop(block_size=4)
    system = list(range(100, 140))
    loop.add_request("a", system + [1, 2, 3], greedy(4))
    first = run_all(loop)
    computed = ex.num_executed_tokens
    loop.add_request("b", system + [4, 5], greedy(4))
    deltas = []
    while loop.has_work():
        deltas += loop.step()
    assert deltas[-1].cached_tokens == 40
    assert ex.num_executed_tokens - computed == 2 + 3  # the two new prompt tokens + 3 decodes
    assert [t for d in deltas for t in d.token_ids] == expected(system + [4, 5], 4, 7)
    assert first[("a", 0)] == expected(system + [1, 2, 3], 4, 7)


def test_request_that_can_never_fit_is_rejected_at_once():
    loop, mem, _ = make_loop(num_blocks=8, block_size=4)
    loop.add_request("big", list(range(20)), greedy(40))
    loop.add_request("ok", list(range(5)), greedy(3))
    deltas = []
    while loop.has_work():
        deltas += loop.step()
    big = [d for d in deltas if d.request_id == "big"]
    assert big[0].finish_reason == "error" and "pool" in big[0].error
    assert [d.finish_reason for d in deltas if d.request_id == "ok"][-1] == "length"
    mem.check_integrity()


@pytest.mark.parametrize("prompt, params, field", [
    ([], greedy(4), "prompt"),
    ([1] * 5000, greedy(4), "maximum length"),
    ([1, 2, 5000], greedy(4), "vocabulary"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1), "temperature"),
    ([1, 2], SamplingParams(top_p=0), "top_p"),
    ([1, 2], SamplingParams(n=0), "n must"),
    ([1, 2], SamplingParams(top_k=2 ** 31), "top_k"),  # beyond the wire's int32
    ([1, 2], SamplingParams(stop_token_ids=[2 ** 40]), "stop_token_ids"),
    ([1, 2], SamplingParams(stop=["\ud800"]), "stop"),  # not encodable as UTF-8
    ([1, 2], SamplingParams(top_p=1e-46), "top_p"),  # 0 as the executor's float32
    ([1, 2], dict(salt="\udc00"), "cache_salt"),
])
def test_bad_requests_are_refused_with_the_field_named(prompt, params, field):
    loop, _, _ = make_loop()
    loop.add_request("good", [1, 2, 3], greedy(3))
    options = params if isinstance(params, dict) else {}
    with pytest.raises(RequestError, match=field):
        loop.add_request("bad", prompt, greedy(4) if options else params, **options)
    assert run_all(loop)[("good", 0)] == expected([1, 2, 3], 3, 7)


def test_abort_frees_blocks_within_one_step():
    loop, mem, _ = make_loop()
    for i, p in enumerate(prompts(6)):
        loop.add_request(str(i), p, greedy(50))
    for _ in range(5):
        loop.step()
    for i in range(6):
        loop.abort(str(i))
    loop.step()
    assert mem.stats().snapshot["blocks_referenced"] == 0
    assert not loop.has_work()


def test_n_completions_have_distinct_seeds_and_share_prompt_blocks():
    loop, mem, _ = make_loop(block_size=4)
    p = list(range(200, 233))
    loop.add_request("r", p, SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3))
    out = run_all(loop)
    assert len({tuple(out[("r", i)]) for i in range(3)}) == 3
    assert out[("r", 0)] == expected(p, 6, 11)


def test_stop_token_and_max_len():
    loop, _, _ = make_loop(max_model_len=20)
    loop.add_request("a", list(range(15)), greedy(10))
    out = run_all(loop)
    assert len(out[("a", 0)]) == 5


def test_the_batch_carries_the_pool_of_its_reservation_and_the_loop_knows_each_sequence():
    loop, mem, ex = make_loop()
    batches = []
    execute = ex.execute
    ex.execute = lambda batch: batches.append(batch) or execute(batch)
    loop.add_request("a/b", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, n=2))
    seen = {}
    while loop.has_work():
        seen.update({s: loop.request_of(s) for s in loop.scheduler.seqs})
        loop.step()
    assert batches and {b.pool_epoch for b in batches} == {mem.pool_epoch}
    assert seen == {"a/b/0": "a/b", "a/b/1": "a/b"}
    assert loop.request_of("a/b/0") is None  # finished: gone
