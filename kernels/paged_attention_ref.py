"""Paged attention in plain torch: the CPU serving path and the reference for the Triton kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None):
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    num_tokens, num_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    gqa = num_heads != num_kv_heads
    decodes, prefills = [], []
    for b, length in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if q_len == 1:
            decodes.append(b)
        elif q_len > 1:
            prefills.append(b)
    if decodes:
        _decode(q, k_cache, v_cache, block_tables, seq_lens, starts, lens, decodes, scale, gqa, out)
    for b in prefills:
        _prefill(q, k_cache, v_cache, block_tables[b], lens[b], starts[b], starts[b + 1], scale, gqa, out)
    return out


def _gather(cache, table_rows, num_blocks):
    """Blocks named by table_rows [..., n] (padding clamped to valid ids), as [..., n * block_size, kvh, hd]."""
    ids = table_rows.to(torch.long).clamp(0, num_blocks - 1)
    blocks = torch.index_select(cache, 0, ids.reshape(-1))
    return blocks.view(*ids.shape[:-1], -1, *cache.shape[2:])


def _decode(q, k_cache, v_cache, block_tables, seq_lens, starts, lens, decodes, scale, gqa, out):
    num_blocks, block_size, _, head_size = k_cache.shape
    num_heads = q.shape[1]
    batch = len(decodes)
    if batch == len(lens):
        tables, dec_lens = block_tables, seq_lens
        tokens = torch.tensor(starts[:-1], device=q.device) if starts[-1] != batch else None
    else:
        index = torch.tensor(decodes, device=block_tables.device)
        tables, dec_lens = block_tables[index], seq_lens[index]
        tokens = torch.tensor([starts[b] for b in decodes], device=q.device)
    longest = max(lens[b] for b in decodes)
    n_blocks = -(-longest // block_size)
    tables = tables[:, :n_blocks]
    keys = _gather(k_cache, tables, num_blocks).transpose(1, 2)
    values = _gather(v_cache, tables, num_blocks).transpose(1, 2)
    context = n_blocks * block_size
    mask = None
    if any(lens[b] != context for b in decodes):
        positions = torch.arange(context, device=q.device)
        mask = (positions[None, :] < dec_lens.to(q.device, torch.long)[:, None]).view(batch, 1, 1, context)
    queries = q if tokens is None else q[tokens]
    queries = queries.view(batch, num_heads, 1, head_size).to(keys.dtype)
    result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    result = result.view(batch, num_heads, head_size)
    if tokens is None:
        out.copy_(result)
    else:
        out[tokens] = result.to(out.dtype)


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
