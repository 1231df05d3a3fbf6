"""Requests.deltas' plain-token rows (taken inline) give exactly what its general row
(`Requests._row`) gives: random workloads (stop strings, min_tokens, n > 1, logprobs beside
plain rows, a detokenizer that raises now and then, aborts between steps, plan ahead and
serial) run once as they are and once with every row taking the general way, and every
delta must be the same, field by field, and so must the requests and sequences left open
after each step; `Delta.make` makes what the constructor makes."""
import dataclasses
import random

import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import Delta, PromptLogprob, SampleOutput, SamplingParams
from tests.support.fake_executor import FakeExecutor


class LetterTokenizer:
    """Token i is one of six letters; a token of id 7 mod 97 cannot be decoded."""

    def decode(self, ids, skip_special_tokens=False):
        if any(i % 97 == 7 for i in ids):
            raise ValueError(f"no text for a token of {ids}")
        return "".join("abcdef"[i % 6] for i in ids)


class LogprobExecutor(FakeExecutor):
    """The fake executor, with a logprob for the requests whose id ends in 1."""

    def execute(self, batch):
        outputs = super().execute(batch)
        for k, seq_id in enumerate(outputs.seq_ids):
            if seq_id.split("/")[0].endswith("1"):
                token = outputs.tokens[k]
                outputs.put(k, SampleOutput(seq_id, token, logprob=-(token % 9) / 4))
        return outputs


def _workload(seed):
    rng = random.Random(seed)
    events = []
    for i in range(rng.randint(4, 10)):
        prompt = [rng.randrange(1, 900) for _ in range(rng.randint(2, 12))]
        stop = [rng.choice("abcdef") + rng.choice("abcdef") for _ in range(rng.randint(0, 2))]
        sp = SamplingParams(max_tokens=rng.randint(1, 30), temperature=1.0, seed=rng.randrange(99),
                            n=rng.choice([1, 1, 2]), stop=stop, min_tokens=rng.choice([0, 0, 3]),
                            ignore_eos=True)
        events.append((rng.randint(0, 8), f"r{i}", prompt, sp))
    for at, request_id, _, _ in rng.sample(events, rng.randint(0, 2)):
        events.append((at + rng.randint(1, 10), None, request_id, None))
    return sorted(events, key=lambda e: e[0])


def _run(seed, overlap, plain_rows):
    ex = LogprobExecutor(4)
    mem = MemoryManager(MemoryConfig(num_blocks=200, max_model_len=256))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    loop = BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, overlap=overlap),
                     LetterTokenizer())
    loop._requests.plain_rows = plain_rows
    events, log, step = _workload(seed), [], 0
    while events or loop.has_work():
        while events and events[0][0] <= step:
            _, request_id, prompt, sp = events.pop(0)
            if request_id is None:
                loop.abort(prompt)
            else:
                loop.add_request(request_id, prompt, sp)
        log += [dataclasses.astuple(d) for d in (loop.step() if loop.has_work() else [])]
        log.append(sorted((r, sorted(state.open)) for r, state in loop.requests.items()))
        log.append(sorted(loop.scheduler.seqs))
        step += 1
        assert step < 1000
    loop.close()
    mem.check_integrity()
    return log


@pytest.mark.parametrize("overlap", [True, False], ids=["plan-ahead", "serial"])
def test_plain_rows_give_what_the_general_row_gives(overlap):
    finishes = set()
    for seed in range(12):
        general = _run(seed, overlap, False)
        assert _run(seed, overlap, True) == general, seed
        finishes |= {d[4] for d in general if isinstance(d, tuple)}
    assert {"stop", "length", "refused", None} <= finishes  # stop strings, lengths, failed detokenizing


def test_make_is_the_constructor():
    rng = random.Random(3)
    for _ in range(20):
        args = (f"r{rng.randrange(9)}", rng.randrange(3), rng.choice(["", "ab", "é"]), [rng.randrange(99)],
                rng.choice([None, "stop", "length"]), [rng.random()], [[(1, -0.5)]],
                [PromptLogprob(5, -1.0, 1, [])], rng.randrange(50), rng.randrange(50), rng.randrange(50))
        made, built = Delta.make(*args), Delta(*args)
        assert made == built and made is not built
        names = [f.name for f in dataclasses.fields(Delta)]
        assert [getattr(made, n) for n in names] == [getattr(built, n) for n in names]
