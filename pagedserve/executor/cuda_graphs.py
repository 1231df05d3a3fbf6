"""CUDA graphs for decode steps at bucketed batch sizes.

A decode step of a small batch is launch-bound: tens of kernels a layer, each shorter than
its launch. `DecodeGraphs` captures the model's forward once per bucket (batch sizes 1, 2,
4, 8, then steps of 8 and 16 up to `max_batch`) over static input buffers, and replays it:
a decode-only step of B sequences pads to the next bucket, copies its metadata into the
bucket's buffers and replays one graph. Padding rows compute nothing that matters: slot -1
(store_kv skips it), block table 0, context length 1 (reads block 0, which holds finite
numbers), and their hidden states are dropped. With `head` (the model's compute_logits) the
graph goes on through the LM head into one logits buffer all buckets share ([max_batch,
vocab], float32: the sampler's input) and the greedy choice of each row (`Replayed`).

What is fixed by a capture: the pool tensor (a new pool, after memsvc restarts, needs new
graphs: make a new DecodeGraphs in attach_pool), the block-table width (`max_blocks`, the
model's maximum length in blocks; a wider table runs eagerly) and so the split-context
choice of the attention kernel, which depends on shapes only.

Every bucket is captured once the pool is attached, before the first served step
(`capture_all`, with a progress bar: the executor's bring-up calls it); a bucket still
missing is captured on first use. `replays` counts the steps a graph ran; the model runner
counts the steps run eagerly beside graphs (pagedserve.executor.piecewise_graphs takes most
of those: a prompt chunk in the step); the executor's metrics read both.

The model runner's hook (pagedserve/executor/model_runner.py):
    __init__/attach_pool:  self.graphs = DecodeGraphs.for_pool(self.model, self.config, kv_pool)
    _hidden, after meta:   if self.graphs is not None and self.graphs.eligible(meta):
                               replayed = self.graphs.run(meta)  (logits, tokens: the sampler's)
"""
from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass, replace

import torch

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_MODEL_LEN = 8192


def buckets(max_batch: int = DEFAULT_MAX_BATCH) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 80, ... up to max_batch (included)."""
    out = [b for b in (1, 2, 4, 8) if b <= max_batch]
    b = 8
    while b < max_batch:
        b += 8 if b < 32 else 16
        out.append(min(b, max_batch))
    out.append(max_batch)
    return sorted(set(b for b in out if b <= max_batch))


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `batch` sequences; None if none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class _StaticStep:
    """One bucket's input buffers, its metadata over them, and its captured graph."""

    def __init__(self, size: int, max_blocks: int, device, meta_template):
        long = dict(dtype=torch.int64, device=device)
        self.size = size
        self.input_ids = torch.zeros(size, **long)
        self.positions = torch.zeros(size, **long)
        self.slot_mapping = torch.full((size,), -1, **long)
        self.block_tables = torch.zeros((size, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.meta = replace(
            meta_template, input_ids=self.input_ids, positions=self.positions, slot_mapping=self.slot_mapping,
            block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            sample_indices=torch.arange(size, dtype=torch.int64, device=device),
            max_seq_len=meta_template.max_seq_len,
        )
        self.graph = None
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None  # a view of DecodeGraphs.logits: the step's rows first
        self.tokens: torch.Tensor | None = None  # each row's most likely token

    def load(self, meta) -> None:
        """Copy a decode step of B <= size sequences into the buffers; pad the rest."""
        b = meta.num_tokens
        w = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(meta.input_ids, non_blocking=True)
        self.positions[:b].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[b:].fill_(-1)
        self.block_tables[:b, :w].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:b, w:].zero_()
        self.block_tables[b:].zero_()
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[b:].fill_(1)
        self.positions[b:].zero_()
        self.input_ids[b:].zero_()


@dataclass
class Replayed:
    """A replayed step's outputs, its B rows: hidden states [B, hidden]; with a head, the
    float32 logits [B, vocab] and the greedy tokens [B] (int64); valid until the next replay."""
    hidden: torch.Tensor
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


class DecodeGraphs:
    """Captured decode forwards of `model` over `kv_pool`, one per bucket, made on first use.

    `model(input_ids, positions, meta, kv_pool)` returns hidden states [T, hidden]; `head`,
    when given, their float32 logits [T, vocab]. `graph_cls` and `capture` are
    torch.cuda.CUDAGraph and torch.cuda.graph; tests pass eager stand-ins.
    """

    def __init__(self, model, kv_pool: torch.Tensor, meta_cls, max_blocks: int, max_batch: int = DEFAULT_MAX_BATCH,
                 graph_cls=None, capture=None, warmup: int = 2, head=None, vocab_size: int = 0):
        self.model = model
        self.head = head
        self.logits = torch.empty((max_batch, vocab_size), dtype=torch.float32, device=kv_pool.device) \
            if head is not None else None
        self.kv_pool = kv_pool
        self.meta_cls = meta_cls
        self.max_blocks = max_blocks
        self.block_size = kv_pool.shape[3]
        self.sizes = buckets(max_batch)
        self.graph_cls = graph_cls or torch.cuda.CUDAGraph
        self.capture = capture or torch.cuda.graph
        self.warmup = warmup
        self.steps: dict[int, _StaticStep] = {}
        self.mempool = None  # shared by every bucket's graph
        self.replays = 0  # steps a graph ran

    @classmethod
    def for_pool(cls, model, config, kv_pool: torch.Tensor, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 max_batch: int = DEFAULT_MAX_BATCH, enabled: bool = True):
        """Graphs for a model over a CUDA pool; None on the CPU, when disabled, or for a model
        whose forward reads device values on the host (cuda_graph_safe = False: Mixtral's routing)."""
        if not enabled or not kv_pool.is_cuda or not getattr(model, "cuda_graph_safe", True):
            return None
        from pagedserve.executor.attention_metadata import AttentionMetadata

        max_len = min(max_model_len, getattr(config, "max_position_embeddings", max_model_len) or max_model_len)
        return cls(model, kv_pool, AttentionMetadata, -(-max_len // kv_pool.shape[3]), max_batch,
                   head=model.compute_logits, vocab_size=config.vocab_size)

    def eligible(self, meta) -> bool:
        """A decode-only step (one token a sequence) that a bucket holds."""
        b = meta.num_tokens
        return (b == meta.seq_lens.shape[0] and b <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.max_blocks and meta.input_ids.is_cuda == self.kv_pool.is_cuda)

    def _template(self, size: int):
        device = self.kv_pool.device
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return self.meta_cls(input_ids=empty, positions=empty, slot_mapping=empty,
                             block_tables=torch.zeros((0, 0), dtype=torch.int32, device=device),
                             seq_lens=empty.int(), query_start_loc=empty.int(), sample_indices=empty,
                             max_seq_len=self.max_blocks * self.block_size)

    def capture_all(self, progress: bool | None = None) -> int:
        """Capture every bucket not captured yet, smallest first (progress: a bar on stderr;
        None: when stderr is a terminal); the number captured."""
        from tqdm import tqdm

        missing = [size for size in self.sizes if size not in self.steps]
        show = sys.stderr.isatty() if progress is None else progress
        for size in tqdm(missing, desc="CUDA graphs", unit="bucket", disable=not show or not missing):
            self._step(size)
        return len(missing)

    def _step(self, size: int) -> _StaticStep:
        step = self.steps.get(size)
        if step is None:
            step = _StaticStep(size, self.max_blocks, self.kv_pool.device, self._template(size))
            self._capture(step)
            self.steps[size] = step
        return step

    def _capture(self, step: _StaticStep) -> None:
        """Warm up (Triton compiles, allocator settles) on a side stream, then capture."""
        pool = self.kv_pool
        if pool.is_cuda:
            side = torch.cuda.Stream(pool.device)
            side.wait_stream(torch.cuda.current_stream(pool.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._forward(step)
            torch.cuda.current_stream(pool.device).wait_stream(side)
        graph = self.graph_cls()
        kwargs = {"pool": self.mempool} if self.mempool is not None else {}
        with self.capture(graph, **kwargs):
            self._forward(step)
        if self.mempool is None and hasattr(graph, "pool"):
            self.mempool = graph.pool()
        step.graph = graph

    def _forward(self, step: _StaticStep) -> None:
        step.hidden = self.model(step.input_ids, step.positions, step.meta, self.kv_pool)
        if self.head is not None:
            step.logits = self.logits[:step.size]
            step.logits.copy_(self.head(step.hidden))
            step.tokens = step.logits.max(-1).indices

    @torch.inference_mode()
    def run(self, meta) -> Replayed:
        """An eligible decode step's outputs, by graph replay."""
        size = bucket_for(meta.num_tokens, self.sizes)
        step = self._step(size)
        step.load(meta)
        step.graph.replay()
        self.replays += 1
        b = meta.num_tokens
        if self.head is None:
            return Replayed(step.hidden[:b])
        return Replayed(step.hidden[:b], step.logits[:b], step.tokens[:b])
