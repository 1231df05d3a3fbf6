"""How one rank of a tensor-parallel group holds its part of the model (Megatron-style).

ShardPlan.of(config, world, rank) splits the model over `world` ranks, or raises ValueError
naming the numbers that do not divide. Rank r holds:
- attention: its num_heads/world query heads and the KV heads they read: num_kv_heads/world
  of them, or (fewer KV heads than ranks) one KV head, replicated on world/num_kv_heads ranks;
  QKV column-parallel (its rows), o_proj row-parallel (its columns; the bias on rank 0 only);
- MLP: intermediate_size/world of gate/up (rows) and down (columns); Mixtral the same within
  every expert (all experts on every rank, each split; the router replicated);
- embedding and LM head: vocabulary rows [vocab_start, vocab_start + vocab_per_rank), the last
  rank's padded with zero rows when the vocabulary does not divide;
- norms (q/k norms included) replicated.
`config()` is the ModelConfig the rank's decoder is built with (its heads and intermediate
size; the full vocabulary), `weights(w)` the checkpoint as the rank sees it. The sums the
row-parallel layers leave partial are pagedserve.executor.tensor_parallel's business.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from pagedserve.executor.model_config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    world: int
    rank: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank
    kv_start: int  # the first KV head this rank holds
    intermediate: int  # MLP (per expert) width per rank
    vocab_per_rank: int
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, world: int, rank: int) -> "ShardPlan":
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"tensor parallel: rank {rank} of {world} ranks")
        nh, nkv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
        fix = "choose a --tensor-parallel-size that divides it"
        if nh % world:
            raise ValueError(f"tensor parallel size {world}: num_attention_heads ({nh}) is not a "
                             f"multiple of {world}; {fix}")
        if nkv >= world and nkv % world:
            raise ValueError(f"tensor parallel size {world}: num_key_value_heads ({nkv}) is not a "
                             f"multiple of {world}; {fix}")
        if nkv < world and world % nkv:
            raise ValueError(f"tensor parallel size {world}: num_key_value_heads ({nkv}) is fewer "
                             f"than the ranks and does not divide {world}, so the KV heads cannot "
                             f"be replicated evenly; choose a multiple of {nkv}")
        if inter % world:
            raise ValueError(f"tensor parallel size {world}: intermediate_size ({inter}) is not a "
                             f"multiple of {world}; {fix}")
        kv = max(nkv // world, 1)
        per_vocab = -(-config.vocab_size // world)
        return cls(world, rank, nh // world, kv, rank * nkv // world, inter // world, per_vocab,
                   config.vocab_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def group_kv_heads(self) -> int:
        """KV heads summed over the ranks (replicas counted): the pool's num_kv_heads."""
        return self.kv_heads * self.world

    def config(self, config: ModelConfig) -> ModelConfig:
        return dataclasses.replace(config, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.intermediate)

    def weights(self, weights: Mapping[str, torch.Tensor], config: ModelConfig) -> "ShardedWeights":
        return ShardedWeights(weights, self, config)


class ShardedWeights(Mapping):
    """The checkpoint as one rank sees it: each tensor read whole (weights read on lookup),
    then cut to this rank's part (a copy: the whole one is freed at once)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], plan: ShardPlan, config: ModelConfig):
        self._w, self.plan, self.c = weights, plan, config

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._w[name]
        return self._cut(name, t).clone() if self.plan.world > 1 else t

    def _cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        p, c = self.plan, self.c
        leaf = name.split(".")[-2] if "." in name else name
        q_rows = slice(p.rank * p.heads * c.head_dim, (p.rank + 1) * p.heads * c.head_dim)
        kv_rows = slice(p.kv_start * c.head_dim, (p.kv_start + p.kv_heads) * c.head_dim)
        cols = slice(p.rank * p.intermediate, (p.rank + 1) * p.intermediate)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = t[p.vocab_start:p.vocab_start + p.vocab_per_rank]
            pad = p.vocab_per_rank - part.shape[0]
            return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part
        if leaf == "q_proj":
            return t[q_rows]
        if leaf in ("k_proj", "v_proj"):
            return t[kv_rows]
        if leaf == "qkv_proj":  # Phi-3: q, k, v rows fused
            q, k, v = t.split([c.q_size, c.kv_size, c.kv_size])
            return torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        if leaf == "o_proj":
            if name.endswith(".bias"):  # added once, by rank 0, to the sum of the ranks' parts
                return t if p.rank == 0 else torch.zeros_like(t)
            return t[:, q_rows]
        if leaf in ("gate_proj", "up_proj", "w1", "w3"):
            return t[cols]
        if leaf in ("down_proj", "w2"):
            return t[:, cols]
        if leaf == "gate_up_proj":  # Phi-3: gate rows, then up rows
            gate, up = t.chunk(2)
            return torch.cat([gate[cols], up[cols]])
        return t
