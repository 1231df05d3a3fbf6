"""Mixtral over the paged KV pool: the Llama decoder whose MLP is a sparse mixture of experts.

Router: softmax over the experts' logits in float32, the top k kept and renormalized.
Experts are batched per step: the step's (token, expert) pairs are sorted by expert and each
expert with work runs once, over all its tokens, as one gate/up and one down matmul; the
results are weighted and summed back per token (index_add_). Every rank holds every expert,
each split as an MLP is (family.py's sharding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.models import config_fields
from pagedserve.executor.models.decoder import REFUSED, SHARDING, DecoderForCausalLM, DecoderLayer
from pagedserve.executor.models.family import Family


class MixtralDecoderLayer(DecoderLayer):
    @staticmethod
    def mlp_shapes(c, prefix: str) -> dict[str, tuple[int, ...]]:
        moe, h, i = prefix + "block_sparse_moe.", c.hidden_size, c.intermediate_size
        shapes = {moe + "gate.weight": (c.num_experts, h)}
        for e in range(c.num_experts):
            shapes.update({f"{moe}experts.{e}.w1.weight": (i, h), f"{moe}experts.{e}.w3.weight": (i, h),
                           f"{moe}experts.{e}.w2.weight": (h, i)})
        return shapes

    def init_mlp(self, w, prefix: str) -> None:
        moe = prefix + "block_sparse_moe."
        n = self.config.num_experts
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.router = p(w[moe + "gate.weight"])
        self.w13 = p(torch.stack([torch.cat([w[f"{moe}experts.{e}.w1.weight"], w[f"{moe}experts.{e}.w3.weight"]])
                                  for e in range(n)]))  # [E, 2I, H]: gate rows, then up rows
        self.w2 = p(torch.stack([w[f"{moe}experts.{e}.w2.weight"] for e in range(n)]))  # [E, H, I]

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        k = self.config.num_experts_per_tok
        probs = torch.softmax(F.linear(h, self.router).float(), dim=-1)
        top_w, top_i = torch.topk(probs, k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        weights = top_w.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            gate, up = F.linear(h[rows], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate).mul_(up), self.w2[e])
            out.index_add_(0, rows, (y * weights[start:start + n, None]).to(h.dtype))
            start += n
        return out


class MixtralForCausalLM(DecoderForCausalLM):
    layer_class = MixtralDecoderLayer
    cuda_graph_safe = False  # the per-expert split reads the routing on the host


def config(arch: str, cfg: dict) -> dict:
    """config.json -> ModelConfig fields, as transformers reads Mixtral: the window on every layer."""
    return {**config_fields.standard(cfg), **config_fields.rope(cfg), **config_fields.attention_bias(cfg),
            **config_fields.window_everywhere(cfg), "hidden_act": cfg.get("hidden_act", "silu"),
            "num_experts": cfg.get("num_local_experts", 0), "num_experts_per_tok": cfg.get("num_experts_per_tok", 0)}


def validate(c) -> None:
    if not 1 <= c.num_experts_per_tok <= c.num_experts:
        raise ValueError(f"num_experts_per_tok ({c.num_experts_per_tok}) must be in "
                         f"1..num_local_experts ({c.num_experts})")


_SHARDING = {k: v for k, v in SHARDING.items() if k not in ("gate_proj", "up_proj", "down_proj")}
FAMILY = Family(name="mixtral", architectures=("MixtralForCausalLM",), model_class=MixtralForCausalLM,
                config=config, weights=MixtralForCausalLM.weight_shapes, refused=REFUSED, validate=validate,
                sharding={**_SHARDING, "gate": "replicated", "w1": "mlp_rows", "w3": "mlp_rows", "w2": "mlp_columns"})
