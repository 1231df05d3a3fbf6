"""Tiny random Hugging Face models of each architecture (TINY, TINY_ARCHS, make_tiny_model)
and paged_batches, which builds paged StepBatches with shuffled, non-contiguous blocks."""
from __future__ import annotations

import random

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

TINY_ARCHS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}


def make_tiny_model(path, arch: str, tie: bool = False, seed: int = 0, **overrides):
    """Save a randomly initialised tiny model of `arch` (a TINY_ARCHS key) under `path`.

    Every parameter (norms and biases too) gets random values so each one matters.
    Returns the transformers model (float32, eval mode).
    """
    import transformers

    config_cls, model_cls, extra = TINY_ARCHS[arch]
    kwargs = {**TINY, **extra, "tie_word_embeddings": tie, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


def paged_batches(chunks, block_size: int, num_blocks: int, seed: int = 0):
    """Steps of (seq_id, token_ids) chunks for several sequences, as StepBatches.

    `chunks` is a list of steps; each step a list of (seq_id, new_token_ids). Blocks are
    handed out from a shuffled free list, so no sequence's blocks are contiguous.
    Yields StepBatch objects with every sequence sampling greedily.
    """
    from wire.protocol import SamplingParams, SeqStep, StepBatch

    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables: dict[str, list[int]] = {}
    lengths: dict[str, int] = {}
    for step in chunks:
        seqs = []
        for seq_id, ids in step:
            table = tables.setdefault(seq_id, [])
            start = lengths.get(seq_id, 0)
            end = start + len(ids)
            while len(table) * block_size < end:
                table.append(free.pop())
            slots = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            lengths[seq_id] = end
            seqs.append(SeqStep(seq_id=seq_id, token_ids=list(ids), start_pos=start,
                                slot_mapping=slots, block_table=list(table), sample=True,
                                sampling=SamplingParams(temperature=0.0), seed=0))
        yield StepBatch(seqs)
