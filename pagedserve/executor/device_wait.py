"""Waiting for a step's device work before the step is reported done.

Another process (memsvc) copies and swaps the pool's blocks from its own CUDA context once a
step is answered, so every write a step launched (store_kv above all) must have finished by
then. Sampling already waits (it reads tokens back to the host); a step that samples nothing
(the middle chunk of a chunked prefill) waits here.
"""
from __future__ import annotations

import torch


def wait_for_device(device: torch.device) -> None:
    """Block until every kernel queued on `device` has finished (nothing to do off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
