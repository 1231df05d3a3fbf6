"""Beam search: the same beams as transformers' generate on the default model; beams fork
and free blocks through memsvc (checked slot by slot with a model-free executor, under
preemption); the scoring rules on a hand-made example."""
import hashlib
import random

import pytest
import torch

from pagedserve.gateway.beam_search import BeamSearch, num_candidates
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from tests.support.fake_executor import EOS, FakeExecutor
from tests.support.fake_loop import expected, run_all


def test_beam_width_4_matches_transformers(default_model_dir, hf_default):
    from pagedserve.engine import LLMEngine

    tok, model = hf_default
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = [tok.encode("The capital of France is", add_special_tokens=False), list(chat)]
    new_tokens = 12
    expected_beams = []
    for x in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([x]), max_new_tokens=new_tokens, num_beams=4,
                                 num_return_sequences=4, early_stopping=True, do_sample=False,
                                 return_dict_in_generate=True, pad_token_id=0)
        lengths = (out.beam_indices >= 0).sum(1).tolist()
        expected_beams.append([out.sequences[i, len(x) : len(x) + n].tolist() for i, n in enumerate(lengths)])
    assert any(b[-1] == 2 for beams in expected_beams for b in beams)  # some beam ends at EOS

    engine = LLMEngine(model=default_model_dir, block_size=4, kv_tokens=2048)
    sp = SamplingParams(max_tokens=new_tokens, beam_width=4, n=4, early_stopping=True)
    outputs = engine.generate(prompts, sp)
    assert [[c.token_ids for c in o.completions] for o in outputs] == expected_beams
    engine.memory.check_integrity()
    assert engine.memory.stats().snapshot["blocks_referenced"] == 0


def candidates(context: list[int], k: int) -> list[tuple[int, float]]:
    """A deterministic made-up next-token distribution over a context: k tokens, EOS among
    them a third of the time."""
    rng = random.Random(hashlib.blake2b(repr(context).encode(), digest_size=8).digest())
    tokens = rng.sample(range(EOS), k)
    if rng.random() < 0.33:
        tokens[rng.randrange(k)] = EOS
    logprobs = sorted((-(0.1 + 0.6 * j + 0.5 * rng.random()) for j in range(k)), reverse=True)
    return list(zip(tokens, logprobs))


class BeamFakeExecutor(FakeExecutor):
    """FakeExecutor whose samples carry `candidates` of the context read from the pool."""

    def execute(self, batch):
        outs = {o.seq_id: o for o in super().execute(batch)}
        bs = self.info.kv.block_size
        pool = self.pool[:, 0, 0, :, 0, 0]
        sampled = batch.sample.nonzero()[0].tolist()
        for i in sampled:
            k = batch.sampling(i).logprobs
            if k:
                n = int(batch.start_pos[i] + batch.num_tokens[i])
                table = batch.block_tables[i]
                context = [int(pool[table[p // bs], p % bs]) for p in range(n)]
                outs[batch.seq_ids[i]].top_logprobs = candidates(context, k)
        return [outs[batch.seq_ids[i]] for i in sampled]


def reference_beams(prompt: list[int], sp: SamplingParams) -> list[list[int]]:
    """The same search over plain token lists, no cache."""
    search = BeamSearch(sp, "0", max_new_tokens=sp.max_tokens, is_stop=lambda t: t == EOS)
    k = num_candidates(sp.beam_width, 1)
    names = iter(range(1, 10**6))
    while True:
        for beam in search.beams:
            search.report(beam.seq_id, candidates(prompt + beam.token_ids, k))
        continuations = search.advance()
        if search.done:
            return [h.token_ids for h in search.results()]
        seen: set[str] = set()
        ids = []
        for c in continuations:
            ids.append(c.parent_id if c.parent_id not in seen else str(next(names)))
            seen.add(c.parent_id)
        search.commit(ids)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode, num_blocks, host_blocks, releases", [
    ("swap", 256, None, False),  # no preemption
    ("swap", 24, 16, True),  # swaps, recompute when the swap space is full, idle beams released
    ("recompute", 24, None, True),
])
def test_beams_fork_and_free_blocks_through_memsvc(mode, num_blocks, host_blocks, releases, overlap):
    from pagedserve.gateway.batch_loop import BatchLoop
    from pagedserve.gateway.scheduler_config import SchedulerConfig

    ex = BeamFakeExecutor(4)
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, preemption_mode=mode, num_host_blocks=host_blocks))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    loop = BatchLoop(mem, ex, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=48, overlap=overlap))
    rng = random.Random(1)
    system = [rng.randrange(998) for _ in range(10)]
    reqs = []
    for i in range(6):
        p = system + [rng.randrange(998) for _ in range(rng.randint(1, 9))]
        sp = SamplingParams(max_tokens=rng.randint(6, 14), beam_width=rng.choice([2, 3, 4]), n=2,
                            length_penalty=rng.choice([1.0, 0.5, 2.0]),
                            early_stopping=rng.random() < 0.5)
        loop.add_request(f"beam{i}", p, sp)
        reqs.append((p, sp))
    loop.add_request("plain", system + [7], SamplingParams(max_tokens=20, temperature=0.0, seed=3))
    most = 0
    out = {}
    while loop.has_work():
        for d in loop.step():
            out.setdefault((d.request_id, d.index), []).extend(d.token_ids)
        most = max(most, len(mem.allocator.sequence_ids()) - len(loop.scheduler.to_free))
        mem.check_integrity()
    assert most <= sum(sp.beam_width for _, sp in reqs) + 1  # pruned beams are being freed
    for i, (p, sp) in enumerate(reqs):
        assert [out[(f"beam{i}", j)] for j in range(2)] == reference_beams(p, sp), i
    assert out[("plain", 0)] == expected(system + [7], 20, 3)
    stats = mem.stats()
    assert stats.snapshot["blocks_referenced"] == 0 and stats.num_sequences == 0
    counts = stats.preemption
    if num_blocks < 256:
        assert counts["num_swapped_out" if mode == "swap" else "num_recomputed"] > 0
    if host_blocks:
        assert counts["num_swap_fallbacks"] > 0
    assert (loop.scheduler.num_beam_releases > 0) == releases


class _Scripted:
    """Candidates by generated prefix (a tuple), for the hand-made example."""

    def __init__(self, table):
        self.table = table

    def run(self, search):
        while True:
            for beam in search.beams:
                search.report(beam.seq_id, self.table[tuple(beam.token_ids)])
            continuations = search.advance()
            if search.done:
                return search.results()
            search.commit([f"{c.parent_id}.{c.token_id}" for c in continuations])


def test_scoring_length_penalty_and_early_stopping():
    E = 0  # EOS
    table = {
        (): [(1, -0.1), (E, -1.0), (2, -1.2), (3, -3.0)],
        (1,): [(E, -1.5), (4, -0.5), (5, -2.0), (6, -4.0)],
        (2,): [(E, -0.1), (7, -2.0), (8, -3.0), (9, -5.0)],
        (1, 4): [(E, -0.2), (5, -0.3), (6, -4.0), (7, -5.0)],
        (1, 5): [(E, -0.2), (5, -3.0), (6, -4.0), (7, -5.0)],
        (2, 7): [(E, -0.1), (5, -3.0), (6, -4.0), (7, -5.0)],
        (1, 4, 5): [(E, -0.15), (5, -3.0), (6, -4.0), (7, -5.0)],
        (1, 4, 6): [(E, -1.0), (5, -1.0), (6, -1.0), (7, -1.0)],
    }

    def search(**kw):
        sp = SamplingParams(beam_width=2, n=2, **kw)
        return BeamSearch(sp, "r", max_new_tokens=10, is_stop=lambda t: t == E)

    # step 1 keeps 1 (-0.1) and 2 (-1.2); [E] (-1.0) is second, so it finishes with -1.0 / 1.
    # step 2 ranks 1,4 (-0.6); 2,E (-1.3); 1,E (-1.6); ... -> [2,E] finishes (-0.65), and the
    # two best hypotheses are now [2,E] and [E]: early stopping ends the search there.
    best = _Scripted(table).run(search(early_stopping=True))
    assert [(h.token_ids, round(h.score, 4), h.finish_reason) for h in best] == [
        ([2, E], -0.65, "stop"), ([E], -1.0, "stop")]
    # without early stopping the running beams go on while they can still win: [1,4,E]
    # scores -0.8 / 3, then [1,4,5,E] -1.05 / 4, and the best running beam (-3.9 / 4) cannot
    # beat the worst of those two
    best = _Scripted(table).run(search(early_stopping=False))
    assert [h.token_ids for h in best] == [[1, 4, 5, E], [1, 4, E]]
    assert [h.score for h in best] == pytest.approx([-1.05 / 4, -0.8 / 3])
    # a length penalty of 0 ranks by the plain sum of logprobs: short hypotheses win
    best = _Scripted(table).run(search(early_stopping=False, length_penalty=0.0))
    assert [h.token_ids for h in best] == [[1, 4, E], [E]]


def test_beam_requests_are_validated():
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams(beam_width=11).validate()
    with pytest.raises(ValueError, match="n=5 exceeds beam_width=4"):
        SamplingParams(beam_width=4, n=5).validate()
    SamplingParams(beam_width=4, n=4).validate()
    out = SampleOutput("x", 1, top_logprobs=[(1, -0.5)])
    assert out.top_logprobs == [(1, -0.5)]
