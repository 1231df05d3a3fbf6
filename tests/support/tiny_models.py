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
    # sliding windows far shorter than the test contexts (40 tokens)
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7)),
    "qwen2_swa": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=6,
                                                          max_window_layers=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
        final_logit_softcapping=4.0, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=10, original_max_position_embeddings=64, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                      "long_factor": [4.0] * 8, "original_max_position_embeddings": 64})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=9)),
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
    from pagedserve.step.whole_seqs import Seq, batch_of

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
            lengths[seq_id] = end
            seqs.append(Seq(seq_id, list(ids), start, list(table)))
        yield batch_of(seqs, block_size)


def save_tiny_tokenizer(path, vocab_size: int = 300, eos_id: int = 1) -> None:
    """A word-level tokenizer whose tokens are "w0" .. "w{vocab_size-1}" (split on spaces),
    saved next to a tiny model so the engine and `pagedserve generate` can run it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token=f"w{eos_id}")
    fast.save_pretrained(str(path))
    # name the generic class: AutoTokenizer would otherwise pick the model type's own (Qwen2Tokenizer...)
    import json
    import os

    config_path = os.path.join(str(path), "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def hf_greedy_past_eos(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, run past EOS (as
    ignore_eos does)."""
    hf.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        with torch.inference_mode():
            y = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.append(y[0, len(p):].tolist())
    return out
