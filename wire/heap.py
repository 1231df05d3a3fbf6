"""The garbage collector of a long-running service.

A service imports torch, transformers and grpc and loads a model or a tokenizer: some 300,000
objects that live as long as the process. CPython's full collections walk every one of
them, and a step allocates enough short-lived objects (plans, grants, deltas) to trigger
one every few steps: at batch 256 that cost the control plane about 2 ms per step.
`freeze_heap()`, once start-up is done, collects once and moves every object alive then
into the permanent generation, which no collection walks again; the collector still runs
for what the service allocates afterwards.
"""
from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then freeze what is left (call once start-up is done). Returns the number
    of objects frozen so far."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
