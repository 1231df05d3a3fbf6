"""n > 1 samples fork after the prefill: the prompt's blocks are shared, the partial last one
copied on write; outputs are the same as n independent sequences; prefix caching across
requests reports cached tokens."""
import pytest

from pagedserve.gateway.request_intake import derive_seed
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_loop import expected, make_loop, run_all


def steps(loop, k):
    out = {}
    for _ in range(k):
        for d in loop.step():
            out.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    return out


@pytest.mark.parametrize("prompt_len, shared, own", [
    (34, 8, 4),  # 33 tokens prefilled: 8 full blocks shared, the 9th (1 token) copied on write
    (33, 8, 4),  # 32 prefilled: 8 full blocks shared, each sample starts its own 9th block
])
def test_samples_share_the_prompt_blocks(prompt_len, shared, own):
    loop, mem, ex = make_loop(block_size=4, prefix=False)
    p = list(range(100, 100 + prompt_len))
    loop.add_request("r", p, SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=4))
    out = steps(loop, 1)  # the prefill up to the last prompt token, once
    assert ex.num_executed_tokens == prompt_len - 1 and out == {}
    assert mem.stats().snapshot["blocks_referenced"] == -(-(prompt_len - 1) // 4)
    # the forks travel inside the next Reserve's plan (no Fork call each)
    assert loop.scheduler.forks == [("r/0", f"r/{i}") for i in range(1, 4)]
    out = steps(loop, 1)  # each sample computes the last prompt token and draws its first token
    assert ex.num_executed_tokens == prompt_len - 1 + 4
    assert mem.stats().snapshot["blocks_referenced"] == shared + own
    tables = [mem.allocator.block_table(f"r/{i}") for i in range(4)]
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert len({t[shared] for t in tables}) == 4
    rest = run_all(loop)
    for i in range(4):
        tokens = out[("r", i)] + rest[("r", i)]
        assert tokens == expected(p, 6, derive_seed(11, i)), i
    mem.check_integrity()
    assert mem.stats().snapshot["blocks_referenced"] == 0


def test_a_one_token_prompt_and_an_abort_before_the_fork():
    loop, mem, _ = make_loop(block_size=4)
    loop.add_request("one", [5], SamplingParams(max_tokens=3, temperature=1.0, seed=2, n=3))
    loop.add_request("gone", list(range(40)), SamplingParams(max_tokens=3, seed=2, n=3))
    loop.abort("gone")
    out = run_all(loop)
    assert [out[("one", i)] for i in range(3)] == [expected([5], 3, derive_seed(2, i)) for i in range(3)]
    assert ("gone", 0) not in out
    mem.check_integrity()
    assert mem.stats().snapshot["blocks_referenced"] == 0


def test_a_stop_in_one_sample_leaves_the_others_running():
    loop, mem, _ = make_loop(block_size=4)
    p = list(range(300, 321))
    first = expected(p, 1, derive_seed(9, 1))[0]
    loop.add_request("r", p, SamplingParams(max_tokens=5, temperature=1.0, seed=9, n=3,
                                            stop_token_ids=[first]))
    out = run_all(loop)
    assert out[("r", 1)] == [first]
    assert out[("r", 0)] == expected(p, 5, derive_seed(9, 0))
    mem.check_integrity()
    assert mem.stats().snapshot["blocks_referenced"] == 0


def test_shared_system_prompt_is_computed_once_and_reported():
    loop, mem, ex = make_loop(block_size=4)
    system = list(range(500, 560))  # 60 tokens: 15 blocks
    for i in range(4):
        loop.add_request(f"u{i}", system + [i + 1, i + 2], SamplingParams(max_tokens=2, temperature=0.0))
        deltas = []
        while loop.has_work():
            deltas += loop.step()
        assert deltas[-1].cached_tokens == (0 if i == 0 else 60)
    assert ex.num_executed_tokens == 62 + 3 * 2 + 4 * 1
    stats = mem.stats()
    assert stats.prefix_cache_queries == 4 * 62 and stats.prefix_cache_hits == 3 * 60
