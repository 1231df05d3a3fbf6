"""Paged attention as Triton kernels: one program per (tile of one sequence's queries, kv
head, split of the context), and a reduction over the splits when there are several.

Rows. A program's rows are BLOCK_Q query tokens x GROUP query heads sharing one kv head,
BLOCK_M rows in all: at least 64 when the batch holds prefill chunks (a K/V tile is read
once for 64 rows, not re-read by every 16-row tile of a long prompt), at least 16 (tl.dot's
minimum) for decode-only batches, where each sequence has one query token. Programs are
numbered as in `query_start_loc[b] // BLOCK_Q + b`, so the grid size is known on the host
without reading any device tensor.

Context. A program walks its context in tiles of TILE positions (a multiple of the block
size): the tile's BLOCKS_PER_TILE block ids are loaded once, one per block, and each
block's positions are addressed from its id. Online softmax in float32 (exp2, with the
scale folded into log2 e). The dots take their inputs in the cache's dtype: bfloat16 and
float16 multiply natively (tensor cores) and accumulate in float32; float32 uses IEEE
float32 (exact against the reference). P is cast to V's dtype for the second dot, as
flash-attention does.

Split context (flash-decoding). When few programs would walk long contexts (decode-only
batches of a few long sequences), the context is cut into num_splits contiguous ranges
of tiles: each (query tile, kv head, split) program writes its unnormalized partial output
with its running max and sum in float32, and `_reduce_splits_kernel` combines them. The
split count is chosen on the host from shapes only (the block table's width bounds the
context), so it is fixed for a CUDA graph; `num_splits=` forces it (tests).

Specialization. Triton compiles a kernel again for each new value class of an integer
argument (equal to 1, divisible by 16, other). The arguments that change from step to step
(the sequence count, the block table's row stride = its width, the split count and the tiles
per split) are `do_not_specialize`, so a server compiles each kernel once per model shape
(the constexprs) and not once more per batch; whether there are splits at all is the
constexpr SPLIT. Strides fixed by the model and the pool stay specialized (a unit inner
stride is what vectorizes the loads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.pool_share.device import on_device

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 512  # a split walks at least this much context
MAX_SPLITS = 64
# Measured on an H200 (docs/benchmark-history.md, "On one H200"): splitting pays
# below ~4 programs per SM (at 4.8, 640 programs of 64 x 2k, 2 splits cost 12%) and pays most
# when the splits make ~8 programs per SM (32 x 8k: 1 split 76% of the copy bandwidth, 4 splits 91%).
SPLIT_BELOW = 4  # programs per SM below which a decode batch's context is split
FILL_WAVES = 8  # programs per SM the splits aim for
_SM_COUNT: dict[int, int] = {}


@triton.jit(do_not_specialize=["num_seqs", "tiles_per_split", "num_splits", "stride_btb"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_ml_ptr,
    qk_scale, num_seqs, tiles_per_split, num_splits, window, cap_in, cap_out,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btn,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, SPLIT: tl.constexpr, NUM_HEADS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= program:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    seq_start = tl.load(query_start_loc_ptr + seq)
    seq_end = tl.load(query_start_loc_ptr + seq + 1)
    tile_start = seq_start + (program - (seq_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= seq_end:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - (seq_end - seq_start)

    rows = tl.arange(0, BLOCK_M)
    tokens = tile_start + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (tokens < seq_end)
    row_pos = context_start + tokens - seq_start
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE

    q = tl.load(
        q_ptr + tokens[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    last_pos = context_start + tl.minimum(tile_start + BLOCK_Q, seq_end) - 1 - seq_start
    num_tiles = last_pos // TILE + 1
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)
    first_pos = 0  # the first position any row of this program sees
    if HAS_WINDOW:
        first_pos = tl.maximum(context_start + tile_start - seq_start - window + 1, 0)
        first_tile = tl.maximum(first_tile, first_pos // TILE)
    table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    in_tile = tl.arange(0, TILE)
    for tile in range(first_tile, end_tile):
        positions = tile * TILE + in_tile
        kv_ok = (positions <= last_pos) & (positions >= first_pos)
        if BLOCKS_PER_TILE > 0:  # one block id per block: [BLOCKS_PER_TILE] loads, broadcast
            block_index = tile * BLOCKS_PER_TILE + tl.arange(0, BLOCKS_PER_TILE)
            ids = tl.load(table + block_index * stride_btn,
                          mask=(block_index * BLOCK_SIZE <= last_pos)
                          & ((block_index + 1) * BLOCK_SIZE > first_pos), other=0).to(tl.int64)
            blocks = tl.reshape(tl.broadcast_to(ids[:, None], (BLOCKS_PER_TILE, BLOCK_SIZE)), (TILE,))
        else:  # a block size that is not a power of two: one id per position
            blocks = tl.load(table + (positions // BLOCK_SIZE) * stride_btn, mask=kv_ok, other=0).to(tl.int64)
        offsets = positions % BLOCK_SIZE
        kv_mask = kv_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + blocks[:, None] * stride_kb + offsets[:, None] * stride_ko + kv_head * stride_kh
                    + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + blocks[:, None] * stride_vb + offsets[:, None] * stride_vo + kv_head * stride_vh
                    + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:  # cap * tanh(s * scale / cap), in log2 units; tanh(x) = 2 sigmoid(2x) - 1
            s = (2.0 * tl.sigmoid(2.0 * s * cap_in) - 1.0) * cap_out
        else:
            s = s * qk_scale
        visible = kv_ok[None, :] & (positions[None, :] <= row_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (positions[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if not SPLIT:
        result = acc / l[:, None]
        tl.store(
            out_ptr + tokens[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
            + dims[None, :] * stride_od,
            result.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:  # partials: acc [T, H, S, HEAD_PAD], (m, l) [T, H, S, 2], contiguous float32
        part = (tokens.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, num_splits, stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_PAD)
    part = (token * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.where(split_ok & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    result = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
             result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_splits(num_programs: int, max_context: int, decode_only: bool, sm_count: int) -> int:
    """How many context splits: 1 unless a decode-only batch has fewer programs than
    SPLIT_BELOW per SM of the GPU and a long enough context to share (at least
    MIN_SPLIT_TOKENS a split); then enough for FILL_WAVES programs per SM."""
    if not decode_only or num_programs >= SPLIT_BELOW * sm_count:
        return 1
    by_context = max_context // MIN_SPLIT_TOKENS
    by_fill = -(-FILL_WAVES * sm_count // max(num_programs, 1))
    return max(1, min(by_context, by_fill, MAX_SPLITS))


def launch_config(num_tokens: int, num_seqs: int, group: int, block_size: int, head_size: int,
                  tile: int | None = None) -> dict:
    """Rows, tile and warps for a batch: decode-only batches (at most one query token a
    sequence on average) get 16-row programs, others at least 64 rows."""
    decode_only = num_tokens <= num_seqs
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group))
    pow2_block = block_size & (block_size - 1) == 0
    if tile is None:
        tile = max(64 if head_size <= 128 else 32, block_size) if pow2_block else 32
        if not decode_only and head_size > 128:
            tile = max(32, block_size) if pow2_block else 32
    assert tile >= 16 and tile & (tile - 1) == 0, "tile: a power of two >= 16"
    blocks_per_tile = tile // block_size if pow2_block and tile % block_size == 0 else 0
    return dict(decode_only=decode_only, block_m=block_m, block_q=block_m // group, tile=tile,
                blocks_per_tile=blocks_per_tile, num_warps=4 if block_m <= 64 else 8)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                           tile=None, num_splits=None, window=None, softcap=None, num_warps=None, num_stages=None):
    """tile, num_splits, num_warps, num_stages: override the host's choice (tests, and the
    GPU's launch sweep, scripts/gpu_kernel_sweep.py); None: launch_config's and Triton's."""
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    num_tokens, num_heads, _ = q.shape
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache: [num_blocks, block_size, num_kv_heads, head_size]"
    assert q.shape[2] == head_size and num_heads % num_kv_heads == 0, "q: [T, num_heads, head_size], GQA"
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32
    assert seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1 == block_tables.shape[0] + 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    cfg = launch_config(num_tokens, num_seqs, group, block_size, head_size, tile)
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    cfg["num_stages"] = num_stages
    grid_q = num_tokens // cfg["block_q"] + num_seqs
    head_pad = max(16, triton.next_power_of_2(head_size))
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = 1
        if q.is_cuda:
            num_splits = choose_splits(grid_q * num_kv_heads, max_context, cfg["decode_only"], _sm_count(q.device))
    max_tiles = -(-max_context // cfg["tile"])
    tiles_per_split = max(1, -(-max_tiles // num_splits))
    num_splits = -(-max_tiles // tiles_per_split) if num_splits > 1 else 1
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
        tiles_per_split = max(max_tiles, 1 << 30)  # never the bound: the context is
    with on_device(q.device):  # launch on q's GPU, not the thread's current one
        _launch(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale, cfg, grid_q,
                num_kv_heads, num_splits, tiles_per_split, head_pad, part_acc, part_ml, window, softcap)
    return out


def _launch(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale, cfg, grid_q,
            num_kv_heads, num_splits, tiles_per_split, head_pad, part_acc, part_ml, window=None, softcap=None):
    num_tokens, num_heads, head_size = q.shape
    block_size = k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, part_acc, part_ml,
        scale * LOG2E, num_seqs, tiles_per_split, num_splits,
        int(window or 0), float(scale / softcap) if softcap else 0.0, float(softcap * LOG2E) if softcap else 0.0,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        GROUP=group, BLOCK_Q=cfg["block_q"], BLOCK_M=cfg["block_m"],
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TILE=cfg["tile"],
        BLOCKS_PER_TILE=cfg["blocks_per_tile"], SPLIT=num_splits > 1, NUM_HEADS=num_heads,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        num_warps=cfg["num_warps"], **({"num_stages": cfg["num_stages"]} if cfg.get("num_stages") else {}),
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, num_splits, out.stride(0), out.stride(1), out.stride(2),
            NUM_HEADS=num_heads, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        )
