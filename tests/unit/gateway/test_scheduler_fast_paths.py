"""The scheduler's steady-decode fast paths (`Scheduler._steady_run`, `_sampled_in_order`,
`_sampled_steady`, `_granted_as_planned`) give exactly what its general path gives: random
workloads (chunked prefill, n > 1 forks, beam search, prompt logprobs, stop tokens,
max_tokens and model-length ends, aborts between steps and within one, preemption by swap
and by recompute, plan ahead and serial) run once as they are and once with the fast paths
declined, and every plan, batch, update and delta must be the same."""
import random

import pytest

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.beam_search import BeamDone
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import PromptLogprob, SampleOutput, SamplingParams
from tests.support.fake_executor import EOS, VOCAB, FakeExecutor
from tests.support.fake_loop import expected


class RichExecutor(FakeExecutor):
    """The fake executor, with an end-of-sequence token now and then, logprobs and top
    logprobs (beam search's candidates; none for the plain requests, those of even number)
    and the prompt logprobs each step asks for."""

    def execute(self, batch):
        sampled = iter(super().execute(batch))
        out = []
        for i, seq_id in enumerate(batch.seq_ids):
            prompt = batch.prompt_of(i)
            entries = [PromptLogprob(prompt[p + 1], -(p + 1) / 8, 1, [])
                       for p in batch.prompt_logprob_positions(i)]
            if batch.sample[i]:
                o = next(sampled)
                if o.token_id % 13 == 0:
                    o.token_id = EOS
                if not _plain(seq_id):
                    o.logprob = -(o.token_id % 7) / 4
                    o.top_logprobs = [((o.token_id + k * 37) % (VOCAB - 1), -(k + (o.token_id % 5) / 10))
                                      for k in range(8)]
                o.prompt_logprobs = entries
                out.append(o)
            elif entries:
                out.append(SampleOutput(seq_id, -1, sampled=False, prompt_logprobs=entries))
        return out


def _plain(seq_id):
    """A sequence of a request of even number that is no beam search's: its outputs carry
    its token alone."""
    request, _, index = seq_id.partition("/")
    return not index.startswith("b") and int(request[1:]) % 2 == 0


def _workload(seed):
    """(step at which to act, request id or None for an abort, prompt, sampling) events;
    seeds from 100 on: long plain requests decoding together, some aborted meanwhile."""
    rng = random.Random(seed)
    events = []
    if seed >= 100:
        for i in range(rng.randint(3, 7)):
            sp = SamplingParams(max_tokens=40, temperature=0.0, seed=7, ignore_eos=True)
            events.append((0, f"r{i}", [rng.randrange(1, 900) for _ in range(4)], sp))
        for i in rng.sample(range(len(events)), 2):
            events.append((rng.randint(4, 30), None, f"r{i}", None))
        return sorted(events, key=lambda e: e[0])
    for i in range(rng.randint(6, 14)):
        prompt = [rng.randrange(1, 900) for _ in range(rng.randint(2, 40))]
        kind = rng.random()
        max_tokens = rng.randint(1, 24)
        if kind < 0.15:
            sp = SamplingParams(max_tokens=max_tokens, beam_width=rng.choice([2, 3]), n=2, seed=7)
        elif kind < 0.3:
            sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=rng.randrange(99),
                                n=rng.randint(2, 3))
        elif kind < 0.4:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7, prompt_logprobs=1)
        elif kind < 0.55:
            stop = expected(prompt, 6, 7)[rng.randrange(6)]
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7, stop_token_ids=[stop])
        else:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7, ignore_eos=kind < 0.8)
        events.append((rng.randint(0, 12), f"r{i}", prompt, sp))
    for at, request_id, _, _ in rng.sample(events, rng.randint(1, 4)):  # mostly while it runs
        events.append((at + rng.randint(1, 10), None, request_id, None))
    return sorted(events, key=lambda e: e[0])


def _snapshot_plan(plan):
    if plan is None:
        return None
    return ([(e.seq_id, list(e.token_ids), e.max_len, e.max_new_tokens, e.skip_prefix_cache)
             for e in plan.entries], list(plan.free), list(plan.forks), plan.ahead, list(plan.fills),
            list(plan.run_ids), list(plan.run_counts), list(plan.run_tokens))


def _snapshot_step(step):
    return (list(step.seq_ids), list(step.start_pos), list(step.num_tokens), list(step.token_ids),
            list(step.sample), list(step.table_start), list(step.num_new_blocks), list(step.new_blocks),
            [s.seq_id if s is not None else None for s in step.seqs], list(step.copies))


def _snapshot_update(u):
    if isinstance(u, BeamDone):
        return u
    return (u.seq.seq_id, u.token_id, u.logprob, u.top_logprobs, u.finished, u.prompt_logprobs, u.error)


def _run(seed, overlap, mode, num_blocks, fast, counts):
    ex = RichExecutor(4, max_model_len=48)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, max_model_len=48, preemption_mode=mode,
                                     num_host_blocks=64))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, overlap=overlap)
    loop = BatchLoop(mem, ex, config)
    sched = loop.scheduler
    log = []
    steady, in_order, chained = sched._steady_run, sched._sampled_in_order, sched._sampled_steady
    plan, on_reserved, on_sampled = sched.plan, sched.on_reserved, sched.on_sampled

    def steady_run(*args):
        made = steady(*args) if fast else None
        counts["steady"] += made is not None
        return made

    def sampled_in_order(*args):
        took = in_order(*args) if fast else False
        counts["in_order"] += took
        return took
    def sampled_steady(*args):
        took = chained(*args)
        counts["chained"] += took
        updates = args[-1]
        if took:  # rows of a plain token alone, and with logprobs
            counts["plain"] += len(updates) - len(updates.more)
            counts["more"] += len(updates.more)
        return took
    sched._steady_run, sched._sampled_in_order = steady_run, sampled_in_order
    if not fast:
        sched._granted_as_planned = lambda *args: None
    sched._sampled_steady = sampled_steady

    def planned(*args, **kw):
        made = plan(*args, **kw)
        log.append(("plan", _snapshot_plan(made)))
        return made

    def reserved(*args, **kw):
        step, rejected = on_reserved(*args, **kw)
        log.append(("step", _snapshot_step(step), [s.seq_id for s in rejected]))
        return step, rejected

    def sampled(*args):
        updates = on_sampled(*args)
        log.append(("updates", [_snapshot_update(u) for u in updates]))
        return updates
    sched.plan, sched.on_reserved, sched.on_sampled = planned, reserved, sampled
    within, deltas_of = [], loop._deltas

    def deltas(updates):  # as a stop string's abort: between a plan made ahead and its answer
        while within:
            loop.abort(within.pop())
        return deltas_of(updates)
    loop._deltas = deltas
    events = _workload(seed)
    step = 0
    while events or loop.has_work():
        while events and events[0][0] <= step:
            at, request_id, prompt, sp = events.pop(0)
            if request_id is None and at % 2:
                within.append(prompt)
            elif request_id is None:
                loop.abort(prompt)
            else:
                loop.add_request(request_id, prompt, sp)
        for d in loop.step() if loop.has_work() else []:
            log.append(("delta", d.request_id, d.index, d.text, d.token_ids, d.finish_reason,
                        d.logprobs, d.top_logprobs, d.prompt_logprobs, d.error))
        step += 1
        assert step < 2000
    loop.close()
    mem.check_integrity()
    return log


@pytest.mark.parametrize("overlap", [True, False], ids=["plan-ahead", "serial"])
@pytest.mark.parametrize("mode,num_blocks", [("swap", 20), ("recompute", 20), ("auto", 200)])
def test_fast_paths_give_what_the_general_path_gives(overlap, mode, num_blocks):
    taken = dict.fromkeys(["steady", "in_order", "chained", "plain", "more"], 0)
    for seed in [*range(8), 100, 101, 102]:
        general = _run(seed, overlap, mode, num_blocks, False, dict(taken))
        assert _run(seed, overlap, mode, num_blocks, True, taken) == general, seed
    assert taken["in_order"] > 0 and taken["chained"] > 0 and taken["plain"] > 0 and taken["more"] > 0
    if overlap:
        assert taken["steady"] > 0  # the fast plan ran (plan ahead only)
