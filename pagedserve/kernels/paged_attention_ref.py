"""Paged attention in plain torch: the CPU serving path and the reference for the Triton kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                        window=None, softcap=None):
    """Decodes (q_len 1) of the batch together in one masked SDPA call, prefill chunks one by one.

    window: position p sees only p - window + 1 .. p (a sliding window of `window` positions,
    itself included; transformers' `kv_idx > q_idx - sliding_window`); blocks wholly before
    every query's window are not read, so their table entries may name any block.
    softcap: attention scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2).
    With either, every sequence takes the explicit per-sequence path (_windowed)."""
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    gqa = q.shape[1] != k_cache.shape[2]
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    if window is not None or softcap is not None:
        for b, q_len in enumerate(q_lens):
            if q_len > 0:
                _windowed(q, k_cache, v_cache, block_tables[b], lens[b], starts[b], starts[b + 1],
                          scale, window, softcap, out)
        return out
    decodes = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if decodes:
        _decode(q, k_cache, v_cache, block_tables, seq_lens, starts, lens, decodes, scale, gqa, out)
    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            _prefill(q, k_cache, v_cache, block_tables[b], lens[b], starts[b], starts[b + 1], scale, gqa, out)
    return out


def _gather(cache, table_rows, num_blocks):
    """Blocks named by table_rows [..., n] (padding clamped to valid ids), as [..., n * block_size, kvh, hd]."""
    ids = table_rows.to(torch.long).clamp(0, num_blocks - 1)
    blocks = torch.index_select(cache, 0, ids.reshape(-1))
    return blocks.view(*ids.shape[:-1], -1, *cache.shape[2:])


def _decode(q, k_cache, v_cache, block_tables, seq_lens, starts, lens, decodes, scale, gqa, out):
    num_blocks, block_size, _, head_size = k_cache.shape
    batch, num_heads = len(decodes), q.shape[1]
    if batch == len(lens):
        tables, dec_lens = block_tables, seq_lens
    else:
        index = torch.tensor(decodes, device=block_tables.device)
        tables, dec_lens = block_tables[index], seq_lens[index]
    tokens = [starts[b] for b in decodes]
    if tokens[-1] - tokens[0] == batch - 1:
        tokens = slice(tokens[0], tokens[0] + batch)
    else:
        tokens = torch.tensor(tokens, device=q.device)
    n_blocks = -(-max(lens[b] for b in decodes) // block_size)
    context = n_blocks * block_size
    keys = _gather(k_cache, tables[:, :n_blocks], num_blocks)
    values = _gather(v_cache, tables[:, :n_blocks], num_blocks)
    mask = None
    if any(lens[b] != context for b in decodes):
        positions = torch.arange(context, device=q.device)
        valid = positions[None, :] < dec_lens.to(q.device, torch.long)[:, None]
        # slots past a length (the last block's tail, padding blocks) may hold anything, NaN
        # included: a masked score still multiplies its value, so they are zeroed, not only masked
        keys.masked_fill_(~valid[:, :, None, None], 0)
        values.masked_fill_(~valid[:, :, None, None], 0)
        mask = valid.view(batch, 1, 1, context)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    queries = q[tokens].view(batch, num_heads, 1, head_size).to(keys.dtype)
    result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out[tokens] = result.view(batch, num_heads, head_size)


def _prefill(q, k_cache, v_cache, table, length, start, end, scale, gqa, out):
    num_blocks, block_size = k_cache.shape[:2]
    q_len = end - start
    n_blocks = -(-length // block_size)
    keys = _gather(k_cache, table[:n_blocks], num_blocks)[:length].transpose(0, 1)
    values = _gather(v_cache, table[:n_blocks], num_blocks)[:length].transpose(0, 1)
    queries = q[start:end].transpose(0, 1).to(keys.dtype)
    mask = None
    if q_len != length:
        prefix = length - q_len
        rows = torch.arange(prefix, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= rows[:, None]
    result = F.scaled_dot_product_attention(
        queries[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )
    out[start:end] = result[0].transpose(0, 1)


def _windowed(q, k_cache, v_cache, table, length, start, end, scale, window, softcap, out):
    """One sequence's queries with a sliding window and/or score soft-capping, in float32."""
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    q_len = end - start
    first_pos = 0 if window is None else max(0, length - q_len - window + 1)
    first_block = first_pos // block_size
    n_blocks = -(-length // block_size)
    base = first_block * block_size
    keys = _gather(k_cache, table[first_block:n_blocks], num_blocks)[: length - base].float()
    values = _gather(v_cache, table[first_block:n_blocks], num_blocks)[: length - base].float()
    group = q.shape[1] // kv_heads
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    queries = q[start:end].float()
    scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(length - q_len, length, device=q.device)[:, None]
    cols = torch.arange(base, length, device=q.device)[None, :]
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
