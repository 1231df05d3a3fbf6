"""Prompt logprobs through the batching loop (model-free): each completion's first delta
carries every prompt position's entry exactly once, over chunked prefill, n > 1 forks,
prefix-cache hits (skipped for such requests) and preemption by recompute."""
from collections import Counter

import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.request_intake import derive_seed
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.sequence import Sequence
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import PromptLogprob, SampleOutput, SamplingParams
from tests.support.fake_executor import FakeExecutor
from tests.support.fake_loop import expected, prompts


def entry(prompt, p):
    """What ScoringExecutor says about position p: prompt token p + 1."""
    return PromptLogprob(prompt[p + 1], -(p + 1) / 8, p % 3 + 1, [(7, -0.5)])


class ScoringExecutor(FakeExecutor):
    """The fake executor, also scoring the prompt positions each step asks for."""

    def __init__(self, block_size):
        super().__init__(block_size)
        self.scored = Counter()  # (seq_id, position) -> times scored

    def execute(self, batch):
        sampled = iter(super().execute(batch))
        out = []
        for i, seq_id in enumerate(batch.seq_ids):
            positions = batch.prompt_logprob_positions(i)
            entries = [entry(batch.prompt_of(i), p) for p in positions]
            self.scored.update((seq_id, p) for p in positions)
            if batch.sample[i]:
                o = next(sampled)
                o.prompt_logprobs = entries
                out.append(o)
            elif entries:
                out.append(SampleOutput(seq_id, -1, sampled=False, prompt_logprobs=entries))
        return out


def make(num_blocks=64, max_tokens_step=64, prefix=True, overlap=False):
    ex = ScoringExecutor(4)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, prefix_caching=prefix,
                                     preemption_mode="recompute"))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    loop = BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_tokens_step,
                                              overlap=overlap))
    return loop, mem, ex


def run(loop):
    """(request, index) -> (tokens, prompt logprobs of each delta, cached tokens)."""
    out = {}
    while loop.has_work():
        for d in loop.step():
            tokens, scored, _ = out.setdefault((d.request_id, d.index), ([], [], 0))
            tokens.extend(d.token_ids)
            scored.append(d.prompt_logprobs)
            out[(d.request_id, d.index)] = (tokens, scored, d.cached_tokens)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_and_forks_deliver_each_prompt_position_once(overlap):
    loop, mem, ex = make(max_tokens_step=5, overlap=overlap)
    long, one, mid = prompts(3, lo=13, hi=13, seed=1)[0], [5], prompts(1, lo=7, hi=7, seed=2)[0]
    asks = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, prompt_logprobs=1)
    loop.add_request("long", long, asks)
    loop.add_request("one", one, SamplingParams(max_tokens=3, temperature=0.0, seed=1, prompt_logprobs=0))
    loop.add_request("plain", mid, SamplingParams(max_tokens=3, temperature=0.0, seed=1))
    out = run(loop)
    for j in range(2):
        tokens, scored, _ = out[("long", j)]
        assert tokens == expected(long, 4, derive_seed(3, j))
        assert scored[0] == [entry(long, p) for p in range(12)] and not any(scored[1:])
    assert out[("one", 0)][1] == [[]] * 3  # a one-token prompt has no position to score
    assert not any(out[("plain", 0)][1])
    assert set(ex.scored.values()) == {1} and {s for s, _ in ex.scored} == {"long/0"}  # scored once
    mem.check_integrity()
    loop.close()


def test_a_cached_prompt_is_computed_again_for_prompt_logprobs():
    loop, mem, ex = make()
    p = prompts(1, lo=14, hi=14, seed=4)[0]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, seed=1)
    loop.add_request("first", p, greedy)
    run(loop)
    loop.add_request("scored", p, SamplingParams(max_tokens=2, temperature=0.0, seed=1, prompt_logprobs=2))
    tokens, scored, cached = run(loop)[("scored", 0)]
    assert cached == 0 and scored[0] == [entry(p, q) for q in range(13)]
    assert tokens == expected(p, 2, 1)
    loop.add_request("again", p, greedy)
    assert run(loop)[("again", 0)][2] == 12  # the cache still serves everyone else
    mem.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_by_recompute_never_delivers_them_twice(overlap):
    loop, mem, ex = make(num_blocks=24, overlap=overlap)
    ps = prompts(8, lo=10, hi=20, seed=3)
    for i, p in enumerate(ps):
        loop.add_request(str(i), p, SamplingParams(max_tokens=30, temperature=0.0, seed=7, prompt_logprobs=0))
    out = run(loop)
    assert loop.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        tokens, scored, _ = out[(str(i), 0)]
        assert tokens == expected(p, 30, 7)
        assert scored[0] == [entry(p, q) for q in range(len(p) - 1)] and not any(scored[1:])
    # recomputed after its prompt was scored: not scored again (the request stopped asking)
    assert max(ex.scored.values()) == 1
    mem.check_integrity()
    loop.close()


def test_a_sequence_keeps_each_position_once():
    seq = Sequence("a/0", "a", 0, [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0), 0, 10, 0.0)
    e = [PromptLogprob(t, -1.0, 1) for t in (2, 3, 4, 5)]
    seq.add_prompt_logprobs(1, e[:2])
    seq.add_prompt_logprobs(1, e[:3])  # recomputed from the start, one more position
    seq.add_prompt_logprobs(4, e[3:])
    seq.add_prompt_logprobs(1, e)
    assert seq.prompt_logprobs == e
    assert Sequence("b/0", "b", 0, [1], SamplingParams(), 0, 10, 0.0).prompt_logprobs is None
