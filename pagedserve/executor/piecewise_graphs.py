"""CUDA graphs for the steps decode graphs do not hold (a prompt chunk in the step): everything
but attention, captured per token-count bucket.

`PiecewiseGraphs` captures the model's forward over a bucket's static inputs (token ids,
positions, slots: `token_buckets`) as pieces split at each layer's attention
(AttentionMetadata.attend): piece 0 from the embedding to layer 0's attention, piece i from
attention i - 1's output to attention i, the last to the final norm. Between two pieces the
attention runs eagerly over the step's real sequences (tables, lengths, query starts), which
no bucket could fix, reading the queries from one buffer and writing into another that every
piece of every bucket shares ([max_tokens, heads, head_size] each). A step of T tokens pads
to its bucket: padding tokens write no K/V (slot -1), attend to nothing and are dropped.

Tensors that live from one piece to the next (the residual) come from the graphs' private
pool: a bucket's pieces replay in one run, so no other capture's use of that memory falls
between them. Every bucket is captured at start-up (`capture_all`, with a progress bar),
then checked: a replay of a step with no K/V writes must give the eager forward's hidden
states, or the bucket is dropped with a warning and such steps run eagerly (as they do where
a capture fails). `replays`
counts the steps the pieces ran. Only for a model whose forward keeps to the device
(cuda_graph_safe) and runs in one process (no tensor-parallel collectives). See
docs/ARCHITECTURE.md, "The pool and how it is shared".
"""
from __future__ import annotations

import logging
import sys
from dataclasses import replace

import torch

from pagedserve import kernels
from pagedserve.executor.cuda_graphs import bucket_for

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 2048  # the gateway's default step (--max-num-batched-tokens)
CHECK_TOLERANCE = 0.02  # of the largest hidden value: bf16 kernels picked for another row count differ this much


def token_buckets(max_tokens: int = DEFAULT_MAX_TOKENS) -> list[int]:
    """16, 32, 48, 64, 96, 128, 192, 256, 384, ... (a step pads to at most 1.5x its tokens),
    up to max_tokens, the last."""
    out, p = [16, 32, 48], 64
    while p < max_tokens:
        out += [p, p * 3 // 2]
        p *= 2
    return sorted({b for b in out if b < max_tokens} | {max_tokens})


class _Bucket:
    def __init__(self, size: int, device):
        long = dict(dtype=torch.int64, device=device)
        self.size = size
        self.input_ids = torch.zeros(size, **long)
        self.positions = torch.zeros(size, **long)
        self.slot_mapping = torch.full((size,), -1, **long)
        self.pieces: list = []  # graphs, one more than the splits
        self.splits: list[tuple] = []  # each attention's (k_cache, v_cache, scale, window, softcap)
        self.hidden: torch.Tensor | None = None

    def load(self, meta) -> None:
        t = meta.num_tokens
        for buf, src, pad in ((self.input_ids, meta.input_ids, 0), (self.positions, meta.positions, 0),
                              (self.slot_mapping, meta.slot_mapping, -1)):
            buf[:t].copy_(src, non_blocking=True)
            buf[t:].fill_(pad)


class PiecewiseGraphs:
    """`model(input_ids, positions, meta, kv_pool)` -> hidden states [T, hidden]. `graph_cls`
    is torch.cuda.CUDAGraph; tests pass a stand-in (capture_begin, capture_end, replay)."""

    def __init__(self, model, kv_pool: torch.Tensor, meta_cls, max_tokens: int = DEFAULT_MAX_TOKENS,
                 graph_cls=None, stream=None):
        self.model, self.kv_pool, self.meta_cls = model, kv_pool, meta_cls
        self.sizes = token_buckets(max_tokens)
        self.graph_cls = graph_cls or torch.cuda.CUDAGraph
        self.stream = stream  # the captures' (CUDA: a side stream)
        self.mempool = None
        self.q = self.o = None  # the split buffers, sized at the first capture
        self.buckets: dict[int, _Bucket] = {}
        self.dropped: set[int] = set()  # buckets whose check failed
        self.replays = 0

    @classmethod
    def for_pool(cls, model, kv_pool: torch.Tensor, max_tokens: int = DEFAULT_MAX_TOKENS, enabled: bool = True):
        """Graphs for a model over a CUDA pool; None on the CPU, when disabled, for a model
        whose forward reads device values on the host, and for a tensor-parallel rank."""
        if not enabled or not kv_pool.is_cuda or not getattr(model, "cuda_graph_safe", True) \
                or getattr(model, "tp", None) is not None:
            return None
        from pagedserve.executor.attention_metadata import AttentionMetadata

        return cls(model, kv_pool, AttentionMetadata, max_tokens, stream=torch.cuda.Stream(kv_pool.device))

    def eligible(self, meta) -> bool:
        t = meta.num_tokens
        size = bucket_for(t, self.sizes)
        return size is not None and size not in self.dropped and meta.input_ids.is_cuda == self.kv_pool.is_cuda

    def capture_all(self, progress: bool | None = None) -> int:
        """Capture and check every bucket not captured yet (progress: a bar on stderr; None:
        when stderr is a terminal); the number captured."""
        from tqdm import tqdm

        missing = [s for s in self.sizes if s not in self.buckets and s not in self.dropped]
        show = sys.stderr.isatty() if progress is None else progress
        for size in tqdm(missing, desc="CUDA graphs (prompt steps)", unit="bucket", disable=not show or not missing):
            self._bucket(size)
        return len(missing)

    def run(self, meta) -> torch.Tensor | None:
        """Hidden states [T, hidden] of an eligible step, by replaying its bucket's pieces
        (None: its bucket, captured now, was dropped: the step runs eagerly)."""
        b = self._bucket(bucket_for(meta.num_tokens, self.sizes))
        if b is None:
            return None
        hidden = self._replay(b, meta)
        self.replays += 1
        return hidden

    def _replay(self, b: _Bucket, meta) -> torch.Tensor:
        t = meta.num_tokens
        b.load(meta)
        q, o = self.q[:t], self.o[:t]
        for i, piece in enumerate(b.pieces):
            piece.replay()
            if i < len(b.splits):
                k_cache, v_cache, scale, window, softcap = b.splits[i]
                kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        scale, out=o, window=window, softcap=softcap)
        return b.hidden[:t]

    def _bucket(self, size: int) -> _Bucket | None:
        if size in self.dropped:
            return None
        b = self.buckets.get(size)
        if b is None:
            b = _Bucket(size, self.kv_pool.device)
            try:
                self._capture_on_side(b)
                why = None if self._check(b) else "it disagrees with the eager forward"
            except Exception as e:  # noqa: BLE001 - a bucket that cannot be captured runs eagerly
                why = f"its capture failed ({type(e).__name__}: {e})"
            if why is not None:
                self.dropped.add(size)
                log.warning("the piecewise CUDA graph of %d tokens is dropped, %s: such steps run eagerly", size, why)
                return None
            self.buckets[size] = b
        return b

    def _capture_on_side(self, b: _Bucket) -> None:
        if self.stream is None:
            with torch.inference_mode():
                return self._capture(b)
        current = torch.cuda.current_stream(self.kv_pool.device)  # after what the device has queued
        self.stream.wait_stream(current)
        try:
            with torch.inference_mode(), torch.cuda.stream(self.stream):
                self._capture(b)
        finally:
            current.wait_stream(self.stream)

    def _meta(self, size: int, input_ids, positions, slot_mapping):
        """One sequence of `size` tokens at 0.. (the capture's and the check's)."""
        dev, bs = self.kv_pool.device, self.kv_pool.shape[3]
        i32 = dict(dtype=torch.int32, device=dev)
        return self.meta_cls(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                             block_tables=torch.zeros((1, -(-size // bs)), **i32),
                             seq_lens=torch.tensor([size], **i32), query_start_loc=torch.tensor([0, size], **i32),
                             sample_indices=torch.tensor([size - 1], dtype=torch.int64, device=dev),
                             max_seq_len=size)

    def _capture(self, b: _Bucket) -> None:
        """Warm up eagerly (kernels compile, the allocator settles, the split buffers are
        made), then capture piece by piece."""
        pool, model = self.kv_pool, self.model
        b.positions.copy_(torch.arange(b.size, device=pool.device))
        meta = self._meta(b.size, b.input_ids, b.positions, b.slot_mapping)

        def warm(q, k_cache, v_cache, scale, window, softcap):
            if self.q is None:
                self.q = torch.zeros((self.sizes[-1], *q.shape[1:]), dtype=q.dtype, device=q.device)
                self.o = torch.zeros_like(self.q)
            return meta.attend(q, k_cache, v_cache, scale, window, softcap)

        model(b.input_ids, b.positions, replace(meta, split=warm), pool)
        graph = self._begin()

        def split(q, k_cache, v_cache, scale, window, softcap):
            nonlocal graph
            self.q[:b.size].copy_(q)
            graph.capture_end()
            b.pieces.append(graph)
            b.splits.append((k_cache, v_cache, scale, window, softcap))
            graph = self._begin()
            return self.o[:b.size]

        try:
            b.hidden = model(b.input_ids, b.positions, replace(meta, split=split), pool)
        finally:  # no capture is left open, whatever failed
            graph.capture_end()
        b.pieces.append(graph)
        b.positions.zero_()

    def _begin(self):
        graph = self.graph_cls()
        if self.mempool is None and self.kv_pool.is_cuda:
            self.mempool = torch.cuda.graph_pool_handle()
        graph.capture_begin(pool=self.mempool)
        return graph

    def _check(self, b: _Bucket) -> bool:
        """A step of b.size - 3 tokens (padding included), no K/V written: replay = eager?"""
        t = max(1, b.size - 3)
        dev = self.kv_pool.device
        ids = torch.randint(0, 100, (t,), device=dev)
        positions = torch.arange(t, device=dev)
        meta = self._meta(t, ids, positions, torch.full((t,), -1, dtype=torch.int64, device=dev))
        with torch.inference_mode():
            eager = self.model(ids, positions, meta, self.kv_pool).float()
            replayed = self._replay(b, meta).float()
        return bool((replayed - eager).abs().max() <= CHECK_TOLERANCE * eager.abs().max() + 1e-3)

