"""Writing new K/V into their cache slots, in plain torch."""
from __future__ import annotations

import torch


def store_kv_ref(key, value, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep.to(key.device)], value[keep.to(value.device)]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)
