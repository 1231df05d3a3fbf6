"""Any causal LM through Transformers' own modeling code, its attention on the paged pool
(--model-impl transformers; docs/ARCHITECTURE.md).

TransformersModel has the interface of pagedserve/executor/models/llama.py: forward(input_ids [T],
positions [T], meta, kv_pool) -> hidden states [T, H]; compute_logits(hidden) -> float32
logits. The step's tokens go through the Hugging Face model as one batch row at their own
positions, with no mask (`pagedserve` is no mask implementation, so Transformers builds
none); each attention layer calls `paged_attention_forward`, registered as the attention
implementation "pagedserve", which stores the layer's K/V at the step's slots and returns
pagedserve.kernels.paged_attention over the pool. The step reaches it as the forward kwarg
`pagedserve_step`, which Transformers hands on to the attention function in the models
that declare `_supports_attention_backend`.

At load a probe step checks what this relies on: each layer's attention comes here once,
with its layer_idx and the pool's head geometry, causal, with no mask, attention sinks or
position bias; each layer's sliding window is recorded into the config (the KV geometry's
window); and the probe's logits equal the model's own with eager attention. Anything else
is a ModelLoadError naming what differs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers
from torch import nn
from transformers import AttentionInterface

from pagedserve import kernels
from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.linear import Linear
from pagedserve.executor.model_config import ModelConfig

NAME = "pagedserve"
STEP_KWARG = "pagedserve_step"
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias")  # attention sinks, additive biases


@dataclass
class PagedStep:
    """What one step's attention calls need; `calls`, when a list, records each call (the probe)."""

    meta: AttentionMetadata
    kv_pool: torch.Tensor
    calls: list | None = None


@dataclass
class _Call:
    layer: int | None
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    refused: list[str] = field(default_factory=list)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Transformers' attention function: query [1, heads, T, D], key and value [1, kv_heads, T,
    D] after rotary -> ([1, T, heads, D], None)."""
    step: PagedStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"attention implementation {NAME!r} runs only inside a pagedserve step "
                           f"(the {STEP_KWARG} forward kwarg)")
    window = kwargs.get("sliding_window")
    n = getattr(module, "layer_idx", None)
    if step.calls is not None:
        call = _Call(n, query.shape[1], key.shape[1], key.shape[-1], window)
        call.refused = [k for k in UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
        if attention_mask is not None:
            call.refused.append("attention_mask (a mask of the model's own)")
        if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
            call.refused.append("is_causal=False")
        step.calls.append(call)
        fits = (n is not None and 0 <= n < step.kv_pool.shape[1] and query.shape[0] == 1
                and (key.shape[1], key.shape[-1]) == tuple(step.kv_pool.shape[4:]))
        if call.refused or not fits:
            return torch.zeros_like(query).transpose(1, 2), None  # judged after the probe
    meta = step.meta
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    k_cache, v_cache = step.kv_pool[:, n, 0], step.kv_pool[:, n, 1]
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = meta.attend(q, k_cache, v_cache, scale, window=window, softcap=kwargs.get("softcap"))
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, paged_attention_forward)


def use_routed_linears(hf: nn.Module) -> None:
    """Put an pagedserve.executor.linear.Linear in place of each nn.Linear of `hf`, over the same weight
    and bias: the linear backends apply here as in the native models. The weights are passed
    as the model's Parameters, so none is dropped (Transformers' code may read them): a
    layer routed to oneDNN holds its dense and its packed weight."""
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Linear(child.weight, child.bias))


class TransformersModel(nn.Module):
    """A Hugging Face causal LM (`hf`, loaded with attn_implementation "pagedserve") served over
    the pool; `config` is its ModelConfig (impl "transformers")."""

    def __init__(self, hf: nn.Module, config: ModelConfig):
        super().__init__()
        self.hf, self.config = hf, config
        self.base = hf.base_model
        self.head = hf.get_output_embeddings()
        c = hf.config
        # what the CausalLM head does after the LM head: Cohere multiplies, Granite divides,
        # Gemma soft-caps (any other change shows in the probe)
        self.logit_scale = getattr(c, "logit_scale", None)
        self.logits_scaling = getattr(c, "logits_scaling", None)
        self.final_softcap = getattr(c, "final_logit_softcapping", None)
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        rope_type = str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else ""
        # dynamic and longrope rotary read the largest position on the host: no graph capture
        self.cuda_graph_safe = "dynamic" not in rope_type and rope_type != "longrope"

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, dtype: torch.dtype,
             on_built: Callable[[nn.Module], None] | None = None) -> TransformersModel:
        """Load and probe; on_built (pagedserve.executor.linear_backend.Planner.place) routes the model's
        linear layers, each now an pagedserve.executor.linear.Linear over the same weight."""
        model_cls = getattr(transformers, config.architecture, None)
        if model_cls is None:
            raise ModelLoadError(f"{model_dir}: transformers {transformers.__version__} has no class "
                                 f"{config.architecture}")
        if not model_cls.is_backend_compatible():
            raise ModelLoadError(f"{model_dir}: transformers' {config.architecture} does not pass its "
                                 "attention through the attention interface (_supports_attention_backend "
                                 "is false), so its attention cannot run on the paged pool; no "
                                 "Transformers backend for it")
        hf = model_cls.from_pretrained(model_dir, dtype=dtype, attn_implementation=NAME).eval()
        use_routed_linears(hf)
        model = cls(hf, config)
        if on_built is not None:
            on_built(model)
        model.probe(model_dir)
        return model

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pool: torch.Tensor,
                step: PagedStep | None = None):
        step = step or PagedStep(meta, kv_pool)
        out = self.base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                        **{STEP_KWARG: step})
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def probe(self, model_dir: str, tokens: int = 12, block_size: int = 4) -> None:
        """One sequence through the pool and through the model's eager attention (see the module
        docstring); records the layers' windows in the config; ModelLoadError on a difference."""
        c = self.config
        device = self.hf.get_input_embeddings().weight.device
        ids = (torch.arange(tokens, device=device) * 7919 + 3) % c.vocab_size
        pos = torch.arange(tokens, device=device)
        blocks = -(-tokens // block_size)
        pool = torch.zeros(blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim,
                           dtype=self.dtype, device=device)
        i32 = {"dtype": torch.int32, "device": device}
        meta = AttentionMetadata(ids, pos, pos.clone(), torch.arange(blocks, **i32)[None],
                                 torch.tensor([tokens], **i32), torch.tensor([0, tokens], **i32),
                                 pos[-1:].clone(), tokens)
        step = PagedStep(meta, pool, calls=[])
        ours = self.compute_logits(self(ids, pos, meta, pool, step))
        self._judge(model_dir, step.calls)
        self.hf.set_attn_implementation("eager")
        try:
            ref = self.hf(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0].float()
        finally:
            self.hf.set_attn_implementation(NAME)
        err = float((ours - ref).norm() / ref.norm().clamp_min(1e-12))
        if not err <= (1e-3 if self.dtype == torch.float32 else 5e-2):
            raise ModelLoadError(f"{model_dir}: {c.architecture} on the paged pool differs from its own "
                                 f"eager attention (relative error {err:.3g} in the logits): its attention "
                                 "or LM head does something this backend does not; no Transformers backend for it")

    def _judge(self, model_dir: str, calls: list[_Call]) -> None:
        c = self.config
        where = f"{model_dir}: {c.architecture}"
        for call in calls:
            if call.refused:
                raise ModelLoadError(f"{where}: layer {call.layer}'s attention uses {', '.join(call.refused)}, "
                                     "which the paged kernels do not apply; no Transformers backend for it")
            if (call.kv_heads, call.head_dim) != (c.num_kv_heads, c.head_dim) or call.heads % call.kv_heads:
                raise ModelLoadError(f"{where}: layer {call.layer}'s attention has {call.heads} heads over "
                                     f"{call.kv_heads} KV heads of size {call.head_dim}, but config.json reads "
                                     f"as {c.num_kv_heads} KV heads of size {c.head_dim} (num_key_value_heads, "
                                     "head_dim); fix config.json")
        layers = [call.layer for call in calls]
        if layers != list(range(c.num_layers)):
            raise ModelLoadError(f"{where}: its attention layers called in order {layers}, not once each for "
                                 f"layers 0..{c.num_layers - 1} (num_hidden_layers): layers without their own "
                                 "K/V, or attention outside the interface; no Transformers backend for it")
        windows = [call.window for call in calls]
        if any(w is not None for w in windows):
            # one window per config: the largest, which is what the KV geometry frees blocks by
            c.sliding_window = max(w for w in windows if w is not None)
            c.layer_types = ["full_attention" if w is None else "sliding_attention" for w in windows]
