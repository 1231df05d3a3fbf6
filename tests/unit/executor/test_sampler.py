"""The sampler: greedy, truncation, penalties, seeded reproducibility, logprobs."""
import math

import numpy as np
import pytest
import torch

from pagedserve.executor.sampler import (
    Sampler,
    apply_penalties,
    apply_truncation,
    mix_seed,
)
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()
BS = 16


def seq(params: SamplingParams, seed=0, pos=10, seq_id="s", prompt=(), output=(), sample=True):
    """A sequence whose step computes its last token so far and samples the next one.
    `prompt` and `output`: its tokens so far (the penalties' history); without them, a
    prompt of `pos` tokens 1, so that the new token goes at position `pos`."""
    prompt, output = list(prompt), list(output)
    if not prompt and not output:
        prompt = [1] * pos
    so_far = prompt + output
    return Seq(seq_id, so_far[-1:], len(so_far) - 1, [0] * -(-len(so_far) // BS), sample, params, seed,
               prompt, output)


def sample(sampler, logits, seqs):
    """The sampler over a batch of `seqs`, every row sampling."""
    return sampler(logits, batch_of(seqs, BS), np.arange(len(seqs)))


def draw(logits, params, n, seed=0):
    """n samples, each from a different position so the randomness differs."""
    sampler = Sampler()
    return [sample(sampler, logits[None], [seq(params, seed=seed, pos=p + 1)])[0].token_id for p in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq(SamplingParams(temperature=0.0), seed=i, seq_id=str(i)) for i in range(6)]
    out = sample(Sampler(), logits, seqs)
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()
    assert [o.seq_id for o in out] == [str(i) for i in range(6)]
    assert all(o.logprob is None and o.top_logprobs == [] for o in out)


def test_sampling_follows_the_softmax():
    tokens = draw(LOGITS, SamplingParams(temperature=1.0), 4000)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    assert torch.allclose(freq, PROBS, atol=0.03), freq


def test_low_temperature_sharpens():
    tokens = draw(LOGITS, SamplingParams(temperature=0.2), 500)
    assert tokens.count(0) > 0.9 * len(tokens)


@pytest.mark.parametrize("params,support", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.75), {0, 1}),
    (SamplingParams(top_p=0.9), {0, 1, 2}),
    (SamplingParams(top_p=0.4), {0}),
    (SamplingParams(min_p=0.2), {0, 1, 2}),
    (SamplingParams(min_p=0.5), {0, 1}),
    (SamplingParams(top_k=3, top_p=0.7), {0, 1}),
])
def test_truncation_support(params, support):
    t = apply_truncation(LOGITS[None].clone(), torch.tensor([params.top_k]),
                         torch.tensor([params.top_p]), torch.tensor([params.min_p]))
    assert set(torch.isfinite(t[0]).nonzero().flatten().tolist()) == support
    assert torch.equal(t[0][list(support)], LOGITS[list(support)])
    assert set(draw(LOGITS, params, 300)) == support


def test_truncation_is_per_row():
    logits = LOGITS.repeat(3, 1)
    t = apply_truncation(logits, torch.tensor([1, 0, 0]), torch.tensor([1.0, 0.75, 1.0]),
                         torch.tensor([0.0, 0.0, 0.0]))
    assert torch.isfinite(t).sum(-1).tolist() == [1, 2, 4]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[1, 3]])
    assert logits[0].tolist() == [1.0, -4.0, 1.0, -2.0, 0.5]


def test_frequency_and_presence_penalties_openai_semantics():
    logits = torch.zeros(1, 5)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    apply_penalties(logits, [params], [[4, 4]], [[1, 1, 1, 2]])
    assert logits[0].tolist() == [0.0, -2.5, -1.5, 0.0, 0.0]  # prompt tokens are not penalised


def test_penalties_apply_only_to_their_row():
    logits = torch.ones(2, 5)
    apply_penalties(logits, [SamplingParams(), SamplingParams(presence_penalty=1.0)], [[], []], [[], [0]])
    assert logits[0].tolist() == [1.0] * 5 and logits[1].tolist() == [0.0, 1, 1, 1, 1]


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert sample(Sampler(), logits, [seq(params, output=[0])])[0].token_id == 1


def test_seeded_tokens_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 1000, generator=g)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    mine = [seq(params, seed=100 + i, pos=7 + i, seq_id=f"s{i}") for i in range(8)]
    alone = [sample(Sampler(), logits[i:i + 1], [mine[i]])[0].token_id for i in range(8)]
    others = [seq(SamplingParams(temperature=0.7, top_k=5), seed=5, seq_id=f"x{k}") for k in range(3)]
    mixed = sample(Sampler(), torch.cat([torch.randn(3, 1000, generator=g), logits.flip(0)]), others + mine[::-1])
    assert [o.token_id for o in mixed[3:]] == alone[::-1]
    again = sample(Sampler(), logits, mine)
    assert [o.token_id for o in again] == alone


def test_seed_and_position_both_matter():
    logits = torch.zeros(1, 1000)
    by_seed = {sample(Sampler(), logits, [seq(SamplingParams(), seed=s, pos=3)])[0].token_id for s in range(20)}
    by_pos = {sample(Sampler(), logits, [seq(SamplingParams(), seed=3, pos=p + 1)])[0].token_id for p in range(20)}
    assert len(by_seed) > 15 and len(by_pos) > 15
    assert mix_seed(1, 2) != mix_seed(2, 1) and 0 <= mix_seed(-5, 3) < 2**63


def test_logprobs_are_log_softmax_of_the_processed_distribution():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=0), seq_id="a"),
            seq(SamplingParams(temperature=0.5, logprobs=5), seed=9, seq_id="b"),
            seq(SamplingParams(temperature=1.0, top_k=3, logprobs=5), seed=4, seq_id="c")]
    out = sample(Sampler(), logits, seqs)
    expected0 = logits[0].log_softmax(-1)
    assert out[0].logprob == pytest.approx(expected0.max().item(), abs=1e-6) and out[0].top_logprobs == []
    expected1 = (logits[1] / 0.5).log_softmax(-1)
    assert out[1].logprob == pytest.approx(expected1[out[1].token_id].item(), abs=1e-6)
    values, ids = expected1.topk(5)
    assert [t for t, _ in out[1].top_logprobs] == ids.tolist()
    assert [v for _, v in out[1].top_logprobs] == pytest.approx(values.tolist(), abs=1e-6)
    top3 = logits[2].topk(3)
    expected2 = top3.values.log_softmax(-1)
    assert [t for t, _ in out[2].top_logprobs] == top3.indices.tolist()  # only the 3 kept tokens
    assert [v for _, v in out[2].top_logprobs] == pytest.approx(expected2.tolist(), abs=1e-6)
    assert sum(math.exp(v) for _, v in out[2].top_logprobs) == pytest.approx(1.0, abs=1e-5)


def test_min_tokens_masks_eos_and_stop_ids_until_reached_per_row():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 3)  # token 1 (EOS) then 2 (a stop id) lead
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    seqs = [seq(sp, output=[3], seq_id="short"), seq(sp, output=[3, 3], seq_id="reached"),
            seq(SamplingParams(temperature=0.0), seq_id="plain")]
    out = sample(Sampler(eos_token_ids=[1]), logits, seqs)
    assert [o.token_id for o in out] == [3, 1, 1]


def test_min_tokens_leaves_a_row_whose_only_allowed_token_is_a_stop():
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf")]])  # a grammar allows only EOS
    out = sample(Sampler(eos_token_ids=[1]), logits, [seq(SamplingParams(temperature=0.5, min_tokens=5))])
    assert out[0].token_id == 1


def test_min_tokens_masks_in_logprobs_too_and_ignores_ids_past_the_vocabulary():
    sp = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[99], logprobs=2)
    out = sample(Sampler(eos_token_ids=[0]), LOGITS[None], [seq(sp)])
    assert out[0].token_id != 0 and all(t != 0 for t, _ in out[0].top_logprobs)


def test_logit_bias_moves_the_choice_per_row_and_skips_ids_past_the_vocabulary():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 2)
    biased = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 3: 3.5, 10**6: 100.0}, logprobs=0)
    out = sample(Sampler(), logits, [seq(biased, seq_id="b"), seq(SamplingParams(temperature=0.0), seq_id="p")])
    assert [o.token_id for o in out] == [3, 1]
    expected = torch.tensor([0.0, -95.0, 4.0, 4.5]).log_softmax(-1)[3]
    assert math.isclose(out[0].logprob, float(expected), rel_tol=1e-5)  # drawn from the biased distribution


def test_min_tokens_restores_only_the_rows_left_with_nothing_else():
    inf = float("-inf")
    logits = torch.tensor([[inf, 2.0, inf, inf], [1.0, 2.0, inf, 0.5]])  # row 0: a grammar's end
    sp = SamplingParams(temperature=0.0, min_tokens=3)
    out = sample(Sampler(eos_token_ids=[1]), logits, [seq(sp, seq_id="a"), seq(sp, seq_id="b")])
    assert [o.token_id for o in out] == [1, 0]


def test_min_tokens_counts_the_output_the_running_set_holds():
    """The history is the running set's: prompt and output as of this step, the step's token included."""
    sp = SamplingParams(temperature=0.0, min_tokens=3)
    b = batch_of([seq(sp, prompt=[3, 3], output=[3, 3], seq_id="a")], BS)
    assert b.prompt_of(0) == [3, 3] and b.output_of(0) == [3, 3]
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    assert Sampler(eos_token_ids=[1])(logits, b, np.arange(1))[0].token_id == 2  # 2 of 3: EOS masked
    b = batch_of([seq(sp, prompt=[3, 3], output=[3, 3, 3], seq_id="a")], BS)
    assert Sampler(eos_token_ids=[1])(logits, b, np.arange(1))[0].token_id == 1


@pytest.mark.parametrize("plain", [True, False])
def test_rows_pick_the_batch_rows_the_logits_are_of(plain):
    """Logits row k is batch row rows[k]: its id, sampling parameters, seed and position."""
    drawn = SamplingParams(temperature=0.0) if plain else SamplingParams(temperature=1.0, logprobs=0)
    seqs = [seq(SamplingParams(temperature=0.0), seq_id="a"),
            seq(SamplingParams(temperature=0.0), seq_id="chunk", sample=False),
            seq(drawn, seed=7, pos=12, seq_id="c")]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(4))
    out = Sampler()(logits, batch_of(seqs, BS), np.array([0, 2]))
    assert [o.seq_id for o in out] == ["a", "c"] and out[0].token_id == logits[0].argmax().item()
    alone = sample(Sampler(), logits[1:], [seqs[2]])[0]
    assert out[1] == alone and (out[1].logprob is None) == plain


def _sorted_truncation(logits, top_k, top_p, min_p):
    """The definition, with a full sort per row: top-k, top-p, min-p, each on what the last left."""
    out = torch.full_like(logits, float("-inf"))
    for r in range(logits.shape[0]):
        values, order = logits[r].sort(descending=True)
        if top_k[r] > 0:
            values[top_k[r]:] = float("-inf")
        if top_p[r] < 1:
            probs = values.softmax(-1)
            values[probs.cumsum(-1) - probs >= top_p[r]] = float("-inf")
        if min_p[r] > 0:
            probs = values.softmax(-1)
            values[probs < min_p[r] * probs[0]] = float("-inf")
        out[r, order] = values
    return out


@pytest.mark.parametrize("vocab", [7, 3000])
def test_truncation_matches_a_full_sort(vocab):
    """Among candidates, with the rows whose 1,024 candidates miss top_p sorted whole: the
    same tokens kept as the full sort's, on flat and peaked rows alike."""
    rng = np.random.default_rng(vocab)
    rows = 40
    scale = np.where(np.arange(rows) % 2, 0.05, 4.0)[:, None]  # flat rows need more than 1,024 tokens
    logits = torch.from_numpy((rng.standard_normal((rows, vocab)) * scale).astype(np.float32))
    top_k = rng.choice([0, 0, 1, 5, 2000], rows)
    top_p = rng.choice([1.0, 0.3, 0.9, 0.99], rows)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.5], rows)
    got, want = apply_truncation(logits, top_k, top_p, min_p), _sorted_truncation(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])


def test_truncation_sorts_whole_only_the_rows_whose_candidates_miss_top_p():
    flat, peaked = torch.zeros(1, 5000), torch.zeros(1, 5000)
    peaked[0, :10] = 20.0
    t = apply_truncation(torch.cat([flat, peaked]), np.array([0, 0]), np.array([0.4501, 0.45]), np.array([0.0, 0.0]))
    assert torch.isfinite(t).sum(-1).tolist() == [2251, 5]


@pytest.mark.parametrize("plain", [True, False])
def test_outputs_are_columns_and_only_a_row_with_logprobs_is_kept_whole(plain):
    """StepOutputs: every row's id and token in the columns; `more` holds exactly the rows
    that ask for logprobs (none on a plain greedy step), their tokens the same as in the column."""
    asks = SamplingParams(temperature=0.0 if plain else 1.0, logprobs=2)
    seqs = [seq(SamplingParams(temperature=0.0), seq_id="a"), seq(asks, seq_id="b"),
            seq(SamplingParams(temperature=0.0 if plain else 0.8), seed=3, seq_id="c")]
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    out = sample(Sampler(), logits, seqs)
    assert out.seq_ids == ["a", "b", "c"] and out.tokens == [o.token_id for o in out]
    assert sorted(out.more) == [1] and out.more[1].token_id == out.tokens[1] and len(out.more[1].top_logprobs) == 2
    greedy = sample(Sampler(), logits, [seq(SamplingParams(temperature=0.0), seq_id=s) for s in "abc"])
    assert not greedy.more and greedy.tokens == logits.argmax(-1).tolist()


def test_a_guided_sampler_masks_first_and_ignores_a_graphs_argmax():
    from pagedserve.executor.logits_mask import GuidedSampler

    class OnlyToken2:
        def prepare(self, batch, rows):
            return "mask"

        def apply(self, logits, pending):
            logits[:, [0, 1, 3]] = float("-inf")

    guided = GuidedSampler(Sampler(), OnlyToken2())
    batch = batch_of([seq(SamplingParams(temperature=0.0))], BS)
    out = guided.sample(LOGITS[None].clone(), batch, np.arange(1), greedy=torch.tensor([0])).outputs()
    assert out.tokens == [2] and guided.mask_steps == 1
