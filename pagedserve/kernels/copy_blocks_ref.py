"""Whole-block copies between pools (copy-on-write, swap), in plain torch."""
from __future__ import annotations

import torch


def copy_blocks_ref(src_pool, dst_pool, src_ids, dst_ids):
    src_ids = torch.as_tensor(src_ids, dtype=torch.long).to(src_pool.device)
    dst_ids = torch.as_tensor(dst_ids, dtype=torch.long).to(dst_pool.device)
    if src_ids.numel() == 0:
        return
    blocks = torch.index_select(src_pool, 0, src_ids).to(dst_pool.device)
    dst_pool.index_copy_(0, dst_ids, blocks)
