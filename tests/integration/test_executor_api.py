"""The Executor object: model info, pool attachment, steps, reproducible seeded sampling."""
import re

import pytest
import torch

from tests.support.tiny_models import make_tiny_model
from pagedserve.executor import Executor
from pagedserve.wire.protocol import SamplingParams, SeqStep, StepBatch

BLOCK = 16


@pytest.fixture(scope="module")
def executor(default_model_dir):
    ex = Executor(None)
    ex.attach_pool(torch.zeros(ex.kv_geometry().pool_shape(40)))
    return ex


def step(seq_id, tokens, start, table, sample=True, params=None, seed=0):
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(tokens))]
    return SeqStep(seq_id, list(tokens), start, slots, list(table), sample,
                   params or SamplingParams(temperature=0.0), seed)


def generate(ex, prompt, table, n, params, seed, chunk=None, companions=()):
    """Decode n tokens for one sequence; `companions` are other sequences prefilled in the first step."""
    seq, out = list(prompt), []
    done = 0
    if chunk:
        assert ex.execute(StepBatch([step("s", prompt[:chunk], 0, table, sample=False)])) == []
        done = chunk
    for i in range(n):
        start = done if i == 0 else len(seq) - 1
        seqs = [step("s", seq[start:], start, table, params=params, seed=seed)]
        if i == 0:
            seqs = list(companions) + seqs
        token = ex.execute(StepBatch(seqs))[-1].token_id
        seq.append(token)
        out.append(token)
    return out


def test_model_info(executor, default_model_dir):
    info = executor.model_info()
    assert info.name == "SmolLM2-135M-Instruct"
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (49152, 8192, [2])
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert info.tokenizer_dir == default_model_dir
    kv = info.kv
    assert (kv.num_layers, kv.num_kv_heads, kv.head_size, kv.block_size, kv.dtype) == (30, 3, 64, 16, "float32")


def test_outputs_in_batch_order_and_only_for_sampling_sequences(executor):
    batch = StepBatch([
        step("x", [1, 2, 3, 4, 5], 0, [3]),
        step("y", list(range(100, 120)), 0, [7, 1], sample=False),
        step("z", [9, 8, 7], 0, [30], params=SamplingParams(temperature=0.0, logprobs=2)),
    ])
    out = executor.execute(batch)
    assert [o.seq_id for o in out] == ["x", "z"]
    assert out[0].logprob is None and out[1].logprob is not None and len(out[1].top_logprobs) == 2
    assert out[1].top_logprobs[0][0] == out[1].token_id


def test_seeded_sampling_survives_batching_and_recompute(executor):
    params = SamplingParams(temperature=0.9, top_p=0.95)
    prompt = [1, 4093, 198, 9519, 549, 253, 1345, 3897, 30, 2, 198, 1, 520, 9531, 198]
    alone = generate(executor, prompt, [11, 4], 6, params, seed=1234)
    others = [step("o1", list(range(300, 340)), 0, [20, 21, 22]),
              step("o2", [5, 6, 7], 0, [25], params=SamplingParams(temperature=1.0), seed=7)]
    batched = generate(executor, prompt, [2, 13], 6, params, seed=1234, companions=others)
    assert batched == alone
    # Recompute after preemption: prefill prompt + 3 generated tokens in two chunks, then continue.
    resumed = generate(executor, prompt + alone[:3], [9, 31, 17], 3, params, seed=1234, chunk=8)
    assert resumed == alone[3:]
    assert generate(executor, prompt, [11, 4], 6, params, seed=99) != alone


def test_reattach_pool(executor):
    before = executor.execute(StepBatch([step("a", [1, 2, 3], 0, [0])]))
    executor.attach_pool(torch.zeros(executor.kv_geometry().pool_shape(40)))
    assert executor.execute(StepBatch([step("a", [1, 2, 3], 0, [5])])) == before
    with pytest.raises(ValueError, match="block size"):
        executor.attach_pool(torch.zeros(4, 30, 2, 8, 3, 64))


def test_tiny_directory_without_tokenizer(tmp_path):
    make_tiny_model(tmp_path / "tiny-qwen3", "qwen3")
    ex = Executor(str(tmp_path / "tiny-qwen3"), dtype="bfloat16", block_size=4)
    info = ex.model_info()
    assert info.name == "tiny-qwen3" and info.chat_template is None and info.kv.dtype == "bfloat16"
    assert (info.kv.head_size, info.kv.num_kv_heads, info.kv.block_size) == (32, 2, 4)
    with pytest.raises(RuntimeError, match="attach_pool"):
        ex.execute(StepBatch([]))
    ex.attach_pool(torch.zeros(info.kv.pool_shape(8), dtype=torch.bfloat16))
    out = ex.execute(StepBatch([SeqStep("t", [1, 2, 3, 4, 5], 0, [12, 13, 14, 15, 4], [3, 1], True,
                                        SamplingParams(temperature=0.0), 0)]))
    assert len(out) == 1 and 0 <= out[0].token_id < info.vocab_size


@pytest.mark.parametrize("bad,match", [
    (dict(token_ids=[1, 49152]), "token ids"),
    (dict(token_ids=[-1, 3]), "token ids"),
    (dict(slot_mapping=[0, 40 * BLOCK]), "outside the pool"),
    (dict(block_table=[40]), "block ids"),
    (dict(start_pos=15, slot_mapping=[15, 16]), "blocks in its table"),
])
def test_an_out_of_range_sequence_is_left_out_and_the_others_run_as_alone(executor, bad, match):
    alone = executor.execute(StepBatch([step("ok", [5, 6, 7], 0, [2])]))
    s = SeqStep("bad", [1, 2], 0, [0, 1], [0], False, SamplingParams(temperature=0.0), 0)  # reports nothing
    for k, v in bad.items():
        setattr(s, k, v)
    out = executor.execute(StepBatch([s, step("ok", [5, 6, 7], 0, [2])]))
    assert [o.seq_id for o in out] == ["bad", "ok"]
    assert out[0].error and re.search(match, out[0].error) and not out[0].sampled
    assert out[1].token_id == alone[0].token_id and not out[1].error
    with pytest.raises(ValueError, match="empty"):
        executor.execute(StepBatch([]))


def test_a_sequence_whose_grammar_does_not_compile_fails_alone(executor):
    alone = executor.execute(StepBatch([step("ok", [5, 6, 7], 0, [3])]))
    bad = step("bad", [1, 2], 0, [4], params=SamplingParams(temperature=0.0, guided_kind="regex",
                                                            guided_spec="(unclosed"))
    out = executor.execute(StepBatch([bad, step("ok", [5, 6, 7], 0, [3])]))
    assert [o.seq_id for o in out] == ["bad", "ok"]
    assert "grammar" in out[0].error and not out[0].sampled
    assert out[1].token_id == alone[0].token_id and not out[1].error
