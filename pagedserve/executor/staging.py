"""A step's host arrays to the device without waiting: packed into a pinned buffer, one
non-blocking copy per dtype, then views of the device copy.

Two buffers per dtype take turns, so the host fills one while the device may still be
reading the other; before a buffer is filled again, the copy that last read it is waited
for (a CUDA event), which by then has long finished. On a CPU the arrays become tensors
without a copy (`packs` False); `packs=True` there runs the packing path anyway, for tests.
`to_device` sends one host array through pinned memory too (the sampler's columns).
See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

import numpy as np
import torch

_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class Staging:
    def __init__(self, device: torch.device | str, packs: bool | None = None):
        self.device = torch.device(device)
        self.packs = self.device.type == "cuda" if packs is None else packs
        self._buffers: dict[tuple[np.dtype, int], torch.Tensor] = {}
        self._events: dict[tuple[np.dtype, int], object] = {}
        self._turn: dict[np.dtype, int] = {}

    def send(self, arrays: list[np.ndarray], dtype) -> list[torch.Tensor]:
        """`arrays` as device tensors of `dtype` (int64 or int32), each its own shape."""
        dtype = np.dtype(dtype)
        if not self.packs:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(self.device) for a in arrays]
        turn = self._turn[dtype] = self._turn.get(dtype, 1) ^ 1
        key = (dtype, turn)
        total = sum(a.size for a in arrays)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < total:
            size = max(total, 2 * (buf.numel() if buf is not None else 1024))
            buf = torch.empty(size, dtype=_DTYPES[dtype], pin_memory=self.device.type == "cuda")
            self._buffers[key] = buf
        elif (event := self._events.get(key)) is not None:
            event.synchronize()
        host = buf.numpy()
        at, bounds = 0, []
        for a in arrays:
            host[at:at + a.size] = a.reshape(-1)
            bounds.append((at, a.shape))
            at += a.size
        dev = buf[:total].to(self.device, non_blocking=True, copy=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[key] = event
        return [dev[a:a + int(np.prod(shape, dtype=np.int64))].view(shape) for a, shape in bounds]


def to_device(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One host array (numpy or a list) as a tensor on `device` without the host waiting for
    the device: on CUDA through pinned memory and a non-blocking copy (the caching host
    allocator keeps the pinned block until the copy is done); elsewhere as it is."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    if dtype is not None:
        t = t.to(dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
