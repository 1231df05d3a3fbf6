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
Which cut a tensor gets is its family's declaration (pagedserve/executor/models/family.py:
the tensor's leaf -> one of CUTS, each implemented here).
`config()` is the ModelConfig the rank's decoder is built with (its heads and intermediate
size; the full vocabulary), `weights(w)` the checkpoint as the rank sees it. The sums the
row-parallel layers leave partial are pagedserve.executor.tensor_parallel's business.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.models import registry


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
    then cut to this rank's part (a copy: the whole one is freed at once) as the family's
    sharding says."""

    def __init__(self, weights: Mapping[str, torch.Tensor], plan: ShardPlan, config: ModelConfig):
        self._w, self.plan, self.c = weights, plan, config
        self.family = registry.for_architecture(config.architecture)

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._w[name]
        return self._cut(name, t).clone() if self.plan.world > 1 else t

    def _cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        leaf = name.split(".")[-2] if "." in name else name
        cut = self.family.sharding.get(leaf)
        if cut is None:
            raise KeyError(f"tensor {name}: family {self.family.name!r} declares no sharding for {leaf!r} "
                           f"(its module's Family.sharding)")
        return CUTTERS[cut](self.plan, self.c, name, t)


def _q_rows(p: ShardPlan, c: ModelConfig) -> slice:
    return slice(p.rank * p.heads * c.head_dim, (p.rank + 1) * p.heads * c.head_dim)


def _kv_rows(p: ShardPlan, c: ModelConfig) -> slice:
    return slice(p.kv_start * c.head_dim, (p.kv_start + p.kv_heads) * c.head_dim)


def _mlp_rows(p: ShardPlan) -> slice:
    return slice(p.rank * p.intermediate, (p.rank + 1) * p.intermediate)


def _vocab_rows(p: ShardPlan, c: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    part = t[p.vocab_start:p.vocab_start + p.vocab_per_rank]
    pad = p.vocab_per_rank - part.shape[0]
    return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part


def _qkv_rows(p: ShardPlan, c: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    q, k, v = t.split([c.q_size, c.kv_size, c.kv_size])  # fused: q, k, v rows (Phi-3)
    return torch.cat([q[_q_rows(p, c)], k[_kv_rows(p, c)], v[_kv_rows(p, c)]])


def _q_columns(p: ShardPlan, c: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith(".bias"):  # added once, by rank 0, to the sum of the ranks' parts
        return t if p.rank == 0 else torch.zeros_like(t)
    return t[:, _q_rows(p, c)]


def _gate_up_rows(p: ShardPlan, c: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2)  # fused: gate rows, then up rows (Phi-3)
    return torch.cat([gate[_mlp_rows(p)], up[_mlp_rows(p)]])


# what each of family.CUTS keeps of a tensor
CUTTERS: dict[str, Callable[[ShardPlan, ModelConfig, str, torch.Tensor], torch.Tensor]] = {
    "replicated": lambda p, c, name, t: t,
    "vocab_rows": _vocab_rows,
    "q_rows": lambda p, c, name, t: t[_q_rows(p, c)],
    "kv_rows": lambda p, c, name, t: t[_kv_rows(p, c)],
    "qkv_rows": _qkv_rows,
    "q_columns": _q_columns,
    "mlp_rows": lambda p, c, name, t: t[_mlp_rows(p)],
    "mlp_columns": lambda p, c, name, t: t[:, _mlp_rows(p)],
    "gate_up_rows": _gate_up_rows,
}
