"""A BatchLoop over a real MemoryManager and the model-free FakeExecutor, and helpers to run
it to the end and to compute the tokens the fake executor must produce."""
import random

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_executor import FakeExecutor, reference_next


def make_loop(num_blocks=64, block_size=4, prefix=True, max_num_seqs=16, max_tokens_step=64,
              max_model_len=4096):
    ex = FakeExecutor(block_size, max_model_len)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, prefix_caching=prefix,
                                     max_model_len=max_model_len))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    loop = BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=max_num_seqs,
                                              max_num_batched_tokens=max_tokens_step, overlap=False))
    return loop, mem, ex


def expected(prompt, n_out, seed):
    ctx = list(prompt)
    for _ in range(n_out):
        ctx.append(reference_next(ctx, seed))
    return ctx[len(prompt):]


def run_all(loop):
    out = {}
    for _ in range(10_000):
        if not loop.has_work():
            break
        for d in loop.step():
            out.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    assert not loop.has_work()
    return out


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, seed=7)


def prompts(k, lo=3, hi=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(998) for _ in range(rng.randint(lo, hi))] for _ in range(k)]
