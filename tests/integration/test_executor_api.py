"""The Executor object: model info, pool attachment, steps, reproducible seeded sampling."""
import re

import pytest
import torch

from tests.support.tiny_models import make_tiny_model
from pagedserve.executor import Executor
from pagedserve.step.step_batch import StepBatch, empty_batch
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def executor(default_model_dir):
    ex = Executor(None)
    ex.attach_pool(torch.zeros(ex.kv_geometry().pool_shape(40)))
    return ex


def step(seq_id, tokens, start, table, sample=True, params=None, seed=0):
    return Seq(seq_id, list(tokens), start, list(table), sample, params or SamplingParams(temperature=0.0), seed)


def batch(*seqs: Seq) -> StepBatch:
    return batch_of(list(seqs), BLOCK)


def generate(ex, prompt, table, n, params, seed, chunk=None, companions=()):
    """Decode n tokens for one sequence; `companions` are other sequences prefilled in the first step."""
    seq, out = list(prompt), []
    done = 0
    if chunk:
        assert ex.execute(batch(step("s", prompt[:chunk], 0, table, sample=False))) == []
        done = chunk
    for i in range(n):
        start = done if i == 0 else len(seq) - 1
        seqs = [step("s", seq[start:], start, table, params=params, seed=seed)]
        if i == 0:
            seqs = list(companions) + seqs
        token = ex.execute(batch(*seqs))[-1].token_id
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
    out = executor.execute(batch(
        step("x", [1, 2, 3, 4, 5], 0, [3]),
        step("y", list(range(100, 120)), 0, [7, 1], sample=False),
        step("z", [9, 8, 7], 0, [30], params=SamplingParams(temperature=0.0, logprobs=2)),
    ))
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
    before = executor.execute(batch(step("a", [1, 2, 3], 0, [0])))
    executor.attach_pool(torch.zeros(executor.kv_geometry().pool_shape(40)))
    assert executor.execute(batch(step("a", [1, 2, 3], 0, [5]))) == before
    with pytest.raises(ValueError, match="block size"):
        executor.attach_pool(torch.zeros(4, 30, 2, 8, 3, 64))


def test_tiny_directory_without_tokenizer(tmp_path):
    make_tiny_model(tmp_path / "tiny-qwen3", "qwen3")
    ex = Executor(str(tmp_path / "tiny-qwen3"), dtype="bfloat16", block_size=4)
    info = ex.model_info()
    assert info.name == "tiny-qwen3" and info.chat_template is None and info.kv.dtype == "bfloat16"
    assert (info.kv.head_size, info.kv.num_kv_heads, info.kv.block_size) == (32, 2, 4)
    with pytest.raises(RuntimeError, match="attach_pool"):
        ex.execute(empty_batch())
    ex.attach_pool(torch.zeros(info.kv.pool_shape(8), dtype=torch.bfloat16))
    out = ex.execute(batch_of([Seq("t", [1, 2, 3, 4, 5], 0, [3, 1])], 4))
    assert len(out) == 1 and 0 <= out[0].token_id < info.vocab_size


@pytest.mark.parametrize("column,at,value,match", [
    ("token_ids", [0, 1], [1, 49152], "token ids"),
    ("token_ids", [0, 1], [-1, 3], "token ids"),
    ("slot_mapping", [0, 1], [0, 40 * BLOCK], "outside the pool"),
    ("block_tables", (0, 0), 40, "block ids"),
])
def test_an_out_of_range_sequence_is_left_out_and_the_others_run_as_alone(executor, column, at, value, match):
    alone = executor.execute(batch(step("ok", [5, 6, 7], 0, [2])))
    b = batch(step("bad", [1, 2], 0, [0], sample=False), step("ok", [5, 6, 7], 0, [2]))  # "bad" reports nothing
    getattr(b, column)[at] = value  # the columns as a broken step message or rank would give them
    out = executor.execute(b)
    assert [o.seq_id for o in out] == ["bad", "ok"]
    assert out[0].error and re.search(match, out[0].error) and not out[0].sampled
    assert out[1].token_id == alone[0].token_id and not out[1].error
    with pytest.raises(ValueError, match="empty"):
        executor.execute(empty_batch())


def test_a_table_too_short_for_the_tokens_is_refused_before_a_batch_is_made():
    """The running set derives the slots from the table (pagedserve.step.running_set): a step
    whose table does not cover its tokens never reaches the executor."""
    with pytest.raises(ValueError, match="1 blocks in its table, 2 needed for 17 tokens"):
        batch(step("bad", [1, 2], 15, [0]))


def test_a_sequence_whose_grammar_does_not_compile_fails_alone(executor):
    alone = executor.execute(batch(step("ok", [5, 6, 7], 0, [3])))
    bad = step("bad", [1, 2], 0, [4], params=SamplingParams(temperature=0.0, guided_kind="regex",
                                                            guided_spec="(unclosed"))
    out = executor.execute(batch(bad, step("ok", [5, 6, 7], 0, [3])))
    assert [o.seq_id for o in out] == ["bad", "ok"]
    assert "grammar" in out[0].error and not out[0].sampled
    assert out[1].token_id == alone[0].token_id and not out[1].error
